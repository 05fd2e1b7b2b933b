"""Piecewise CUDA graphs: steps that mix prefill and decode, replayed but for attention itself.

A mixed step (a prefill chunk beside running decodes, or several prompts) cannot replay a
whole-step graph: its attention grids depend on how its tokens split into sequences. Launched
eagerly, its ~400 kernels cost ~18 ms of Python on the H200's host, more than the GPU needs
for a step of up to ~1,000 tokens (BENCHMARKS.md: the closed-loop budget sweep), so small step
budgets, which mix decode rows into prefill steps, were host-bound. Here everything between two
attentions is one graph per token count of a ladder, and only attention runs eagerly, on the
real rows, with the step's own metadata (what vLLM's piecewise graphs do):

    piece 0      embed; layer 0: add+RMSNorm, qkv, RoPE + KV write      -> q, k, v, residual
    attention 0  eager: paged attention of the real rows               -> attn
    piece i      layer i-1: o_proj, add+RMSNorm, MLP; layer i: add+RMSNorm, qkv, RoPE + KV write
    ...
    piece L      layer L-1: o_proj, add+RMSNorm, MLP; final RMSNorm     -> hidden

Pieces talk through static buffers (input_ids, positions, slot_mapping, residual, q, k, v,
attn, hidden), sized for the largest graph; a step of T tokens replays the graphs of the next
ladder size S >= T. Rows T..S-1 are padding: slot -1 (the KV write skips them), no attention
covers them, and every other op is row-wise, so they only compute garbage in their own rows.
All graphs share one memory pool: they never run concurrently and keep nothing in it between
replays (what crosses a piece boundary lives in the static buffers).

On the CPU there is nothing to capture: the same pieces run eagerly, so the decomposition is
tested against the model's own forward without a GPU.
"""
from __future__ import annotations

import logging

import torch

from gpu_worker.cuda_graphs import CaptureTimes, capture_graph
from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.models.decoder import CausalLM, KVCache

log = logging.getLogger(__name__)

LADDER_STEP = 64     # a step pads at most 63 rows
# Steps this small stay eager: with FP8 weights they take the weight-only GEMV (up to 4 rows,
# models/layers/fp8.py), which a graph padded to 64 rows would replace by per-token-quantized
# scaled_mm, another rounding; and launching them costs little.
EAGER_MAX_TOKENS = 4


def piecewise_sizes(max_tokens: int) -> list[int]:
    """64, 128, ... up to max_tokens."""
    return list(range(LADDER_STEP, max_tokens + 1, LADDER_STEP))


