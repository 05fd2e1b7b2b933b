"""Weight-only FP8 GEMV for decode-sized batches (M <= MAX_M rows): y = x @ (W8 * s).T.

    x (M, K) bf16/fp16/fp32     W8 (N, K) e4m3     s (N,) fp32     y (M, N) in x's dtype
    y[m, n] = s[n] * sum_k x[m, k] * float(W8[n, k])  (+ bias[n])     (fp32 accumulation)

With scale None the same kernel is a plain GEMV of a bf16/fp16/fp32 weight.

Fusions for a decode layer at batch 1-4 (where every extra kernel is ~2-5 us against ~10-55 us of
weight streaming), each rounding where Hugging Face's unfused layer rounds to x's dtype:

    norm_weight=g   x <- g * rms_normalize(x)        (RMSNorm prologue; each program computes the
                                                       row's 1/rms over all of K, x is a few KB)
    swiglu=True     x (M, 2K) = [gate | up] <- silu(gate) * up   (SwiGLU prologue)
    residual=r      y <- y + r                        (residual-add epilogue, r (M, N))

and two that replace the kernel after the GEMV instead of the one before, with no work repeated
(the prologues above redo their norm / SwiGLU in every program that reads x):

    swiglu_out=True  returns silu(y[:, :N/2]) * y[:, N/2:]   (gate_up; the later of each (gate, up)
                                                              tile pair to finish computes it)
    norm_out=(g, e)  returns (RMSNorm(y), y)                  (o_proj, down; the grid's last
                                                              finishing tile normalizes whole rows)

At batch 1 a linear layer is one pass over its weights, so the kernel is built to stream them at
the copy rate: every program reads a (BLOCK_N, BLOCK_K) weight tile per step with 16-byte loads
and walks its share of K; x (a few KB) stays in L1/L2. The M rows are handled one of two ways
(config `dot`):

    dot=True   tensor cores, "swap AB": acc (BLOCK_N, 16) += W_tile (BLOCK_N, BLOCK_K) @ x_tile.T,
               x padded to 16 rows (zeros); W upcast to x's dtype (e4m3 -> bf16/fp16 is exact),
               products exact, fp32 accumulation. Cost independent of M.
    dot=False  CUDA cores: one (BLOCK_N, BLOCK_K) product reduced over K per row (a static loop
               over the M rows, no 3-D broadcast); W upcast to fp32.

Upcasting e4m3 is the hidden cost: on sm_90 conversion instructions run at 16/clk/SM while
the copy rate needs ~18 weights/clk/SM. Triton's e4m3 -> bf16 (for the dots) is one cvt per two
weights to f16x2 plus one per weight to bf16: conversion-bound. e4m3 -> fp32 (FMA path) is the
f16x2 cvt plus HADD2.F32 (full rate): fine. Config `upcast` (fp8 weights only):
    0  w.to(dtype) (Triton's conversions)
    1  integer bit ops, exact: the byte's exponent+mantissa bits are moved into the target
       format's fields (value * 2^-120 for bf16/fp32, * 2^-8 for fp16; e4m3 subnormals land on
       subnormals with the same factor), then one multiply by the power of two
    2  as 1 in inline PTX, two bytes at a time (prmt/shl/and + one packed multiply: ~2
       instructions per weight, no conversion unit); dots with bf16/fp16 x only (elsewhere,
       and under TRITON_INTERPRET=1, it runs as 1)
e4m3fn's NaN code (never produced by quantize_weight_fp8, which saturates at +-448) reads as
+-480 with 1 and 2.

K is split over `split_k` programs (grid (cdiv(N, BLOCK_N), split_k)) so that small-N layers still
fill the 132 SMs. Partial sums (split_k, M, N) fp32 are reduced deterministically (fixed order,
no float atomics), config `reduce`:
    "last"      one launch: each program stores its partial, then bumps a per-N-tile counter
                (acq_rel atomic); the program that arrives last sums the partials in split
                order, applies scale/bias/cast and resets the counter to 0. The counters are a
                zeroed per-device buffer allocated on first use; calls must not run concurrently
                on two streams of one device.
    "two_pass"  partials, then a small reduce+epilogue kernel (one more launch, ~2 us).
split_k 1 is a single pass with the epilogue fused.

Configs: gemv_config(M, N, K, weight dtype) -> TUNED (exact shapes, swept on
the H200) or DEFAULTS per (weight kind, M bucket) with split_k picked to fill the SMs.
No host syncs; CUDA-graph capturable (allocations are torch.empty; the counter buffer is
allocated outside capture, else "last" falls back to "two_pass"). Launched with programmatic
dependent launch where on (kernels/_pdl.py): the programs start while the previous kernel
finishes and wait for it before reading x (optionally prefetching weight tiles first).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gpu_worker.kernels._arrivals import arrival_counters
from gpu_worker.kernels._pdl import pdl_kwargs, pdl_launch, pdl_wait, prefetch_l2
from gpu_worker.kernels._utils import check_device, interpreting, next_pow2
from gpu_worker.kernels.rmsnorm import NormOutput, rms_normalize, rmsnorm, rmsnorm_ref
from gpu_worker.kernels.swiglu import silu_mul, swiglu as swiglu_kernel, swiglu_ref

MAX_M = 8                   # rows per call; the dot path pads to DOT_ROWS
MAX_NORM_OUT = 16384        # widest row the RMSNorm epilogue holds in one program's registers
DOT_ROWS = 16
F8 = torch.float8_e4m3fn


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int = 1            # programs along K (0: pick to fill the SMs, see auto_split_k)
    reduce: str = "last"        # split_k > 1: "last" (one launch) or "two_pass"
    dot: bool = True            # tensor cores (M padded to 16) or one FMA reduction per row
    upcast: int = 2             # fp8 weights: 0 .to(), 1 bit ops, 2 bit ops in PTX (module doc)
    num_warps: int = 4
    num_stages: int = 3


# TUNED: (weight kind "fp8" | "16bit", M bucket, N, K) -> config for the Llama-8B shapes;
# DEFAULTS: (kind, M bucket 1/2/4/8) -> config for any other shape, split_k 0 = auto
# (resolve_split). Both swept on the H200 against cuBLAS (2026-11-29) and pasted as the sweep
# printed them (per layer at M=1: fp8 GEMV 68.9 us vs bf16 cuBLAS 115.5 us, fp8 _scaled_mm 131.8),
# except the M=1 entries marked "in-graph sweep": the winners of a sweep inside the batch-1
# decode CUDA graph with PDL (-110 us per bf16 step, -28 us fp8, against the isolated sweep's),
# where each kernel's start and end overlap its neighbours' and more split-K programs pay.
TUNED: dict[tuple[str, int, int, int], GemvConfig] = {
    ("fp8", 1, 6144, 4096): GemvConfig(16, 512, 3, "last", False, 0, 4, 1),  # qkv (in-graph sweep)
    ("16bit", 1, 6144, 4096): GemvConfig(64, 128, 2, "last", True, 0, 4, 4),  # qkv (in-graph sweep)
    ("fp8", 2, 6144, 4096): GemvConfig(64, 128, 4, "last", True, 2, 4, 4),  # qkv 12.04 us 2.09 TB/s
    ("16bit", 2, 6144, 4096): GemvConfig(32, 256, 1, "last", True, 0, 4, 3),  # qkv 16.01 us 3.14 TB/s
    ("fp8", 4, 6144, 4096): GemvConfig(64, 128, 4, "last", True, 2, 4, 4),  # qkv 12.04 us 2.09 TB/s
    ("16bit", 4, 6144, 4096): GemvConfig(32, 256, 1, "last", True, 0, 4, 3),  # qkv 16.16 us 3.11 TB/s
    ("fp8", 1, 4096, 4096): GemvConfig(16, 512, 4, "last", False, 0, 4, 1),  # o_proj (in-graph sweep)
    ("16bit", 1, 4096, 4096): GemvConfig(64, 128, 4, "last", True, 0, 4, 4),  # o_proj (in-graph sweep)
    ("fp8", 2, 4096, 4096): GemvConfig(64, 128, 4, "last", True, 2, 4, 4),  # o_proj 9.30 us 1.80 TB/s
    ("16bit", 2, 4096, 4096): GemvConfig(32, 256, 2, "last", True, 0, 4, 3),  # o_proj 11.60 us 2.89 TB/s
    ("fp8", 4, 4096, 4096): GemvConfig(64, 128, 4, "last", True, 2, 4, 4),  # o_proj 9.40 us 1.78 TB/s
    ("16bit", 4, 4096, 4096): GemvConfig(32, 256, 2, "last", True, 0, 4, 3),  # o_proj 11.63 us 2.89 TB/s
    ("fp8", 1, 28672, 4096): GemvConfig(16, 1024, 1, "last", False, 0, 4, 1),  # gate_up 31.60 us 3.72 TB/s
    ("16bit", 1, 28672, 4096): GemvConfig(16, 512, 1, "last", False, 0, 4, 1),  # gate_up 54.96 us 4.27 TB/s
    ("fp8", 2, 28672, 4096): GemvConfig(16, 512, 1, "last", False, 0, 4, 1),  # gate_up 37.84 us 3.10 TB/s
    ("16bit", 2, 28672, 4096): GemvConfig(64, 128, 1, "last", True, 0, 4, 4),  # gate_up 55.90 us 4.20 TB/s
    ("fp8", 4, 28672, 4096): GemvConfig(64, 128, 2, "last", True, 2, 4, 4),  # gate_up 39.69 us 2.96 TB/s
    ("16bit", 4, 28672, 4096): GemvConfig(64, 128, 1, "last", True, 0, 4, 4),  # gate_up 55.78 us 4.21 TB/s
    ("fp8", 1, 4096, 14336): GemvConfig(16, 512, 4, "last", False, 0, 4, 1),  # down (in-graph sweep)
    ("16bit", 1, 4096, 14336): GemvConfig(64, 128, 4, "last", True, 0, 4, 4),  # down (in-graph sweep)
    ("fp8", 2, 4096, 14336): GemvConfig(16, 512, 3, "last", False, 0, 4, 1),  # down 23.22 us 2.53 TB/s
    ("16bit", 2, 4096, 14336): GemvConfig(32, 256, 2, "last", True, 0, 4, 3),  # down 31.36 us 3.75 TB/s
    ("fp8", 4, 4096, 14336): GemvConfig(64, 256, 7, "last", True, 2, 4, 3),  # down 25.86 us 2.27 TB/s
    ("16bit", 4, 4096, 14336): GemvConfig(32, 256, 2, "last", True, 0, 4, 3),  # down 31.45 us 3.73 TB/s
    # the 16-bit lm_head (CausalLM.head_gemv; fp8 models keep it bf16): in-graph sweep
    ("16bit", 1, 128256, 4096): GemvConfig(16, 512, 1, "last", False, 0, 4, 1),  # lm_head (in-graph sweep)
}
DEFAULTS: dict[tuple[str, int], GemvConfig] = {
    ("fp8", 1): GemvConfig(16, 512, 0, "last", False, 0, 4, 1),  # fma16x512, geo-mean 1.08x of best (M=1)
    ("fp8", 2): GemvConfig(16, 512, 0, "last", False, 0, 4, 1),  # fma16x512, geo-mean 1.05x of best (M=2)
    ("fp8", 4): GemvConfig(64, 128, 0, "last", True, 2, 4, 4),  # dot64x128, geo-mean 1.03x of best (M=4)
    ("fp8", 8): GemvConfig(64, 128, 0, "last", True, 2, 4, 4),  # dot64x128, geo-mean 1.03x of best (M=4)
    ("16bit", 1): GemvConfig(32, 256, 0, "last", True, 0, 4, 3),  # dot32x256, geo-mean 1.03x of best (M=1)
    ("16bit", 2): GemvConfig(32, 256, 0, "last", True, 0, 4, 3),  # dot32x256, geo-mean 1.02x of best (M=2)
    ("16bit", 4): GemvConfig(32, 256, 0, "last", True, 0, 4, 3),  # dot32x256, geo-mean 1.03x of best (M=4)
    ("16bit", 8): GemvConfig(32, 256, 0, "last", True, 0, 4, 3),  # dot32x256, geo-mean 1.03x of best (M=4)
}


# With PDL on (kernels/_pdl.py), weight tiles per program prefetched into L2 while the previous
# kernel finishes. On the H200 (batch-1 decode graph, unfused GEMV layers): 0 / 1
# / 2 tiles gave bf16 4.546 / 4.533 / 4.651 ms, fp8 3.013 / 3.061 / 3.205 ms: none by default.
PDL_PREFETCH_TILES = 0
# With PDL on: the kernel after a GEMV may launch once every GEMV program has finished its K loop
# (True), or once every program has passed its wait at the start (False, _pdl.py's rule).
PDL_LAUNCH_LATE = False

SM_COUNT = 132              # H100/H200
PROGRAMS_PER_SM = {True: 2, False: 8}   # auto split-K target per SM: dot programs (~160 registers
                                        # per thread, ~70 KB smem: 2-3 fit an SM) / FMA programs


def m_bucket(M: int) -> int:
    return 1 if M <= 1 else next_pow2(M)


def weight_kind(dtype: torch.dtype) -> str:
    return "fp8" if dtype == F8 else "16bit"


def auto_split_k(N: int, K: int, block_n: int, block_k: int, programs: int) -> int:
    """Programs along K so that cdiv(N, block_n) * split >= programs, at least one K tile each;
    rounded up to a divisor of the K tile count when one is near (equal shares, no tail)."""
    nk, tiles = triton.cdiv(K, block_k), triton.cdiv(N, block_n)
    want = max(1, min(nk, triton.cdiv(programs, tiles)))
    for split in range(want, min(nk, 2 * want) + 1):
        if nk % split == 0:
            return split
    return want


def resolve_split(cfg: GemvConfig, N: int, K: int) -> GemvConfig:
    """split_k 0 (auto) -> PROGRAMS_PER_SM[cfg.dot] programs per SM."""
    if cfg.split_k > 0:
        return cfg
    return cfg._replace(split_k=auto_split_k(N, K, cfg.block_n, cfg.block_k, SM_COUNT * PROGRAMS_PER_SM[cfg.dot]))


# FUSED_TUNED: (kind, M bucket, N, K, fusion) -> config of a fused GEMV ("norm", "res",
# "swiglu+res": what the decoder's fused-GEMV layers use), swept on the H200 (2026-11-29) and
# pasted as printed; a fused call not listed takes its plain
# shape's config. Per layer at M=1: bf16 fused 122.8 us vs 119.6 unfused (GEMV + norm/SwiGLU
# kernels), fp8 74.8 vs 74.8.
FUSED_TUNED: dict[tuple[str, int, int, int, str], GemvConfig] = {
    ("16bit", 1, 6144, 4096, "norm"): GemvConfig(16, 256, 4, "last", False, 0, 4, 1),  # 19.83 us
    ("16bit", 1, 4096, 4096, "res"): GemvConfig(32, 256, 2, "last", True, 0, 4, 3),  # 11.72 us
    ("16bit", 1, 28672, 4096, "norm"): GemvConfig(16, 512, 1, "last", False, 0, 4, 1),  # 58.06 us
    ("16bit", 1, 4096, 14336, "swiglu+res"): GemvConfig(16, 512, 7, "last", False, 0, 4, 1),  # 33.23 us
    ("fp8", 1, 6144, 4096, "norm"): GemvConfig(16, 512, 2, "last", False, 0, 4, 1),  # 11.63 us
    ("fp8", 1, 4096, 4096, "res"): GemvConfig(16, 1024, 2, "last", False, 0, 4, 1),  # 8.14 us
    ("fp8", 1, 28672, 4096, "norm"): GemvConfig(16, 512, 1, "last", False, 0, 4, 1),  # 35.49 us
    ("fp8", 1, 4096, 14336, "swiglu+res"): GemvConfig(16, 512, 3, "last", False, 0, 4, 1),  # 19.54 us
}


def gemv_config(M: int, N: int, K: int, weight_dtype: torch.dtype, fusion: str = "") -> GemvConfig:
    """The config of an (M, K) x (N, K).T GEMV: FUSED_TUNED (fused calls), TUNED for the exact
    shape, else DEFAULTS."""
    kind, mb = weight_kind(weight_dtype), min(m_bucket(M), 8)
    cfg = (fusion and FUSED_TUNED.get((kind, mb, N, K, fusion))) or TUNED.get((kind, mb, N, K))
    return resolve_split(cfg or DEFAULTS[(kind, mb)], N, K)


# --------------------------------------------------------------------------------------- kernels

@triton.jit
def _upcast(w, DT: tl.constexpr, UPCAST: tl.constexpr):
    """A loaded weight tile in dtype DT. UPCAST 0: .to(DT); 1, 2: e4m3 bits -> DT bits (exact)."""
    if UPCAST == 0:
        y = w.to(DT)
    elif UPCAST == 1:
        if DT == tl.float32:
            # sign-extended byte s...s|eeeemmm << 20 -> s at bit 31 (bits 30..27 cleared),
            # eeee at 26..23 (exponent field 0000eeee), mmm at 22..20: value * 2^-120
            b = w.to(tl.int8, bitcast=True).to(tl.int32)
            y = ((b << 20) & -0x78100000).to(tl.float32, bitcast=True) * 1.329227995784916e+36
        else:
            # int16 maths (0x80 << 8 wraps to the sign bit); zero-extended byte
            b = w.to(tl.uint8, bitcast=True).to(tl.int16)
            if DT == tl.bfloat16:
                h = ((b & 0x80) << 8) | ((b & 0x7F) << 4)                      # value * 2^-120
                y = h.to(tl.bfloat16, bitcast=True) * tl.full([1], 1.329227995784916e+36, tl.bfloat16)
            else:
                h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)                      # value * 2^-8
                y = h.to(tl.float16, bitcast=True) * tl.full([1], 256.0, tl.float16)
    else:
        # two bytes per asm call (the layout of a dot operand keeps pairs of K in a register): prmt
        # sign-extends each byte into a 16-bit lane (s*9|eeeemmm), one shift puts eeeemmm under
        # the target's exponent/mantissa fields and s at bit 15, a mask clears the rest; one
        # packed multiply by 2^120 (bf16) / 2^8 (fp16) restores the value exactly
        if DT == tl.bfloat16:
            y = tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 r, a, k;
                cvt.u32.u16 r, $1;
                prmt.b32 a, r, 0, 0x9180;
                shl.b32 a, a, 4;
                and.b32 a, a, 0x87f087f0;
                mov.b32 k, 0x7b807b80;
                mul.rn.bf16x2 $0, a, k;
                }""",
                constraints="=r,h", args=[w.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16,
                is_pure=True, pack=2)
        else:
            y = tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 r, a, k;
                cvt.u32.u16 r, $1;
                prmt.b32 a, r, 0, 0x9180;
                shl.b32 a, a, 7;
                and.b32 a, a, 0xbf80bf80;
                mov.b32 k, 0x5c005c00;
                mul.rn.f16x2 $0, a, k;
                }""",
                constraints="=r,h", args=[w.to(tl.uint8, bitcast=True)], dtype=tl.float16,
                is_pure=True, pack=2)
    return y


PRO_NONE, PRO_NORM, PRO_SWIGLU = 0, 1, 2     # the prologue applied to x as it is loaded
EPI_NONE, EPI_SWIGLU, EPI_NORM = 0, 1, 2     # the epilogue run once an output tile is finished


@triton.jit
def _load_x(ptrs, mask, gam, rstd, K, PRO: tl.constexpr, MASKED: tl.constexpr):
    """A tile of x (any shape), the prologue applied, in x's dtype. PRO_NORM: gam and rstd
    broadcast against the tile; PRO_SWIGLU: ptrs point at gate, up sits K columns later."""
    XT = ptrs.dtype.element_ty
    if MASKED:
        x = tl.load(ptrs, mask=mask, other=0.0)
    else:
        x = tl.load(ptrs)
    if PRO == 1:      # HF RMSNorm: normalize in fp32, cast, then times the weight (cast again)
        xn = (x.to(tl.float32) * rstd).to(XT).to(tl.float32)
        x = (xn * gam.to(tl.float32)).to(XT)
    elif PRO == 2:    # HF SwiGLU: silu(gate) in x's dtype, times up
        if MASKED:
            u = tl.load(ptrs + K, mask=mask, other=0.0)
        else:
            u = tl.load(ptrs + K)
        g = x.to(tl.float32)
        act = (g * tl.sigmoid(g)).to(XT).to(tl.float32)
        x = (act * u.to(tl.float32)).to(XT)
    return x


@triton.jit
def _pick(v, rows, i):
    """Element i of the (R,) vector v, as a scalar."""
    return tl.sum(tl.where(rows == i, v, 0.0), axis=0)


@triton.jit
def _row_dot(wf, x_row_ptr, rk, k_ok, g_ptr, rstd, K, EVEN_K: tl.constexpr, PRO: tl.constexpr):
    """sum_k wf[n, k] * x[k] for one row of x (prologue applied): (BLOCK_N,) fp32."""
    gam = rk
    if PRO == 1:
        gam = tl.load(g_ptr + rk, mask=k_ok, other=0.0)
    xv = _load_x(x_row_ptr + rk, k_ok, gam, rstd, K, PRO, not EVEN_K)
    return tl.sum(wf * xv.to(tl.float32)[None, :], axis=1)


@triton.jit
def _finish_row(v, m, rn, n_ok, s_ptr, b_ptr, r_ptr, y_ptr, N, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                HAS_RES: tl.constexpr):
    """v (BLOCK_N,) fp32 sums of row m over all of K -> y[m, rn]."""
    if HAS_SCALE:
        v = v * tl.load(s_ptr + rn, mask=n_ok, other=0.0)
    if HAS_BIAS:
        v = v + tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    if HAS_RES:       # HF: the layer's output in y's dtype, plus the residual
        r = tl.load(r_ptr + m * N + rn, mask=n_ok, other=0.0).to(tl.float32)
        v = v.to(y_ptr.dtype.element_ty).to(tl.float32) + r
    tl.store(y_ptr + m * N + rn, v.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _finish(v, rows, rn, m_ok, n_ok, s_ptr, b_ptr, r_ptr, y_ptr, N, HAS_SCALE: tl.constexpr,
            HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
    """v (BLOCK_N, R) fp32 sums over all of K -> y[rows, rn] = (scale * v + bias) in y's dtype
    (+ residual, added to the rounded value)."""
    if HAS_SCALE:
        v = v * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[:, None]
    if HAS_BIAS:
        v = v + tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    mask = n_ok[:, None] & m_ok[None, :]
    offs = rows[None, :] * N + rn[:, None]
    if HAS_RES:
        r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = v.to(y_ptr.dtype.element_ty).to(tl.float32) + r
    tl.store(y_ptr + offs, v.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _epilogue(y_ptr, a_ptr, ew_ptr, ecnt_ptr, ep_eps, M, N, HALF, pid_n, n_tiles,
              EPI: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
    """Run by the program that has just stored output tile pid_n of y. EPI_SWIGLU (y = [gate | up],
    HALF = N / 2 columns each, HALF % BLOCK_N == 0): the second of the tile pair (gate tile, up
    tile) to arrive writes a[:, tile] = silu(gate) * up (fp32, one rounding: kernels/swiglu.py).
    EPI_NORM: the last of the grid's n_tiles finishers writes a = RMSNorm(y) of whole rows (weight
    ew, epsilon ep_eps; kernels/rmsnorm.py's roundings). ecnt_ptr: this epilogue's arrival
    counters (zero, and left zero); y's other tiles are read from L2 (.cg): they were stored by
    other programs, released by their atomic and acquired by this one's."""
    tl.debug_barrier()                                          # every thread's store of the tile ...
    if EPI == 1:
        pair = pid_n % (HALF // BLOCK_N)
        seen = tl.atomic_add(ecnt_ptr + pair, 1, sem="acq_rel", scope="gpu")      # ... then released
        if seen == 1:
            rows = tl.arange(0, R)
            cols = pair * BLOCK_N + tl.arange(0, BLOCK_N)
            offs = rows[:, None] * N + cols[None, :]
            mask = (rows < M)[:, None] & (cols < HALF)[None, :]
            g = tl.load(y_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            u = tl.load(y_ptr + offs + HALF, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            act = silu_mul(g, u)
            tl.store(a_ptr + rows[:, None] * HALF + cols[None, :], act.to(a_ptr.dtype.element_ty), mask=mask)
            tl.store(ecnt_ptr + pair, 0)
    else:
        seen = tl.atomic_add(ecnt_ptr, 1, sem="acq_rel", scope="gpu")
        if seen == n_tiles - 1:                  # whole rows in registers: one pass over L2
            cols = tl.arange(0, BLOCK_H)          # (two passes of 1,024 measured slower on the H200)
            cmask = cols < N
            w = tl.load(ew_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            for m in range(0, M):
                v = tl.load(y_ptr + m * N + cols, mask=cmask, other=0.0, cache_modifier=".cg").to(tl.float32)
                out = rms_normalize(v, w, N, ep_eps, y_ptr.dtype.element_ty)
                tl.store(a_ptr + m * N + cols, out.to(a_ptr.dtype.element_ty), mask=cmask)
            tl.store(ecnt_ptr, 0)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, p_ptr, cnt_ptr, g_ptr, r_ptr, eps,
                 a_ptr, ew_ptr, ecnt_ptr, ep_eps, HALF,
                 M, N, K, K_SPLIT, stride_xm, stride_wn,
                 HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, MODE: tl.constexpr,
                 PRO: tl.constexpr, HAS_RES: tl.constexpr, EPI: tl.constexpr, BLOCK_H: tl.constexpr,
                 ROWS: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                 PDL: tl.constexpr, PF_TILES: tl.constexpr, PF_LINES: tl.constexpr,
                 LAUNCH_LATE: tl.constexpr):
    """Program (pid_n, pid_k): output columns pid_n*BLOCK_N.., K range [pid_k*K_SPLIT, +K_SPLIT).
    MODE 0: y directly; 1: partial (pid_k, :, cols) into p; 2: partial, then the last program
    of the column tile reduces them (cnt_ptr: per-tile arrival counters, left at 0).
    PRO: the prologue on x (PRO_NORM: g_ptr the RMSNorm weight; PRO_SWIGLU: x is [gate | up]);
    HAS_RES: r_ptr (M, N) is added to the result. EPI: `_epilogue` into a_ptr once a tile is
    finished (ew_ptr, ep_eps: its RMSNorm; ecnt_ptr: its counters; HALF: SwiGLU's N / 2).
    PDL (kernels/_pdl.py): the first PF_TILES weight tiles of the program (PF_LINES 128-byte
    lines per tile row) are prefetched into L2 before waiting for the previous kernel: weights
    are never another kernel's output."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rn_w = tl.minimum(rn, N - 1)                       # rows past N re-read row N-1, never stored
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    w_ptrs = w_ptr + rn_w[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    if PF_TILES > 0:
        pf_k = tl.arange(0, PF_LINES) * (BLOCK_K // PF_LINES)
        for t in tl.static_range(PF_TILES):
            kk = tl.minimum(k_lo + t * BLOCK_K + pf_k, k_hi - 1)
            prefetch_l2(w_ptr + rn_w[:, None].to(tl.int64) * stride_wn + kk[None, :])
    pdl_wait(PDL, not LAUNCH_LATE)
    rows = tl.arange(0, R)
    m_ok = rows < M
    # PRO_NORM: 1/rms of each row over all of K (every program: x is a few KB, in L2); the FMA
    # path takes them as scalars rs0..rs7
    rstd = tl.zeros((R,), dtype=tl.float32)
    if PRO == 1:
        ss = tl.zeros((R, BLOCK_K), dtype=tl.float32)
        k_all = tl.minimum(K, K_SPLIT * tl.num_programs(1))    # = K, as a computed value (older
        for k0 in range(0, k_all, BLOCK_K):                    # interpreters index kernel args badly)
            rk = k0 + offs_k
            xt = tl.load(x_ptr + rows[:, None] * stride_xm + rk[None, :],
                         mask=m_ok[:, None] & (rk < K)[None, :], other=0.0).to(tl.float32)
            ss += xt * xt
        rstd = tl.rsqrt(tl.sum(ss, axis=1) / K + eps)
    rs0 = _pick(rstd, rows, 0)
    rs1 = _pick(rstd, rows, 1)
    rs2 = _pick(rstd, rows, 2)
    rs3 = _pick(rstd, rows, 3)
    rs4 = _pick(rstd, rows, 4)
    rs5 = _pick(rstd, rows, 5)
    rs6 = _pick(rstd, rows, 6)
    rs7 = _pick(rstd, rows, 7)

    acc = tl.zeros((BLOCK_N, R), dtype=tl.float32)     # dot path (R = 16 rows)
    acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)      # FMA path, one per row
    acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc4 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc5 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc6 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc7 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + offs_k
        k_ok = rk < k_hi
        if EVEN_K:
            w = tl.load(w_ptrs + k0)
        else:
            w = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0)
        if DOT:
            x_ptrs = x_ptr + rows[:, None] * stride_xm + rk[None, :]
            gam = rk[None, :]
            if PRO == 1:
                gam = tl.load(g_ptr + rk, mask=k_ok, other=0.0)[None, :]
            if EVEN_K:
                xt = _load_x(x_ptrs, m_ok[:, None], gam, rstd[:, None], K, PRO, True)
            else:
                xt = _load_x(x_ptrs, m_ok[:, None] & k_ok[None, :], gam, rstd[:, None], K, PRO, True)
            wc = _upcast(w, x_ptr.dtype.element_ty, UPCAST)
            if IEEE:
                acc = tl.dot(wc, tl.trans(xt), acc, input_precision="ieee")
            else:
                acc = tl.dot(wc, tl.trans(xt), acc)
        else:
            wf = _upcast(w, tl.float32, UPCAST)
            xr = x_ptr
            acc0 += _row_dot(wf, xr, rk, k_ok, g_ptr, rs0, K, EVEN_K, PRO)
            if ROWS > 1:
                acc1 += _row_dot(wf, xr + stride_xm, rk, k_ok, g_ptr, rs1, K, EVEN_K, PRO)
            if ROWS > 2:
                acc2 += _row_dot(wf, xr + 2 * stride_xm, rk, k_ok, g_ptr, rs2, K, EVEN_K, PRO)
            if ROWS > 3:
                acc3 += _row_dot(wf, xr + 3 * stride_xm, rk, k_ok, g_ptr, rs3, K, EVEN_K, PRO)
            if ROWS > 4:
                acc4 += _row_dot(wf, xr + 4 * stride_xm, rk, k_ok, g_ptr, rs4, K, EVEN_K, PRO)
            if ROWS > 5:
                acc5 += _row_dot(wf, xr + 5 * stride_xm, rk, k_ok, g_ptr, rs5, K, EVEN_K, PRO)
            if ROWS > 6:
                acc6 += _row_dot(wf, xr + 6 * stride_xm, rk, k_ok, g_ptr, rs6, K, EVEN_K, PRO)
            if ROWS > 7:
                acc7 += _row_dot(wf, xr + 7 * stride_xm, rk, k_ok, g_ptr, rs7, K, EVEN_K, PRO)
    pdl_launch(LAUNCH_LATE)                    # (only with PDL on)
    # FMA path: rows go out one by one (the accumulators keep the reduction's layout in the loop)
    p_ptrs = p_ptr + rows[None, :] * N + rn[:, None]              # split s at + s * M * N
    pmask = n_ok[:, None] & m_ok[None, :]
    if DOT:
        if MODE == 0:
            _finish(acc, rows, rn, m_ok, n_ok, s_ptr, b_ptr, r_ptr, y_ptr, N, HAS_SCALE, HAS_BIAS, HAS_RES)
        else:
            tl.store(p_ptrs + pid_k * M * N, acc, mask=pmask)
    else:
        if MODE == 0:
            _finish_row(acc0, 0, rn, n_ok, s_ptr, b_ptr, r_ptr, y_ptr, N, HAS_SCALE, HAS_BIAS, HAS_RES)
            if ROWS > 1:
                _finish_row(acc1, 1, rn, n_ok, s_ptr, b_ptr, r_ptr, y_ptr, N, HAS_SCALE, HAS_BIAS, HAS_RES)
            if ROWS > 2:
                _finish_row(acc2, 2, rn, n_ok, s_ptr, b_ptr, r_ptr, y_ptr, N, HAS_SCALE, HAS_BIAS, HAS_RES)
            if ROWS > 3:
                _finish_row(acc3, 3, rn, n_ok, s_ptr, b_ptr, r_ptr, y_ptr, N, HAS_SCALE, HAS_BIAS, HAS_RES)
            if ROWS > 4:
                _finish_row(acc4, 4, rn, n_ok, s_ptr, b_ptr, r_ptr, y_ptr, N, HAS_SCALE, HAS_BIAS, HAS_RES)
            if ROWS > 5:
                _finish_row(acc5, 5, rn, n_ok, s_ptr, b_ptr, r_ptr, y_ptr, N, HAS_SCALE, HAS_BIAS, HAS_RES)
            if ROWS > 6:
                _finish_row(acc6, 6, rn, n_ok, s_ptr, b_ptr, r_ptr, y_ptr, N, HAS_SCALE, HAS_BIAS, HAS_RES)
            if ROWS > 7:
                _finish_row(acc7, 7, rn, n_ok, s_ptr, b_ptr, r_ptr, y_ptr, N, HAS_SCALE, HAS_BIAS, HAS_RES)
        else:
            pr = p_ptr + pid_k * M * N + rn
            tl.store(pr, acc0, mask=n_ok)
            if ROWS > 1:
                tl.store(pr + N, acc1, mask=n_ok)
            if ROWS > 2:
                tl.store(pr + 2 * N, acc2, mask=n_ok)
            if ROWS > 3:
                tl.store(pr + 3 * N, acc3, mask=n_ok)
            if ROWS > 4:
                tl.store(pr + 4 * N, acc4, mask=n_ok)
            if ROWS > 5:
                tl.store(pr + 5 * N, acc5, mask=n_ok)
            if ROWS > 6:
                tl.store(pr + 6 * N, acc6, mask=n_ok)
            if ROWS > 7:
                tl.store(pr + 7 * N, acc7, mask=n_ok)
    if MODE == 0 and EPI != 0:
        _epilogue(y_ptr, a_ptr, ew_ptr, ecnt_ptr, ep_eps, M, N, HALF, pid_n, tl.num_programs(0),
                  EPI, R, BLOCK_N, BLOCK_H)
    if MODE == 2:
        tl.debug_barrier()                                         # the whole tile is stored ...
        count = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")   # ... then released
        splits = tl.num_programs(1)
        if count == splits - 1:                                    # last to arrive: sum in split order
            tot = tl.zeros((BLOCK_N, R), dtype=tl.float32)
            for s in range(0, splits):
                tot += tl.load(p_ptrs + s * M * N, mask=pmask, other=0.0, cache_modifier=".cg")
            _finish(tot, rows, rn, m_ok, n_ok, s_ptr, b_ptr, r_ptr, y_ptr, N, HAS_SCALE, HAS_BIAS, HAS_RES)
            tl.store(cnt_ptr + pid_n, 0)
            if EPI != 0:
                _epilogue(y_ptr, a_ptr, ew_ptr, ecnt_ptr, ep_eps, M, N, HALF, pid_n, tl.num_programs(0),
                          EPI, R, BLOCK_N, BLOCK_H)


@triton.jit(do_not_specialize=["M", "SPLIT"])
def _splitk_reduce_kernel(p_ptr, s_ptr, b_ptr, r_ptr, y_ptr, M, N, SPLIT,
                          HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, R: tl.constexpr,
                          BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, R)
    n_ok = rn < N
    m_ok = rows < M
    p_ptrs = p_ptr + rows[None, :] * N + rn[:, None]
    pmask = n_ok[:, None] & m_ok[None, :]
    tot = tl.zeros((BLOCK_N, R), dtype=tl.float32)
    for s in range(0, SPLIT):
        tot += tl.load(p_ptrs + s * M * N, mask=pmask, other=0.0)
    _finish(tot, rows, rn, m_ok, n_ok, s_ptr, b_ptr, r_ptr, y_ptr, N, HAS_SCALE, HAS_BIAS, HAS_RES)


# -------------------------------------------------------------------------------------- launcher

_COUNTER_SLOTS = 1 << 16    # [0, PAIR_SLOTS): split-K column tiles; then SwiGLU tile pairs; the
PAIR_SLOTS = 1 << 15        # last slot: the RMSNorm epilogue's grid-wide count


def _counters(device: torch.device) -> torch.Tensor | None:
    """Zeroed per-device arrival counters of the "last" reduction (kernels/_arrivals.py)."""
    return arrival_counters(device, "gemv", _COUNTER_SLOTS)


class _Launch(NamedTuple):
    grid: tuple[int, int]
    k_split: int
    split: int
    mode: int                       # 0 fused, 1 two-pass, 2 last program reduces
    kw: dict


def _plan(x: torch.Tensor, weight: torch.Tensor, cfg: GemvConfig) -> _Launch:
    M = x.shape[0]
    N, K = weight.shape
    fp8 = weight.dtype == F8
    dot = cfg.dot and (fp8 or weight.dtype == x.dtype or x.dtype == torch.float32)
    if not dot:
        assert M <= MAX_M
    block_n = max(16, cfg.block_n) if dot else cfg.block_n
    block_k = min(cfg.block_k, max(16, next_pow2(K)))
    cfg = resolve_split(cfg, N, K)
    nk = triton.cdiv(K, block_k)
    per = triton.cdiv(nk, max(1, min(cfg.split_k, nk)))    # K tiles per program
    split = triton.cdiv(nk, per)
    k_split = per * block_k
    mode = 0
    if split > 1:
        mode = 2 if cfg.reduce == "last" and triton.cdiv(N, block_n) <= PAIR_SLOTS else 1
    upcast = cfg.upcast if fp8 else 0
    if upcast == 2 and (interpreting() or not dot or x.dtype == torch.float32):
        upcast = 1
    kw = dict(MODE=mode, ROWS=DOT_ROWS if dot else M, R=DOT_ROWS if dot else max(2, next_pow2(M)),
              BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot, UPCAST=upcast, EVEN_K=K % k_split == 0,
              IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return _Launch((triton.cdiv(N, block_n), split), k_split, split, mode, kw)


def w8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
            bias: torch.Tensor | None = None, *, config: GemvConfig | None = None,
            norm_weight: torch.Tensor | None = None, eps: float = 1e-6, swiglu: bool = False,
            residual: torch.Tensor | None = None, swiglu_out: bool = False,
            norm_out: tuple[torch.Tensor, float] | None = None) -> torch.Tensor | NormOutput:
    """(M, K) x, M <= MAX_M, unit last stride; (N, K) e4m3 weight; (N,) fp32 scale -> (M, N) in
    x's dtype. With scale None the weight may be any float dtype (a plain GEMV). `config`
    overrides gemv_config's choice (sweeps, tests). Fusions (module doc): `norm_weight` (K,)
    RMSNorm-s x first (epsilon `eps`); `swiglu`: x is (M, 2K) [gate | up]; `residual` (M, N)
    row-major is added to the result. Epilogues: `swiglu_out` returns silu(gate) * up (M, N/2)
    of y = [gate | up]; `norm_out` (weight (N,), epsilon) returns NormOutput(RMSNorm(y), y).
    Where an epilogue cannot run in the GEMV (a two-pass reduction, a tile that does not divide
    N/2), the SwiGLU / RMSNorm kernel runs after it: the same result."""
    M = x.shape[0]
    N, K = weight.shape
    assert 1 <= M <= MAX_M and x.stride(1) == 1, f"x must be (M <= {MAX_M}, K) row-major, got {tuple(x.shape)}"
    assert x.shape[1] == (2 * K if swiglu else K), f"x has {x.shape[1]} columns for a weight of K={K}"
    assert swiglu is False or norm_weight is None, "one prologue: RMSNorm or SwiGLU"
    assert weight.stride(1) == 1 and (scale is None or scale.shape == (N,))
    assert norm_weight is None or norm_weight.shape == (K,)
    assert residual is None or (residual.shape == (M, N) and residual.is_contiguous())
    assert scale is not None or weight.dtype != F8, "e4m3 weights need their scale"
    assert not (swiglu_out and norm_out), "one epilogue: SwiGLU or RMSNorm"
    assert not swiglu_out or (N % 2 == 0 and residual is None), "swiglu_out: y = [gate | up], no residual"
    assert norm_out is None or norm_out[0].shape == (N,), "norm_out: an (N,) RMSNorm weight"
    check_device(x, weight)
    # the FUSED_TUNED key (the epilogues, no work repeated per program, take the plain configs)
    fusion = "+".join(f for f, on in (("norm", norm_weight is not None), ("swiglu", swiglu),
                                      ("res", residual is not None)) if on)
    cfg = config or gemv_config(M, N, K, weight.dtype, fusion)
    plan = _plan(x, weight, cfg)
    mode = plan.mode
    cnt = None
    if mode == 2 or swiglu_out or norm_out:
        cnt = _counters(x.device)
        if cnt is None and mode == 2:
            plan = _plan(x, weight, cfg._replace(reduce="two_pass"))
            mode = plan.mode
    epi, a, ew, ep_eps, ecnt, block_n = EPI_NONE, None, weight, 0.0, cnt, plan.kw["BLOCK_N"]
    if cnt is not None and mode != 1:
        if swiglu_out and (N // 2) % block_n == 0 and N // 2 // block_n < _COUNTER_SLOTS - 1 - PAIR_SLOTS:
            epi, ecnt = EPI_SWIGLU, cnt[PAIR_SLOTS:]
            a = torch.empty((M, N // 2), dtype=x.dtype, device=x.device)
        elif norm_out is not None and N <= MAX_NORM_OUT:
            epi, ecnt, (ew, ep_eps) = EPI_NORM, cnt[_COUNTER_SLOTS - 1:], norm_out
            a = torch.empty((M, N), dtype=x.dtype, device=x.device)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    p = torch.empty((plan.split, M, N), dtype=torch.float32, device=x.device) if mode else y
    s_arg = weight if scale is None else scale           # never read when HAS_SCALE / HAS_BIAS False
    b_arg = weight if bias is None else bias
    g_arg = weight if norm_weight is None else norm_weight
    r_arg = y if residual is None else residual
    pro = PRO_NORM if norm_weight is not None else PRO_SWIGLU if swiglu else PRO_NONE
    pdl = pdl_kwargs(x)
    pf_tiles = min(PDL_PREFETCH_TILES, triton.cdiv(plan.k_split, plan.kw["BLOCK_K"])) if pdl["PDL"] else 0
    pf_lines = max(1, plan.kw["BLOCK_K"] * weight.element_size() // 128)
    late = bool(pdl["PDL"]) and PDL_LAUNCH_LATE
    _gemv_kernel[plan.grid](x, weight, s_arg, b_arg, y, p, y if cnt is None else cnt, g_arg, r_arg, eps,
                            y if a is None else a, ew, y if ecnt is None else ecnt, ep_eps, N // 2,
                            M, N, K, plan.k_split, x.stride(0), weight.stride(0),
                            HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, PRO=pro,
                            HAS_RES=residual is not None, EPI=epi, BLOCK_H=next_pow2(N) if epi == EPI_NORM else 16,
                            PF_TILES=pf_tiles, PF_LINES=pf_lines, LAUNCH_LATE=late, **pdl, **plan.kw)
    if mode == 1:
        R = max(2, next_pow2(M))
        _splitk_reduce_kernel[(triton.cdiv(N, 256),)](p, s_arg, b_arg, r_arg, y, M, N, plan.split,
                                                      HAS_SCALE=scale is not None, HAS_BIAS=bias is not None,
                                                      HAS_RES=residual is not None, R=R, BLOCK_N=256,
                                                      num_warps=4, **pdl)
    if swiglu_out:
        return a if epi == EPI_SWIGLU else swiglu_kernel(y)
    if norm_out is not None:
        return NormOutput(a, y) if epi == EPI_NORM else rmsnorm(y, norm_out[0], norm_out[1])
    return y


def w8_gemv_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                bias: torch.Tensor | None = None, *, norm_weight: torch.Tensor | None = None,
                eps: float = 1e-6, swiglu: bool = False, residual: torch.Tensor | None = None,
                swiglu_out: bool = False, norm_out: tuple[torch.Tensor, float] | None = None
                ) -> torch.Tensor | NormOutput:
    """w8_gemv in torch ops, rounding to x's dtype where Hugging Face's unfused layers do (the
    epilogues where the SwiGLU / RMSNorm kernels do)."""
    dt = x.dtype
    if swiglu:
        gate, up = x.float().split(weight.shape[1], dim=-1)
        x = (torch.nn.functional.silu(gate).to(dt).float() * up).to(dt)
    if norm_weight is not None:
        xf = x.float()
        xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
        x = (xn.float() * norm_weight.float()).to(dt)
    w = weight.float() if scale is None else weight.float() * scale[:, None]
    y = x.float() @ w.t()
    y = (y if bias is None else y + bias.float()).to(dt)
    y = y if residual is None else (y.float() + residual.float()).to(dt)
    if swiglu_out:
        return swiglu_ref(y)
    return y if norm_out is None else rmsnorm_ref(y, norm_out[0], norm_out[1])

