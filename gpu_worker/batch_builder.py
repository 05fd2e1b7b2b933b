"""Turns the scheduler's choice into the model runner's ForwardBatch.

For scheduled sequence i with c = num_computed_tokens and q = num_new_tokens:

    token_ids[c : c+q]  -> input_ids rows  [start_i, start_i + q)   (start_i = query_start_loc[i])
    positions             c, c+1, ..., c+q-1
    slot of position p    block_table[p // block_size] * block_size + p % block_size
    context_len           c + q
    logits row            start_i + q - 1, only when c + q == num_tokens (the sequence samples)
    verifying (d drafts)  rows start_i + q - 1 - d ... start_i + q - 1 (spec_decode/speculator.py)

The host side is numpy: one Python pass over the sequences collects their token slices, lengths
and block tables; positions, slots and offsets are computed vectorized. On CUDA everything goes
through two pinned staging buffers (one int64, one int32) and two host->device copies per step;
the staging ring has two slots so that a step's copy never races the next step's build.

The copies run on a side stream, which the compute stream then waits for: with async scheduling
step N+1 is built while step N still runs, and its uploads overlap step N instead of queueing
behind it (two fewer operations between the two steps' kernels).

    int64 staging:  [ input_ids (T) | positions (T) | slot_mapping (T) | logits_indices (S) ]
    int32 staging:  [ query_lens (B) | context_lens (B) | query_start_loc (B+1) | block_tables (B*M) ]
    (each segment starts on a 64-byte boundary: kernels get aligned pointers)

block_tables is padded with block 0 to M = a multiple of 16 columns (never read: context_lens
bounds every read).

A verification step whose every sequence decodes or verifies (no prefill chunk) can also be
built as decode rows (`build_decode_rows`): sequence s with c computed tokens and q = 1 + d
query tokens becomes q one-token rows of its own, all reading s's block table:

    sequence s:  | ... computed (c) ... | x d0 .. dd-1 |
    row j:       token token_ids[c + j], position c + j, its own slot, context_len c + j + 1

Each layer writes every row's K/V before it attends (the attention backends' contract), so row
j sees rows < j: the same attention as the extend form, through the decode kernels, which lets
the step replay a decode CUDA graph of B x (1 + d) rows. The logits rows are every row, in the
extend form's order.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import torch

from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.scheduler import ScheduledSeq


class _TokensUpTo:
    """The first n tokens of a list, without copying it (what build() reads of a decode row)."""
    __slots__ = ("tokens", "n")

    def __init__(self, tokens: list[int], n: int) -> None:
        self.tokens, self.n = tokens, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return self.tokens[i]


class _DecodeRow(NamedTuple):
    """Query token j of a sequence's chunk as a one-token sequence of its own (build_decode_rows)."""
    token_ids: _TokensUpTo       # the sequence's tokens up to and including this row's
    num_computed_tokens: int     # the row's position
    block_table: list[int]       # the sequence's own


def fits_decode_rows(scheduled: list[ScheduledSeq], num_drafts: list[int]) -> bool:
    """Whether a verification step can run as decode rows: every scheduled sequence decodes (one
    token) or verifies (its last token and its d drafts, d = num_drafts[i]) and samples; a
    prefill chunk anywhere keeps the extend form (build with num_drafts)."""
    return all(q == 1 + d and seq.num_computed_tokens + q == len(seq.token_ids)
               for (seq, q), d in zip(scheduled, num_drafts))