class PiecewiseGraphs:
    def __init__(self, model: CausalLM, kv_caches: list[KVCache], *, device: torch.device, max_tokens: int,
                 pdl: bool = True):
        self.model, self.kv_caches, self.pdl = model, kv_caches, pdl   # pdl: cuda_graphs.capture_graph's
        self.layers = list(model.model.layers)
        self.device = torch.device(device)
        self.sizes = piecewise_sizes(max_tokens)
        if not self.sizes:
            raise ValueError(f"piecewise graphs need max_tokens >= {LADDER_STEP}, got {max_tokens}")
        n, cfg = self.sizes[-1], model.cfg
        dt = model.model.embed_tokens.weight.dtype
        f = dict(dtype=dt, device=self.device)
        i64 = dict(dtype=torch.int64, device=self.device)
        self.input_ids = torch.zeros(n, **i64)                                  # (N,)
        self.positions = torch.zeros(n, **i64)                                  # (N,)
        self.slot_mapping = torch.full((n,), -1, **i64)                         # (N,)
        self.residual = torch.zeros(n, cfg.hidden_size, **f)                    # (N, H)
        self.hidden = torch.zeros(n, cfg.hidden_size, **f)                      # (N, H) the output
        self.q = torch.zeros(n, cfg.num_heads, cfg.head_dim, **f)               # (N, nh, D)
        self.k = torch.zeros(n, cfg.num_kv_heads, cfg.head_dim, **f)            # (N, nkv, D)
        self.v = torch.zeros(n, cfg.num_kv_heads, cfg.head_dim, **f)            # (N, nkv, D)
        self.attn = torch.zeros(n, cfg.num_heads, cfg.head_dim, **f)            # (N, nh, D)
        self.cached = True     # whether the pieces write K/V (the fused RoPE + KV-write kernel)
        self.graphs: dict[int, list] = {}                                        # size -> L + 1 graphs
        self.capture_times = CaptureTimes(f"piecewise ({len(self.layers) + 1} per size)", list(reversed(self.sizes)),
                                          self.device)

    # ---- the pieces ----------------------------------------------------------------------------
    def _piece(self, i: int, size: int) -> None:
        """Piece i at `size` rows: the end of layer i - 1 (none for i = 0), then the start of
        layer i (the final norm for i = L); reads and writes the static buffers only."""
        rows = slice(0, size)
        if i == 0:
            x, residual = self.model.model.embed_tokens(self.input_ids[rows]), None
        else:
            prev = self.layers[i - 1]
            h = prev.self_attn.o_proj(self.attn[rows].reshape(size, -1))
            h, residual = prev.post_attention_layernorm.add_forward(h, self.residual[rows])
            x = prev.mlp(h)
        if i == len(self.layers):
            self.hidden[rows].copy_(self.model.model.norm.add_forward(x, residual)[0])
            return
        layer = self.layers[i]
        h, residual = layer.input_layernorm.add_forward(x, residual)
        q, k, v, self.cached = layer.self_attn.project(h, self.positions[rows], self.kv_caches[i],
                                                       self.slot_mapping[rows])
        self.residual[rows].copy_(residual)
        self.q[rows].copy_(q)
        self.k[rows].copy_(k)
        self.v[rows].copy_(v)

    def _attention(self, i: int, batch: ForwardBatch) -> None:
        """Layer i's attention over the step's real rows, eagerly: its grids follow the batch."""
        t = batch.num_tokens
        if batch.layer_loads is not None:           # layer i's loaded blocks land before it reads them
            batch.layer_loads.before_layer(i)
        out = self.layers[i].self_attn.attend(self.q[:t], self.k[:t], self.v[:t], self.cached,
                                              self.kv_caches[i], batch)
        self.attn[:t].copy_(out)

    # ---- capture -------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Every size, largest first, its L + 1 pieces in order, all in one memory pool; slots -1
        while capturing (nothing is written to the KV cache)."""
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        for size in self.capture_times:
            self.input_ids[:size].zero_()
            self.positions[:size].copy_(torch.arange(size, device=self.device))
            self.slot_mapping.fill_(-1)
            if pool is None:                 # CPU: replays run the pieces eagerly
                self.graphs[size] = [None] * (len(self.layers) + 1)
                continue
            self.graphs[size] = [capture_graph(lambda _b, i=i: self._piece(i, size), None, pool, self.device, pdl=self.pdl)[0]
                                 for i in range(len(self.layers) + 1)]
        if pool is not None:
            torch.cuda.synchronize(self.device)
            log.info("captured %s; steps of up to %d tokens", self.capture_times.summary(), self.sizes[-1])

    # ---- replay --------------------------------------------------------------------------------
    def bucket(self, num_tokens: int) -> int | None:
        return next((s for s in self.sizes if s >= num_tokens), None)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (bool(self.graphs) and batch.num_tokens > EAGER_MAX_TOKENS
                and self.bucket(batch.num_tokens) is not None)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """(T, H) final hidden states of the batch's rows; valid until the next run."""
        T = batch.num_tokens
        size = self.bucket(T)
        self.input_ids[:T].copy_(batch.input_ids, non_blocking=True)
        self.positions[:T].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:T].copy_(batch.slot_mapping, non_blocking=True)
        self.slot_mapping[T:size].fill_(-1)
        for i, graph in enumerate(self.graphs[size]):
            if graph is None:
                self._piece(i, size)
            else:
                graph.replay()
            if i < len(self.layers):
                self._attention(i, batch)
        return self.hidden[:T]
