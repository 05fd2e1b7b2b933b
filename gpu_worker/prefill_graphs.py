"""CUDA graphs for single-prompt prefill steps: the time to first token of a lone request.

An eager prefill of a few hundred tokens is host-bound on an H200: launching its ~300 kernels
from Python took 18.3 ms for 12.2 ms of kernel time at 513 tokens (bench/engine_perf.py, parts
`ttft` and `hostprof`). A step whose only sequence prefills the rest of its prompt (no decode
rows, its last token sampled: a whole prompt, the new turn of a chat behind its cached prefix,
the last chunk of a long prompt) in at most `max_tokens` tokens replays instead the graph
captured for the next size of a 16-token ladder, with its rows padded:

    static buffers (graph of 528 rows, a prompt of 513 tokens)
    input_ids       [t0 .. t512 | stale ids  ]   padded rows compute garbage, in their own rows
    positions       [0  .. 512  | stale      ]   only: every op but attention is row-wise
    slot_mapping    [s0 .. s512 | -1 ...     ]   -1: the KV write skips them
    query_start_loc [0, 513]                     attention covers rows 0..512 only: the prefill
    query_lens, context_lens [513]               kernel numbers its tiles on the device from these
    block_tables    [the prompt's blocks | stale]   and its extra programs exit; a cached prefix
                                                 (context_lens > query_lens) is read through the
                                                 block table, sized for max_context_len
    logits_indices  [512]                        the lm_head reads the last real row

The graph runs ModelRunner.run_model and the lm_head: its output is the (1, V) float32 logits,
valid until the next replay. On the CPU the same buffer logic runs eagerly (EagerReplay), so the
padding rules are tested without a GPU.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from gpu_worker.cuda_graphs import CaptureTimes, EagerReplay, Logits, RunModel, capture_graph
from gpu_worker.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

# A prompt pads at most 15 rows. cuBLAS's GEMMs slow in steps, not in proportion to the rows: on
# the H200 a layer's four GEMMs x 32 take 11.13 ms at 513 rows, 11.50 at 528, 12.27 at 544,
# so the 32-token ladder's 544 rows cost a 513-token prompt 0.8 ms.
LADDER_STEP = 16


def prefill_sizes(max_tokens: int) -> list[int]:
    """32, 64, ... up to max_tokens (none past it: positions stay within the model's)."""
    return list(range(LADDER_STEP, max_tokens + 1, LADDER_STEP))


class PrefillGraphs:
    def __init__(self, run_model: RunModel, logits_fn: Logits, *, device: torch.device, max_tokens: int,
                 max_context_len: int, block_size: int, reset_step_state: Callable[[], None] = lambda: None,
                 pdl: bool = True):
        """`reset_step_state` drops what the attention backend caches between the layers of one
        step (its prefill tile numbering), so that each capture records that work itself.
        `pdl`: cuda_graphs.capture_graph's."""
        self.run_model, self.logits_fn, self.reset_step_state = run_model, logits_fn, reset_step_state
        self.pdl = pdl
        self.device = torch.device(device)
        self.sizes = prefill_sizes(max_tokens)
        if not self.sizes:
            raise ValueError(f"prefill graphs need max_tokens >= {LADDER_STEP}, got {max_tokens}")
        n = self.sizes[-1]
        self.max_context_len = max(max_context_len, n)
        self.max_blocks = -(-self.max_context_len // (16 * block_size)) * 16   # a multiple of 16, like the builder's
        i32, i64 = dict(dtype=torch.int32, device=self.device), dict(dtype=torch.int64, device=self.device)
        self.input_ids = torch.zeros(n, **i64)                      # (N,)
        self.positions = torch.zeros(n, **i64)                      # (N,)
        self.slot_mapping = torch.full((n,), -1, **i64)             # (N,)
        self.query_lens = torch.zeros(1, **i32)                     # (1,)
        self.context_lens = torch.zeros(1, **i32)                   # (1,)
        self.query_start_loc = torch.zeros(2, **i32)                # (2,)
        self.block_tables = torch.zeros((1, self.max_blocks), **i32)  # (1, max_blocks)
        self.logits_indices = torch.zeros(1, **i64)                 # (1,)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._pool = None      # CUDA: the memory pool every size's graph shares
        self.capture_times = CaptureTimes("prefill", list(reversed(self.sizes)), self.device)

    def static_batch(self, size: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size], query_lens=self.query_lens,
            context_lens=self.context_lens, query_start_loc=self.query_start_loc,
            block_tables=self.block_tables, slot_mapping=self.slot_mapping[:size],
            logits_indices=self.logits_indices, max_query_len=size, max_context_len=self.max_context_len,
            num_decode_seqs=0, padded_rows=True)

    def _fn(self, batch: ForwardBatch) -> torch.Tensor:
        return self.logits_fn(self.run_model(batch)[batch.logits_indices])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, in one memory pool; the buffers describe a prompt
        filling each size while capturing (slots -1: nothing is written to the KV cache)."""
        for size in self.capture_times:
            self._fill_dummy(size)
            batch = self.static_batch(size)
            if self.device.type != "cuda":
                self.reset_step_state()
                self.graphs[size] = EagerReplay(self._eager_fn, batch)
                self.outputs[size] = self.graphs[size].output
                continue
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            # the step state reset before each call: the capture records the tile numbering
            self.graphs[size], self.outputs[size] = capture_graph(
                self._fn, batch, self._pool, self.device, before_call=self.reset_step_state, pdl=self.pdl)
        self.reset_step_state()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            log.info("captured %s; prompts of up to %d tokens", self.capture_times.summary(), self.sizes[-1])

    def _eager_fn(self, batch: ForwardBatch) -> torch.Tensor:
        """CPU stand-in of a replay: the step state reset as before a capture."""
        self.reset_step_state()
        return self._fn(batch)

    def _fill_dummy(self, size: int) -> None:
        self.input_ids[:size].zero_()
        self.positions[:size].copy_(torch.arange(size, device=self.device))
        self.slot_mapping.fill_(-1)
        self.query_lens.fill_(size)
        self.context_lens.fill_(size)
        self.query_start_loc[1] = size
        self.block_tables.zero_()
        self.logits_indices.fill_(size - 1)

    # ---- replay ------------------------------------------------------------------------------
    def bucket(self, num_tokens: int) -> int | None:
        return next((s for s in self.sizes if s >= num_tokens), None)

    def can_run(self, batch: ForwardBatch) -> bool:
        """One sequence's prompt (or its rest), sampled, that fits a captured size."""
        return (bool(self.graphs) and batch.num_seqs == 1 and batch.num_decode_seqs == 0
                and batch.max_query_len > 1 and batch.max_context_len <= self.max_context_len
                and batch.logits_indices.shape[0] == 1
                and batch.block_tables.shape[1] <= self.max_blocks
                and self.bucket(batch.num_tokens) is not None)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """(1, V) float32 logits of the prompt's last token; valid until the next replay."""
        T, size = batch.num_tokens, self.bucket(batch.num_tokens)
        nb = batch.block_tables.shape[1]
        self.input_ids[:T].copy_(batch.input_ids, non_blocking=True)
        self.positions[:T].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:T].copy_(batch.slot_mapping, non_blocking=True)
        self.slot_mapping[T:size].fill_(-1)
        self.query_lens.copy_(batch.query_lens, non_blocking=True)
        self.context_lens.copy_(batch.context_lens, non_blocking=True)
        self.query_start_loc.copy_(batch.query_start_loc, non_blocking=True)
        self.block_tables[:, :nb].copy_(batch.block_tables, non_blocking=True)
        self.logits_indices.copy_(batch.logits_indices, non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size]
