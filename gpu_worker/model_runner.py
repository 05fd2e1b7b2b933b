"""ModelRunner: owns the model's tensors (weights, KV cache) and runs one forward per step.

The engine hands it a ForwardBatch and gets logits back for `batch.logits_indices` (float32
from a graph that holds the head, else in the model's dtype: the sampler casts what it needs).
`forward` is three separate pieces so that CUDA graph capture (gpu_worker/cuda_graphs.py) can
replay just the middle one on static buffers:

    prepare_inputs(batch) -> ForwardBatch on the device   (host -> device copies)
    run_model(batch)      -> hidden (T, H)                (pure device work: graph-capturable)
    the head on hidden[logits_indices] -> (S, V)          (model.compute_logits_raw / compute_logits)
"""
from __future__ import annotations

import dataclasses
import gc
from typing import NamedTuple

import torch

from gpu_worker.attention.base import AttentionBackend
from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.kernels.paged_decode_attention import SHORT_SPLIT_CONTEXT
from gpu_worker.loader import check_checkpoint, load_weights
from gpu_worker.model_config import ModelConfig
from gpu_worker.models.decoder import CausalLM, KVCache
from gpu_worker.models.layers.fused import load_fused_kernels
from gpu_worker.sampler import PendingSample, SampleRequest, Sampler
from gpu_worker.tuning import KernelTuning
from services.protocol.sampling import MAX_LOGPROBS, SamplingParams

# CPU has no device memory to profile: without num_gpu_blocks the KV cache gets this much.
CPU_KV_BUDGET_BYTES = 2 * 1024**3
# Tokens of the dummy forward that measures peak activation memory in profile_num_blocks.
PROFILE_TOKENS = 4096
# Left free on the device when the KV cache is sized (allocator rounding, NCCL, graph pools).
KV_FREE_MARGIN_BYTES = 256 * 1024**2
# A second set of decode graphs serves batches of at most SHORT_GRAPH_MAX_BS sequences whose
# contexts fit SHORT_CONTEXT tokens: their decode attention kernel splits those contexts finely
# (paged_decode_attention.choose_short_split: up to 16 partitions of 16-key tiles) where the long
# graphs' split is sized for the model's maximum.
SHORT_CONTEXT = SHORT_SPLIT_CONTEXT
SHORT_GRAPH_MAX_BS = 32
# Decode graphs of at most this many rows also capture the lm_head (logits come out of the
# replay: one launch fewer and no host work between model and head); larger graphs stop at the
# hidden states, since their (B, V) float32 outputs would each hold B x 0.5 MB of the pool.
LOGITS_GRAPH_MAX_BS = 32
# fp8 KV caches store K / KV_SCALE and V / KV_SCALE (one scale per tensor). 1.0 is what vLLM
# uses when the checkpoint carries no calibrated k_scale/v_scale: e4m3 covers +-448, far beyond
# the K/V values of normalized models, so nothing saturates; only the mantissa is rounded.
KV_SCALE = 1.0


@dataclasses.dataclass(frozen=True)
class _DeviceMemory:
    total: int = 0
    used: int = 0         # by everything on the device: every process, torch or not
    reserved: int = 0     # by this process's torch caching allocator
    allocated: int = 0    # by this process's live tensors


def _device_memory(device: torch.device) -> _DeviceMemory:
    if device.type != "cuda":
        return _DeviceMemory()
    free, total = torch.cuda.mem_get_info(device)
    return _DeviceMemory(total, total - free, torch.cuda.memory_reserved(device),
                         torch.cuda.memory_allocated(device))


def kv_cache_budget(base: _DeviceMemory, now: _DeviceMemory, peak_allocated: int,
                    gpu_memory_utilization: float) -> int:
    """Bytes for the KV cache: `gpu_memory_utilization` x total, less what this runner used since
    `base` (torch: peak_allocated - base.allocated, weights and the profiling forward's transient
    peak; non-torch growth: CUDA context, cuBLAS workspaces). Memory held before `base` (other
    processes, other engines in this process) is not charged, but the budget may not exceed what
    is free now (less KV_FREE_MARGIN_BYTES): a too large request raises, naming the setting."""
    own_torch = peak_allocated - base.allocated
    non_torch = max(0, (now.used - now.reserved) - (base.used - base.reserved))
    budget = int(now.total * gpu_memory_utilization) - own_torch - non_torch
    free = now.total - now.used - KV_FREE_MARGIN_BYTES
    if budget > free:
        gib = 2 ** 30
        raise RuntimeError(
            f"gpu_memory_utilization={gpu_memory_utilization} asks for a {budget / gib:.1f} GiB KV cache "
            f"but only {max(free, 0) / gib:.1f} GiB of the device is free (other processes or engines hold "
            "the rest); lower gpu_memory_utilization")
    return budget


