"""Warm the GPU's L2 with a tensor while a latency-bound kernel runs (sm_90).

At batch 1 a decode layer's attention over a short context moves a few hundred KB in ~8 us, while
HBM could stream ~30 MB in that time; the o_proj GEMV that follows then streams its 32 MB (bf16
Llama-8B) from HBM. Extra programs in the attention kernel's grid (paged_decode_attention's
`l2_prefetch`) issue L2 prefetches for that weight, so the GEMV reads much of it from L2.
Prefetches are hints: no registers, no results, no ordering with other memory operations; a line
evicted before use is just read again, so the output never changes.

`prefetch_span` is the device function a host kernel calls from its prefetch programs; each
program takes one contiguous span of the tensor's bytes. How it prefetches (the constexpr MODE;
`MODE` below, from KVMESH_L2_PREFETCH at import, may be changed at run time before a CUDA graph
is captured):

    0  off
    1  "line"        prefetch.global.L2 per 128-byte line (LINES lines per instruction round)
    2  "evict_last"  prefetch.global.L2::evict_last per line: kept ahead of streaming KV reads
    3  "bulk"        cp.async.bulk.prefetch.L2.global: one instruction per thread for a
                     contiguous 16-byte-aligned piece of the span (sm_90)

Below sm_90 the mode is 0 (the bulk form needs Hopper). Under TRITON_INTERPRET=1 (the CPU tests)
a mode other than off becomes 4, "dry": the prefetch programs exist and split the bytes as on the
GPU but issue nothing (inline PTX cannot be interpreted), which tests the grid arithmetic around them.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gpu_worker.kernels._utils import interpreting

MODES = {"off": 0, "line": 1, "evict_last": 2, "bulk": 3}
DRY = 4                          # the interpreter's stand-in for any mode but off
LINES = 128                      # lines (or bulk pieces) per round: one per thread of 4 warps
SPAN_ALIGN = 128                 # span bytes per program: whole 128-byte lines


def _env_mode() -> int:
    value = os.environ.get("KVMESH_L2_PREFETCH", "off")
    if value not in MODES:
        raise ValueError(f"KVMESH_L2_PREFETCH={value!r}: expected one of {', '.join(MODES)}")
    return MODES[value]


MODE = _env_mode()
_CAPABLE: dict[int, bool] = {}


def mode_for(t: torch.Tensor | None) -> int:
    """The MODE constexpr for prefetching `t` (0 when there is nothing to prefetch, off the GPU,
    or below sm_90; DRY under the interpreter)."""
    if t is None or MODE == 0:
        return 0
    if interpreting():
        return DRY
    if not t.is_cuda:
        return 0
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return MODE if _CAPABLE[index] else 0


def span_bytes(t: torch.Tensor, programs: int) -> int:
    """Bytes per program when `programs` programs share `t`'s bytes (whole lines)."""
    n = t.numel() * t.element_size()
    return triton.cdiv(triton.cdiv(n, programs), SPAN_ALIGN) * SPAN_ALIGN


def byte_view(t: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    """`t` as a flat uint8 tensor (a contiguous tensor's storage), or `fallback` when None."""
    if t is None:
        return fallback
    assert t.is_contiguous(), "l2 prefetch needs a contiguous tensor"
    return t.view(-1).view(torch.uint8)


@triton.jit
def prefetch_span(base_ptr, start, end, MODE: tl.constexpr, LINES: tl.constexpr):
    """Prefetch bytes [start, end) after base_ptr (a uint8 pointer) into L2; start and end are
    multiples of 16 (of 128 for the line modes' spans)."""
    if MODE == 3:
        piece = tl.cdiv(end - start, LINES * 16) * 16                  # bytes per thread, 16-aligned
        off = start.to(tl.int64) + tl.arange(0, LINES).to(tl.int64) * piece
        size = tl.maximum(tl.minimum(end - off, piece), 0).to(tl.int32)    # 0: this thread skips
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [base_ptr + off, size], dtype=tl.int32, is_pure=False, pack=1)
    elif MODE == 1 or MODE == 2:
        for s in range(start, end, LINES * 128):
            off = tl.minimum(s.to(tl.int64) + tl.arange(0, LINES).to(tl.int64) * 128, end - 1)
            if MODE == 1:
                tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                          [base_ptr + off], dtype=tl.int32, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                          [base_ptr + off], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(base_ptr, nbytes, span, MODE: tl.constexpr, LINES: tl.constexpr):
    start = tl.program_id(0) * span
    prefetch_span(base_ptr, start, tl.minimum(start + span, nbytes), MODE, LINES)


def l2_prefetch(t: torch.Tensor, programs: int = 132) -> None:
    """Prefetch all of `t` into L2 with its own kernel (for tests and benchmarks; the engine
    prefetches from inside the attention kernel). No effect on any value; a no-op where
    mode_for(t) is 0."""
    mode = mode_for(t)
    if mode == 0 or t.numel() == 0:
        return
    span = span_bytes(t, programs)
    nbytes = t.numel() * t.element_size()
    _prefetch_kernel[(triton.cdiv(nbytes, span),)](byte_view(t, t), nbytes, span, MODE=mode, LINES=LINES,
                                                    num_warps=4)