class BatchBuilder:
    def __init__(self, block_size: int, device: torch.device | str, num_staging: int = 2):
        self.block_size = block_size
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._staging: list[dict[torch.dtype, torch.Tensor]] = [{} for _ in range(num_staging)]
        # CUDA: the event after each slot's last copies. Steps that sample nothing never sync
        # with the GPU, so a slot is rewritten only once its earlier copies have run.
        self._copied: list[torch.cuda.Event | None] = [None] * num_staging
        self._turn = 0
        self._copy_stream = torch.cuda.Stream(self.device) if self.pinned else None

    def build(self, scheduled: list[ScheduledSeq], num_drafts: list[int] | None = None, *,
              shared_tables: tuple[list[list[int]], np.ndarray] | None = None) -> ForwardBatch:
        """num_drafts: per scheduled sequence, the draft tokens at the end of its chunk whose
        positions want logits too (speculative verification); None: only each last row.
        shared_tables: (distinct block tables, row -> its table's index) where rows share tables
        (build_decode_rows): each table is flattened once."""
        bs = self.block_size
        B = len(scheduled)
        q_lens = np.empty(B, dtype=np.int64)
        c_lens = np.empty(B, dtype=np.int64)
        samples = np.empty(B, dtype=bool)
        tokens: list[int] = []
        tables: list[list[int]] = []
        for i, (seq, q) in enumerate(scheduled):
            c = seq.num_computed_tokens
            q_lens[i], c_lens[i] = q, c
            if q == 1:
                tokens.append(seq.token_ids[c])
            else:
                tokens.extend(seq.token_ids[c:c + q])
            samples[i] = c + q == len(seq.token_ids)
            tables.append(seq.block_table)
        T = len(tokens)
        ends = np.cumsum(q_lens)                                        # (B,)
        starts = ends - q_lens
        # Table width rounded up to a multiple of 16: its row stride is a Triton kernel argument,
        # and Triton compiles a variant per divisibility class of an int argument.
        max_blocks = -(-max(len(t) for t in tables) // 16) * 16
        if shared_tables is None:
            table_arr = _table_rows(tables, max_blocks)                 # (B, M), padded with 0
        else:
            table_arr = _table_rows(shared_tables[0], max_blocks)[shared_tables[1]]
        if T == B:                                                      # pure decode: one row each
            positions = c_lens
            seq_of_tok = np.arange(B)
        else:
            seq_of_tok = np.repeat(np.arange(B), q_lens)                # (T,)
            positions = np.arange(T) - starts[seq_of_tok] + c_lens[seq_of_tok]
        slots = table_arr[seq_of_tok, positions // bs] * bs + positions % bs   # (T,)
        if num_drafts is None:
            logits_idx = (ends - 1)[samples]                            # (S,)
        else:                                                           # (S,) with 1 + d rows each
            logits_idx = np.array([r for i in np.flatnonzero(samples)
                                   for r in range(ends[i] - 1 - num_drafts[i], ends[i])], dtype=np.int64)
        S = len(logits_idx)
        ctx = c_lens + q_lens

        if self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()
        o64 = _offsets([T, T, T, S], 8)           # segment starts, 64-byte aligned: Triton
        o32 = _offsets([B, B, B + 1, B * max_blocks], 16)   # specializes pointers on alignment
        i64 = self._stage(torch.int64, o64[-1])
        i64[o64[0]:o64[0] + T] = tokens
        i64[o64[1]:o64[1] + T] = positions
        i64[o64[2]:o64[2] + T] = slots
        i64[o64[3]:o64[3] + S] = logits_idx
        i32 = self._stage(torch.int32, o32[-1])
        i32[o32[0]:o32[0] + B] = q_lens
        i32[o32[1]:o32[1] + B] = ctx
        i32[o32[2]] = 0
        i32[o32[2] + 1:o32[2] + B + 1] = ends
        i32[o32[3]:o32[3] + B * max_blocks] = table_arr.reshape(-1)
        d64, d32 = self._upload(torch.int64, o64[-1]), self._upload(torch.int32, o32[-1])
        if self.pinned:
            event = self._copied[self._turn] or torch.cuda.Event()
            event.record(self._copy_stream)
            torch.cuda.current_stream(self.device).wait_event(event)
            self._copied[self._turn] = event
        self._turn = (self._turn + 1) % len(self._staging)
        return ForwardBatch(
            input_ids=d64[o64[0]:o64[0] + T],                       # (T,) int64
            positions=d64[o64[1]:o64[1] + T],                       # (T,) int64
            slot_mapping=d64[o64[2]:o64[2] + T],                    # (T,) int64
            logits_indices=d64[o64[3]:o64[3] + S],                  # (S,) int64
            query_lens=d32[o32[0]:o32[0] + B],                      # (B,) int32
            context_lens=d32[o32[1]:o32[1] + B],                    # (B,) int32
            query_start_loc=d32[o32[2]:o32[2] + B + 1],             # (B+1,) int32
            block_tables=d32[o32[3]:o32[3] + B * max_blocks].view(B, max_blocks),  # (B, M) int32
            max_query_len=int(q_lens.max()),
            max_context_len=int(ctx.max()),
            num_decode_seqs=int((q_lens == 1).sum()),
            fresh_prefill=bool(((q_lens == 1) | (c_lens == 0)).all()),
        )

    def build_decode_rows(self, scheduled: list[ScheduledSeq]) -> ForwardBatch:
        """The step as one decode row per query token (module docstring); only for steps that
        fits_decode_rows accepts. Its logits rows are all rows, as build(scheduled, num_drafts)
        orders them."""
        rows: list[tuple[_DecodeRow, int]] = []
        owner: list[int] = []                     # row -> its sequence (and block table)
        for s, (seq, q) in enumerate(scheduled):
            c, tokens, table = seq.num_computed_tokens, seq.token_ids, seq.block_table
            rows += [(_DecodeRow(_TokensUpTo(tokens, c + j + 1), c + j, table), 1) for j in range(q)]
            owner += [s] * q
        return self.build(rows, shared_tables=([seq.block_table for seq, _ in scheduled], np.asarray(owner)))

    def _stage(self, dtype: torch.dtype, n: int) -> np.ndarray:
        """A host buffer of n elements: a slice of this turn's pinned staging tensor on CUDA, a
        fresh array on the CPU (the batch's tensors then share its memory, so it is not reused)."""
        if not self.pinned:
            arr = np.empty(n, dtype=np.int64 if dtype == torch.int64 else np.int32)
            self._staging[self._turn][dtype] = torch.from_numpy(arr)
            return arr
        slot = self._staging[self._turn]
        buf = slot.get(dtype)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 2 * (0 if buf is None else buf.numel()), 4096), dtype=dtype,
                              pin_memory=True)
            slot[dtype] = buf
        return buf[:n].numpy()

    def _upload(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        host = self._staging[self._turn][dtype][:n]
        if not self.pinned:
            return host if self.device.type == "cpu" else host.to(self.device)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):    # allocated for, and written on, the copy stream
            out = host.to(self.device, non_blocking=True)
        out.record_stream(compute)                    # freed only once the compute stream is done
        return out


def _table_rows(tables: list[list[int]], width: int) -> np.ndarray:
    """(len(tables), width) int64 block tables padded with 0."""
    n = len(tables)
    out = np.zeros((n, width), dtype=np.int64)
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=n)       # (n,) blocks per table
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(lens.sum()))
    rows = np.repeat(np.arange(n), lens)
    out[rows, np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)] = flat
    return out


def _offsets(sizes: list[int], align: int) -> list[int]:
    """Start of each segment, each rounded up to a multiple of `align` elements, then the total."""
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += -(-n // align) * align
    return out + [at]


def build_forward_batch(scheduled: list[ScheduledSeq], block_size: int,
                        device: torch.device | str) -> ForwardBatch:
    """One-off build (tests, tools); the engine keeps a BatchBuilder with its staging buffers."""
    return BatchBuilder(block_size, device, num_staging=1).build(scheduled)