def _warmup_query_lens(max_query_len: int) -> list[int]:
    """A query length in each prefill launch-configuration bucket a step can reach: 17 and 2
    (the buckets up to 16 and above), then the first length past each larger bound of either
    prefill kernel's table."""
    from gpu_worker.kernels.fresh_prefill_attention import FRESH_CONFIGS
    from gpu_worker.kernels.paged_prefill_attention import PREFILL_CONFIGS
    lens = [17, 2]
    bounds = sorted({bound for bound, _ in PREFILL_CONFIGS[1:-1]} | {bound for bound, _ in FRESH_CONFIGS})
    lens += [b + 1 for b in bounds if b + 1 <= max_query_len]
    return lens


def make_attention_backend(name: str, device: torch.device, cfg: ModelConfig,
                           tuning: KernelTuning = KernelTuning()) -> AttentionBackend:
    """The backend `name` on `device`; an fp8 KV cache is read and written with scales KV_SCALE
    (the scales are ignored by caches in the model's dtype). `tuning`: the triton kernels' choices."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    scales = dict(k_scale=KV_SCALE, v_scale=KV_SCALE)
    if name == "torch":
        from gpu_worker.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(sliding_window=cfg.sliding_window, **scales)
    if name == "triton":
        from gpu_worker.attention.triton_backend import TritonAttentionBackend  # lazy: needs triton
        return TritonAttentionBackend(sliding_window=cfg.sliding_window, tuning=tuning, **scales)
    raise ValueError(f"unknown attention_backend {name!r}; choose auto, torch or triton")


def copy_cache_blocks(kv_caches: list[KVCache], src: list[int], dst: list[int], device: torch.device) -> None:
    """Blocks src[i] -> dst[i] in every (K, V) of `kv_caches` (same-length lists)."""
    s, d = torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)
    if device.type == "cuda":        # pinned + non-blocking: no wait for the stream
        s, d = s.pin_memory(), d.pin_memory()
    s, d = s.to(device, non_blocking=True), d.to(device, non_blocking=True)
    for cache in (c for kv in kv_caches for c in kv):
        if cache.dtype.itemsize == 1:     # fp8: copy the bytes (index_copy_ has no fp8 CPU kernel)
            cache = cache.view(torch.uint8)
        cache.index_copy_(0, d, cache.index_select(0, s))


def pin_decode_splits(attention: AttentionBackend, batch: ForwardBatch, n_kv: int, device: torch.device,
                      tuning: KernelTuning) -> None:
    """Eager steps on the triton backend: round the decode kernel's split count down to a
    power of two. Split count is a compile-time constant of the kernel, so this bounds the
    variants Triton ever compiles to six (warmup compiles them all ahead of time)."""
    if not attention.pins_decode_splits or device.type != "cuda":
        return
    from gpu_worker.kernels.paged_decode_attention import choose_num_splits
    splits = choose_num_splits(batch.num_seqs, n_kv, batch.max_context_len, device, tuning.decode_attention)
    attention.decode_num_splits = 1 << (splits.bit_length() - 1)


class HiddenForward(NamedTuple):
    logits: torch.Tensor      # (S, V), as forward() returns them
    hidden: torch.Tensor      # (T, H) final hidden states of every row


class TargetForward(NamedTuple):
    """forward_with_prenorm's result."""
    logits: torch.Tensor      # (S, V), as forward() returns them
    prenorm: torch.Tensor     # (T, H): every row's residual stream before the final norm; from a
                              # replayed graph a view of prenorm_rows, valid until the next replay
                              # (as the graph's logits are): mtp's settle() reads it before then


class ModelRunner:
    def __init__(self, config: ModelConfig, model_dir: str, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, attention_backend: str = "torch", seed: int = 0,
                 quantization: str | None = None, kv_cache_dtype: torch.dtype | None = None,
                 tuning: KernelTuning = KernelTuning()):
        """`quantization="fp8"`: the decoder layers' linear weights become e4m3 with per-channel
        scales once loaded (gpu_worker/models/layers/fp8.py), "fp8_lm_head" the lm_head too; None
        keeps them in `dtype`.
        `kv_cache_dtype`: the KV cache's storage dtype (None: `dtype`; torch.float8_e4m3fn:
        one byte per element, written as value / KV_SCALE).
        `tuning`: the kernels' choices (EngineConfig.tuning), handed to the backend and the model."""
        self.config = config
        self.tuning = tuning
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:   # cuda -> cuda:N, so that
            self.device = torch.device("cuda", torch.cuda.current_device())  # tensor.device == it
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype
        # What the device held before this runner allocated anything (other engines in this
        # process, other processes): profile_num_blocks budgets only this runner's own usage.
        self._baseline = _device_memory(self.device)
        torch.manual_seed(seed)
        self.attention = make_attention_backend(attention_backend, self.device, config, tuning)
        self.kernels = load_fused_kernels(self.device)     # None on CPU: the model uses torch ops
        # Build on the meta device (no memory, no random init), then allocate for real and load.
        with torch.device("meta"):
            model = self._new_model(config, dtype)
        check_checkpoint(model_dir, set(model.hf_weight_targets()))  # fail before allocating
        # Frozen: a direct call outside the runner's inference_mode builds no autograd graph.
        self.model = model.to_empty(device=self.device).eval().requires_grad_(False)
        self.model.rope.build_cache(self.device)
        self._load_weights(model_dir)
        self.quantization = quantization
        if quantization is not None:
            self._quantize(quantization)
        self.kv_caches: list[KVCache] = []
        self.block_size = 0
        self.decode_graphs = None   # gpu_worker.cuda_graphs.DecodeGraphs once captured
        self.short_decode_graphs = None   # the same for contexts <= SHORT_CONTEXT (CUDA only)
        self.prefill_graphs = None   # gpu_worker.prefill_graphs.PrefillGraphs once captured
        self.piecewise_graphs = None   # gpu_worker.piecewise_graphs.PiecewiseGraphs once captured
        # (max rows, H): the decode graphs' pre-norm states, where capture_prenorm_cuda_graphs made them
        self.prenorm_rows: torch.Tensor | None = None

    # Overridden by the tensor-parallel rank runner (gpu_worker/parallel/tp_runner.py).
    def _new_model(self, config: ModelConfig, dtype: torch.dtype) -> CausalLM:
        return CausalLM(config, self.attention, dtype, self.tuning, self.kernels)

    def _load_weights(self, model_dir: str) -> None:
        load_weights(self.model, model_dir)

    def _quantize(self, quantization: str) -> None:
        from gpu_worker.models.layers.fp8 import QUANTIZATIONS, quantize_lm_head_fp8, quantize_linears_fp8
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)} or None")
        quantize_linears_fp8(self.model, self.tuning.fp8_gemv_max_m)
        if quantization == "fp8_lm_head":
            quantize_lm_head_fp8(self.model, self.tuning.fp8_gemv_max_m)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()          # the bf16 weights' memory goes to the KV cache

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def num_blocks(self) -> int:
        return int(self.kv_caches[0][0].shape[0]) if self.kv_caches else 0

    def block_size_bytes(self, block_size: int) -> int:
        """Bytes of K and V for one block across all layers."""
        cfg = self.config
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.kv_cache_dtype.itemsize
        return block_size * per_token

    # ---- KV cache ----------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Per layer, K and V of shape (num_blocks, block_size, n_kv, head_dim) in kv_cache_dtype, zeroed."""
        cfg = self.config
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = []  # free the old cache first
        self.decode_graphs = self.short_decode_graphs = self.prefill_graphs = None  # graphs use the old cache
        self.prenorm_rows = None
        self.piecewise_graphs = None
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
             torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device))
            for _ in range(cfg.num_layers)
        ]
        self.block_size = block_size

    def close(self) -> None:
        """Free the device memory this runner holds (KV cache, graphs, weights); it cannot run
        again. Another engine made in the same process afterwards gets the memory back."""
        self.kv_caches = []
        self.decode_graphs = self.short_decode_graphs = self.prefill_graphs = self.piecewise_graphs = None
        self.prenorm_rows = None
        self.model = None
        gc.collect()                    # graphs and modules can sit in reference cycles
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer (copy-on-write for forked samples)."""
        if not src:
            return
        if len(src) != len(dst):
            raise ValueError("copy_blocks: src and dst must have the same length")
        copy_cache_blocks(self.kv_caches, src, dst, self.device)

    def profile_num_blocks(self, block_size: int, gpu_memory_utilization: float,
                           max_num_batched_tokens: int = PROFILE_TOKENS, max_num_seqs: int = 0) -> int:
        """How many KV blocks fit. `gpu_memory_utilization` is vLLM's: the fraction of the device's
        total memory THIS runner may use for weights, activations and KV cache, so two workers at
        0.45 share one GPU. CUDA: run a dummy forward of `max_num_batched_tokens` tokens, count
        what this runner allocated since it was made (weights) plus the forward's transient peak
        and the non-torch memory that appeared meanwhile (CUDA context, cuBLAS workspaces), and
        give the KV cache the rest of the budget, no more than is free. With `max_num_seqs`, a
        draw for that many rows runs first (_dummy_sample: the costliest sampling parameters) and
        its logits stay alive through the forward, as a step's do under async scheduling while
        the next step runs: the budget leaves room for the largest step's logits and sampling.
        CPU: there is nothing to profile; returns the blocks of a CPU_KV_BUDGET_BYTES cache
        (callers on CPU should pass num_gpu_blocks instead)."""
        per_block = self.block_size_bytes(block_size)
        if self.device.type != "cuda":
            return max(1, CPU_KV_BUDGET_BYTES // per_block)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            pending = self._dummy_sample(max_num_seqs) if max_num_seqs > 0 else None
            self._dummy_forward(max_num_batched_tokens, block_size)
            if pending is not None:
                pending.results()
            torch.cuda.synchronize(self.device)
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            draw = (f" while a draw of max_num_seqs={max_num_seqs} rows x {self.config.vocab_size} logits was "
                    "alive" if max_num_seqs > 0 else "")
            raise RuntimeError(
                f"the largest step does not fit on the GPU beside the weights: a forward of "
                f"max_num_batched_tokens={max_num_batched_tokens} tokens{draw} ran out of memory; lower "
                f"max_num_batched_tokens{' or max_num_seqs' if max_num_seqs > 0 else ''}") from e
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        budget = kv_cache_budget(self._baseline, _device_memory(self.device), peak, gpu_memory_utilization)
        if budget < per_block:
            raise RuntimeError("no GPU memory left for the KV cache: this worker's weights and activations "
                               "need all the memory that gpu_memory_utilization allows; raise "
                               "gpu_memory_utilization or lower max_num_batched_tokens or max_num_seqs")
        return budget // per_block

    @torch.inference_mode()
    def _dummy_sample(self, num_rows: int) -> PendingSample:
        """The head on `num_rows` rows of zeros, then a draw on every row with the costliest
        parameters a request may carry (penalties, min_p, top_k, top_p, the most logprobs): the
        largest decode step's logits and sampling buffers. Its logits (kept for the logprobs)
        are alive until results()."""
        logits = self._logits(torch.zeros((num_rows, self.config.hidden_size), dtype=self.dtype, device=self.device))
        costly = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                                presence_penalty=0.5, frequency_penalty=0.5, logprobs=MAX_LOGPROBS, seed=0)
        return Sampler().launch(logits, [SampleRequest(i, costly, 0, 0, [0], [0], (), 1) for i in range(num_rows)])

    def _dummy_forward(self, num_tokens: int, block_size: int) -> None:
        num_tokens = max(1, min(num_tokens, self.config.max_position_embeddings))
        n_blocks = -(-num_tokens // block_size)
        saved, saved_bs = self.kv_caches, self.block_size
        i32 = dict(dtype=torch.int32, device=self.device)
        batch = ForwardBatch(
            input_ids=torch.zeros(num_tokens, dtype=torch.long, device=self.device),
            positions=torch.arange(num_tokens, device=self.device),
            query_lens=torch.tensor([num_tokens], **i32), context_lens=torch.tensor([num_tokens], **i32),
            query_start_loc=torch.tensor([0, num_tokens], **i32),
            block_tables=torch.arange(n_blocks, **i32)[None],
            slot_mapping=torch.arange(num_tokens, device=self.device),
            logits_indices=torch.tensor([num_tokens - 1], device=self.device),
            max_query_len=num_tokens, max_context_len=num_tokens, fresh_prefill=True)
        try:
            self.allocate_kv_cache(n_blocks, block_size)
            self.forward(batch)
        finally:                    # (an out-of-memory error must not leave the dummy cache in place)
            self.kv_caches, self.block_size = saved, saved_bs

    # ---- forward -----------------------------------------------------------------------------
    @property
    def _plain_head(self) -> bool:
        """The model's head is CausalLM's (not a tensor-parallel one that gathers across ranks)."""
        return type(self.model).compute_logits is CausalLM.compute_logits

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head outside a graph: in the model's dtype where it is the plain one (the sampler
        casts what it must), float32 from a tensor-parallel head."""
        return self.model.compute_logits_raw(hidden) if self._plain_head else self.model.compute_logits(hidden)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> (S, vocab) logits for the rows `batch.logits_indices`: float32 from a graph that
        holds the head, else in the model's dtype (CausalLM.compute_logits_raw) where the head is
        the plain one; the sampler casts what it needs."""
        if not self.kv_caches:
            raise RuntimeError("allocate_kv_cache must be called before forward")
        batch = self.prepare_inputs(batch)
        try:
            return self._forward(batch)
        finally:
            if batch.layer_loads is not None:        # no step ends with a load half written
                batch.layer_loads.finish()

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        if (self.prefill_graphs is not None and self.prefill_graphs.can_run(batch)
                and not self._lands_layer_by_layer(batch)):
            self._finish_loads(batch)
            return self.prefill_graphs.run(batch)             # (1, V) float32 logits
        graphs = self._decode_graphs_for(batch)
        if graphs is not None:
            return self._replay_decode(graphs, batch)
        if self.piecewise_graphs is not None and self.piecewise_graphs.can_run(batch):
            self._pin_decode_splits(batch)
            hidden = self.piecewise_graphs.run(batch)         # (T, H): graphs around eager attention
        else:
            self._pin_decode_splits(batch)
            hidden = self.run_model(batch)                    # (T, H)
        return self._head(hidden, batch)

    def _head(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """(T, H) final hidden states -> (S, V) logits of the rows batch.logits_indices."""
        if batch.logits_indices.shape[0] == hidden.shape[0]:  # every row samples (decode): the
            return self._logits(hidden)                       # indices are 0..T-1, skip the gather
        return self._logits(hidden[batch.logits_indices])

    def _decode_graphs_for(self, batch: ForwardBatch):
        """The captured decode graphs that replay `batch` (the short-context set first), or None."""
        graphs = self.short_decode_graphs
        if graphs is None or batch.max_context_len > graphs.max_context_len or not graphs.can_run(batch):
            graphs = self.decode_graphs
        return graphs if graphs is not None and graphs.can_run(batch) else None

    def _replay_decode(self, graphs, batch: ForwardBatch) -> torch.Tensor:
        """Replay `graphs` (they can_run the batch) -> (S, V) logits."""
        self._finish_loads(batch)
        out = graphs.run(batch)                               # replayed graph
        if not graphs.returns_logits(graphs.bucket(batch.num_seqs)):
            return self._head(out, batch)                     # out: (B, H)
        if batch.logits_indices.shape[0] == out.shape[0]:
            return out                                        # (B, V) float32 logits
        return out[batch.logits_indices]                      # (S, V)

    def _lands_layer_by_layer(self, batch: ForwardBatch) -> bool:
        """A step with lower-tier loads takes piecewise graphs over a prefill graph where both
        serve it: their eager attentions let each layer wait for its own blocks only, where the
        whole-step graph waits for the whole copy first."""
        return (batch.layer_loads is not None and self.piecewise_graphs is not None
                and self.piecewise_graphs.can_run(batch))

    @staticmethod
    def _finish_loads(batch: ForwardBatch) -> None:
        """Before a whole-step CUDA graph, which has no per-layer hook: every layer of the step's
        lower-tier loads lands first (eager and piecewise steps land them layer by layer)."""
        if batch.layer_loads is not None:
            batch.layer_loads.finish()

    @torch.inference_mode()
    def forward_keeping_hidden(self, batch: ForwardBatch) -> HiddenForward:
        """forward() run eagerly (no graph replays it), keeping every row's final hidden state:
        a step that computes prompt logprobs (gpu_worker/prompt_logprobs.py) projects more rows."""
        if not self.kv_caches:
            raise RuntimeError("allocate_kv_cache must be called before forward")
        batch = self.prepare_inputs(batch)
        self._pin_decode_splits(batch)
        try:                                  # eager: lower-tier loads land layer by layer
            hidden = self.run_model(batch)                    # (T, H)
        finally:
            self._finish_loads(batch)
        return HiddenForward(self._head(hidden, batch), hidden)

    @torch.inference_mode()
    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(r, H) final hidden states -> (r, V) float32: the head the sampling rows take."""
        return self._logits(hidden).float()

    @torch.inference_mode()
    def forward_with_prenorm(self, batch: ForwardBatch) -> TargetForward:
        """forward() that also returns the residual stream before the final norm, which a
        multi-token-prediction module reads (gpu_worker/spec_decode/mtp.py). Decode steps (and
        verification steps as decode rows) replay the decode graphs where they were captured by
        capture_prenorm_cuda_graphs, which copy that stream into `prenorm_rows`; the rest run
        eager (prefill and piecewise graphs keep the stream inside their pools)."""
        if not self.kv_caches:
            raise RuntimeError("allocate_kv_cache must be called before forward")
        batch = self.prepare_inputs(batch)
        graphs = self._decode_graphs_for(batch) if self.prenorm_rows is not None else None
        if graphs is not None:
            logits = self._replay_decode(graphs, batch)
            return TargetForward(logits, self.prenorm_rows[:batch.num_tokens])          # (B, H)
        self._pin_decode_splits(batch)
        try:                                  # eager: lower-tier loads land layer by layer
            hidden, prenorm = self.model.forward_with_prenorm(batch.input_ids, batch.positions, self.kv_caches, batch)
        finally:
            self._finish_loads(batch)         # no step ends with a load half written
        rows = hidden if batch.logits_indices.shape[0] == hidden.shape[0] else hidden[batch.logits_indices]
        return TargetForward(self._logits(rows), prenorm)

    def capture_cuda_graphs(self, max_batch_size: int, max_context_len: int) -> None:
        """Capture decode steps of up to `max_batch_size` rows (after allocate_kv_cache);
        forward then replays them for pure-decode batches. On CPU the same path runs eagerly."""
        self.prenorm_rows = None
        self._capture_decode_graphs(self.run_model, max_batch_size, max_context_len)

    def capture_prenorm_cuda_graphs(self, max_batch_size: int, max_context_len: int) -> None:
        """capture_cuda_graphs whose graphs also write every row's residual stream before the final
        norm into one static buffer, `prenorm_rows` (max_batch_size, H) in the model's dtype, so
        that forward_with_prenorm replays them (mtp: every target forward keeps those states)."""
        self.prenorm_rows = torch.zeros((max_batch_size, self.config.hidden_size), dtype=self.dtype,
                                        device=self.device)
        self._capture_decode_graphs(self._run_model_keeping_prenorm, max_batch_size, max_context_len)

    def _run_model_keeping_prenorm(self, batch: ForwardBatch) -> torch.Tensor:
        """run_model that also copies the pre-norm states into prenorm_rows[:T] (graph-capturable)."""
        hidden, prenorm = self.model.forward_with_prenorm(batch.input_ids, batch.positions, self.kv_caches, batch)
        self.prenorm_rows[:prenorm.shape[0]].copy_(prenorm)
        return hidden                                                      # (T, H)

    def _capture_decode_graphs(self, run_model, max_batch_size: int, max_context_len: int) -> None:
        from gpu_worker.cuda_graphs import DecodeGraphs

        if not self.kv_caches:
            raise RuntimeError("allocate_kv_cache must be called before capture_cuda_graphs")
        if self.device.type == "cuda" and self.attention.name == "torch":
            raise ValueError("CUDA graphs need attention_backend='triton': the torch reference "
                             "backend reads lengths on the host, which graph capture forbids")
        self.decode_graphs = self.short_decode_graphs = None
        if self.attention.pins_decode_splits:
            self.attention.decode_num_splits = None   # graphs pick theirs per captured size

        # The lm_head joins the graphs only for the plain head: a sharded one (tensor parallel)
        # gathers across ranks, which its runner sequences itself.
        logits_max_bs = LOGITS_GRAPH_MAX_BS if self._plain_head else 0

        def capture(context_len: int, sizes: list[int] | None = None):
            # Block-table width: a multiple of 16, like the engine's batch builder pads it to.
            max_blocks = -(-context_len // (16 * self.block_size)) * 16
            graphs = DecodeGraphs(run_model, device=self.device, max_batch_size=max_batch_size,
                                  max_blocks_per_seq=max_blocks, max_context_len=context_len, sizes=sizes,
                                  logits_fn=self.model.compute_logits, logits_max_bs=logits_max_bs,
                                  pdl=self.tuning.pdl)
            graphs.capture()
            return graphs

        self.decode_graphs = capture(max_context_len)
        if self.device.type == "cuda" and max_context_len > 2 * SHORT_CONTEXT:
            # Small batches of short contexts: the long graphs' decode kernel is split for
            # max_context_len (up to 32 partitions of 128-key tiles); these size it for at most
            # SHORT_CONTEXT tokens (choose_short_split).
            sizes = [n for n in self.decode_graphs.sizes if n <= SHORT_GRAPH_MAX_BS]
            self.short_decode_graphs = capture(SHORT_CONTEXT, sizes)

    def capture_prefill_graphs(self, max_tokens: int, max_context_len: int) -> None:
        """Capture single-prompt prefill steps of up to `max_tokens` new tokens behind up to
        `max_context_len` - those cached (after allocate_kv_cache; gpu_worker/prefill_graphs.py);
        forward then replays them for a step that prefills (the rest of) one prompt. Not for a
        sharded lm_head (tensor parallel). On CPU the same path runs eagerly."""
        from gpu_worker.prefill_graphs import LADDER_STEP, PrefillGraphs

        if not self.kv_caches:
            raise RuntimeError("allocate_kv_cache must be called before capture_prefill_graphs")
        if self.device.type == "cuda" and self.attention.name == "torch":
            raise ValueError("CUDA graphs need attention_backend='triton': the torch reference "
                             "backend reads lengths on the host, which graph capture forbids")
        self.prefill_graphs = None
        if not self._plain_head or max_tokens < LADDER_STEP:
            return

        graphs = PrefillGraphs(self.run_model, self.model.compute_logits, device=self.device,
                               max_tokens=max_tokens, max_context_len=max_context_len, block_size=self.block_size,
                               reset_step_state=self.attention.forget_step_state, pdl=self.tuning.pdl)
        graphs.capture()
        self.prefill_graphs = graphs

    def capture_piecewise_graphs(self, max_tokens: int) -> None:
        """Capture every layer's work but attention, for steps of up to `max_tokens` tokens that no
        whole-step graph serves (mixed prefill + decode, several prompts; after allocate_kv_cache;
        gpu_worker/piecewise_graphs.py). Not for a sharded model (tensor parallel: the ranks
        follow rank 0's eager steps) nor MoE layers. On CPU the same pieces run eagerly."""
        from gpu_worker.piecewise_graphs import LADDER_STEP, PiecewiseGraphs

        if not self.kv_caches:
            raise RuntimeError("allocate_kv_cache must be called before capture_piecewise_graphs")
        if self.device.type == "cuda" and self.attention.name == "torch":
            raise ValueError("CUDA graphs need attention_backend='triton'")
        self.piecewise_graphs = None
        if (type(self.model) is not CausalLM or self.config.moe_layers or max_tokens < LADDER_STEP):
            return
        graphs = PiecewiseGraphs(self.model, self.kv_caches, device=self.device, max_tokens=max_tokens,
                                 pdl=self.tuning.pdl)
        graphs.capture()
        self.piecewise_graphs = graphs

    def _pin_decode_splits(self, batch: ForwardBatch) -> None:
        pin_decode_splits(self.attention, batch, self.kv_caches[0][0].shape[2], self.device, self.tuning)

    @torch.inference_mode()
    def warmup(self, max_num_seqs: int, max_query_len: int = 0) -> None:
        """Compile, before serving, every Triton kernel variant an eager step can need (CUDA +
        triton only): both prefill kernels (fresh prompts' and chunks behind a prefix's) per
        sequence-count class (v2's BLOCK_B is next_pow2(B), and Triton specializes B on == 1 and
        % 16) and per launch configuration (one per PREFILL_CONFIGS / FRESH_CONFIGS bucket that a
        query of up to `max_query_len` tokens reaches: the first two always), and the decode
        kernel per split count, in mixed and pure-decode steps (the latter with RoPE fused in when
        split). No KV writes (slots -1)."""
        if self.device.type != "cuda" or not self.attention.pins_decode_splits:
            return
        counts = sorted({n for n in (1, 2, 3, 5, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512)
                         if n <= max_num_seqs} | {max_num_seqs})
        for splits in (1, 2, 4, 8, 16, 32):          # decode rows next to a prefill row, and alone
            self.attention.decode_num_splits = splits    # (split: RoPE + KV write fused in)
            self.run_model(self._warmup_batch([17, 1]))
            self.run_model(self._warmup_batch([1]))
        self.attention.decode_num_splits = 1
        for n in counts:
            for first in _warmup_query_lens(max_query_len):
                for fresh in (True, False):      # fresh prompts' kernel, and chunks behind a prefix's
                    self.run_model(self._warmup_batch([first] + [1] * (n - 1), fresh))
        for first in _warmup_query_lens(max_query_len):   # chunks behind a prefix twice their length
            if 2 * first <= self.config.max_position_embeddings:                     # (fresh_config)
                self.run_model(self._warmup_batch([first], False, cached_prefix=first))
        self.attention.decode_num_splits = None
        torch.cuda.synchronize(self.device)

    def _warmup_batch(self, query_lens: list[int], fresh_prefill: bool = True,
                      cached_prefix: int = 0) -> ForwardBatch:
        """Sequences with these query lengths; writes nothing to the cache. fresh_prefill False:
        flagged as unknown, so the prefill rows take the kernel variant of chunks behind a cached
        prefix; cached_prefix: the first sequence has that many tokens cached before its rows (block
        0's contents, whatever they are: the outputs are thrown away)."""
        dev = self.device
        T, B = sum(query_lens), len(query_lens)
        contexts = [query_lens[0] + cached_prefix] + query_lens[1:]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        positions = [c - q + p for q, c in zip(query_lens, contexts) for p in range(q)]
        i32 = dict(dtype=torch.int32, device=dev)
        width = max(16, -(-max(contexts) // max(self.block_size, 1)))     # every row's blocks: all block 0
        return ForwardBatch(
            input_ids=torch.zeros(T, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            query_lens=torch.tensor(query_lens, **i32), context_lens=torch.tensor(contexts, **i32),
            query_start_loc=torch.tensor(starts, **i32), block_tables=torch.zeros((B, width), **i32),
            slot_mapping=torch.full((T,), -1, dtype=torch.long, device=dev),
            logits_indices=torch.tensor([T - 1], device=dev),
            max_query_len=max(query_lens), max_context_len=max(contexts), fresh_prefill=fresh_prefill)

    def prepare_inputs(self, batch: ForwardBatch) -> ForwardBatch:
        """Move every tensor of the batch to the model's device (non-blocking from pinned memory)."""
        if batch.input_ids.device == self.device and batch.block_tables.device == self.device:
            return batch                                      # the engine's builder already did
        moved = {}
        for f in dataclasses.fields(batch):
            value = getattr(batch, f.name)
            if isinstance(value, torch.Tensor) and value.device != self.device:
                value = value.to(self.device, non_blocking=True)
            moved[f.name] = value
        return ForwardBatch(**moved)

    def run_model(self, batch: ForwardBatch) -> torch.Tensor:
        """The graph-capturable part: (T,) ids -> (T, H) final hidden states."""
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch)
