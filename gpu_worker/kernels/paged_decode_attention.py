"""Paged decode attention (one new query token per sequence), GQA-aware, split-K.

For sequence b, query head h (KV head g = h // G, G = num_heads / num_kv_heads) and its context
of n = context_lens[b] tokens stored in the paged cache through block_tables[b]:

    s_j    = scale * <q[b, h], K[b, j, g]>                    j = 0 .. n-1
    out[b, h] = sum_j softmax(s)_j * V[b, j, g]

Stage 1 (grid: sequences x head blocks x splits): one program reads a KV head's tiles once for
a block of P query heads that share it (P = `heads_per_program`, a divisor of G, default G: a
(P_pad, D) x (D, BLOCK_N) dot, P_pad >= 16), over its slice of the context:
the context is cut into `num_splits` equal, BLOCK_N-aligned partitions per sequence (computed in
the kernel from context_lens, so the grid depends only on num_splits: CUDA-graph safe). Each
program keeps an online softmax (running max m, sum l, accumulator acc) in fp32 (log2 domain).

    context |---- split 0 ----|---- split 1 ----|-- split 2 --|   (n tokens)
             tile tile tile ... each tile = BLOCK_N tokens gathered through the block table

The splits' partial (m, l, acc) are merged as
    M = max_s m_s,  out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s
in one of two ways (`merge`, default the DecodeAttentionTuning's, gpu_worker/tuning.py):
    "last"      in the same launch: each program stores its partial, then bumps its (sequence,
                head block)'s arrival counter (kernels/_arrivals.py); the program that arrives
                last merges the splits of its P query heads (read through L2) and writes them
    "two_pass"  stage 2, a second kernel (grid: sequences x query heads)
Both run the same `_merge_head` in fixed split order: bit-identical outputs, deterministic.
With num_splits == 1 stage 1 writes the normalized output directly.

Short contexts (the short decode graphs, contexts <= SHORT_SPLIT_CONTEXT) are split too,
finely (`choose_short_split`: up to 16 partitions of 16-key tiles by default), so that a batch-1
step runs B x KV heads x splits programs instead of 8, with RoPE and the KV write fused in (see
below); each program can also take fewer query heads (short_heads_per_program: with P = 1, 32
programs at batch 1 without a split or a merge; measured slower).

With a sliding window W only the last W keys are attended (the partitions cover those).
An fp8 cache (e4m3/e5m2) is read with per-tensor scales: K = k_scale * stored, V = v_scale * stored
(k_scale folds into the logit scale, v_scale into the output). How a tile is upcast for the two dots
is `fp8_upcast` (default: the tuning's fp8_upcast):

    "bf16"      tiles .to(q's dtype): bf16 dots. On sm_90 Triton has no e4m3->bf16 instruction; it
                emits e4m3x2->f16x2 then two f16->bf16 conversions per pair (conversion-throughput
                bound: slower than a bf16 cache, whose tiles need no conversion)
    "f16"       fp16 dots: q converted once to fp16, tiles .to(fp16) (one cvt.rn.f16x2.e4m3x2 per
                pair; e4m3 and e5m2 are subsets of fp16, so exact), p cast to fp16 for the PV dot
    "f16_bits"  fp16 dots, e4m3 byte -> fp16 bits by shift/mask (integer ops, no conversion unit):
                (b & 0x80) << 8 | (b & 0x7F) << 7 is the fp16 of value * 2^-8 exactly, subnormals
                included; the 2^8 is folded into the logit scale and the V scale
    "f16_asm"   as "f16_bits", four bytes at a time in inline PTX (prmt/shr/lop3); the interpreter
                cannot run inline asm, so under TRITON_INTERPRET=1 it runs as "f16_bits" (same bits)

The fp16 variants assume |q| < 65504 (bf16 q converts to fp16 exactly in fp16's normal range; a
|q| below 2^-14 keeps fewer bits, negligible in a dot); p <= 1 in fp16 has 11 significant bits
(bf16: 8), and p below 2^-24 (a weight < 6e-8 against the row's max) drops out of the PV dot only.
The bit variants decode e4m3 (an e5m2 cache uses "f16"); e4m3fn's NaN codes (never written: the
cache write saturates at +-448) would read as +-480.

Fused RoPE + KV write (`rope=FusedRopeKV(...)`, rope_kv_write.py's work in this kernel: one launch
fewer per layer of a decode step): q and this step's k arrive unrotated; each program rotates its
query heads in registers (fp32 maths, rounded to q's dtype as rope_kv_write stores them), and the
program whose partition holds the sequence's last key (the new token) rotates its KV head's k
and attends to k, v from registers after its cached tiles (no read-back of a write); of those,
the KV head's first head block writes them into the cache slot. Pure-decode batches, head_dim a
power of two.

Rows: with `query_start_loc`, sequence b's query is row query_start_loc[b] of q/out and sequences
whose query_len != 1 are skipped (the prefill kernel handles them in a mixed batch). Without it,
q has one row per sequence. A context length of 0 (a padded CUDA-graph row) writes zeros.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gpu_worker.kernels._arrivals import arrival_counters
from gpu_worker.kernels._paged_kv import F32_DOTS, gather_kv_tile
from gpu_worker.kernels._pdl import pdl_kwargs, pdl_wait
from gpu_worker.kernels._utils import check_device, interpreting, next_pow2, num_sms
from gpu_worker.tuning import SPLIT_MERGES, DecodeAttentionTuning

LOG2E = 1.4426950408889634

# Every choice below (splits, tiles, warps, merge, fp8 upcast) comes from a DecodeAttentionTuning
# (gpu_worker/tuning.py: its fields, defaults and the H200 measurements behind them), passed by
# the caller; DEFAULT_TUNING when none is given. Measured on the H200:
#  - fp8 upcast: fp16 compute is the fastest everywhere (geomean fp8/bf16-cache time 1.12 vs 1.31
#    for the bf16 upcast, 1.19 PTX bits, 1.47 plain bits), and with 128-key tiles x 3 stages it
#    beats the bf16 cache at batch 1 (0.83-0.89x) and at B=64 x 32k (0.95x), equal at B=64 x 8k.
#  - merge: the second kernel won: the in-launch merge of one program made the bf16 batch-1
#    graph 0.13 ms slower at 8k context (32 splits) and 0.06 ms at 128 (8 splits); its programs
#    with 1 warp instead of 4: 4.164 -> 4.150 ms at 128 context, 4.598 -> 4.585 at 8k.
#  - short contexts (batch-1 graph at 128 context): unsplit 4.416 ms, 16 x 16 4.165, 8 x 16
#    4.188, 4 x 32 4.213, a program per query head (1 x 64, h1) 4.406; fp8 2.990 -> 2.761 with
#    16 x 16. Up to 1,024 tokens (not 512) so that chats of a 512-token prompt stay on the short
#    graphs: serving at concurrency 1 (512 in / 128 out), median TPOT 4.28 -> 4.25 ms.
#  - long contexts, batch-1 graph ms at 8k context, bf16 / fp8: 32 splits of 4 warps 4.530 /
#    3.144; 8 warps 4.451 / 3.046; 64 splits of 64-key tiles 4.510 / 3.047; 32 of 64-key tiles
#    4.530 / 3.100; 16 splits 4.720 / 3.358 (another machine). An fp8 cache's programs read half
#    the bytes per key, and 8 warps made them far slower (batch 1, 32 splits of 128-key tiles x
#    3 stages, RoPE fused, PDL: 8 / 4 warps 53.8 / 34.5 us at 32k, 19.1 / 12.6 us at 8k), hence
#    long_num_warps_fp8 None (4).
DEFAULT_TUNING = DecodeAttentionTuning()
FP8_UPCAST_CODES = {"bf16": 0, "f16": 1, "f16_bits": 2, "f16_asm": 3}
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_BITS_SCALE = 256.0          # the bit variants read value * 2^-8
_COUNTER_SLOTS = 1 << 16          # (sequence, head block) pairs a "last" merge can count at once

# The short decode graphs' context bound: choose_short_split's contexts (model_runner captures
# a second set of decode graphs for them).
SHORT_SPLIT_CONTEXT = 1024


@triton.jit
def _upcast_tile(x, UPCAST: tl.constexpr, DT: tl.constexpr):
    """A loaded KV tile in the dots' dtype: DT (q's dtype) for UPCAST 0, else fp16 (x 2^-8 for 2, 3)."""
    if UPCAST == 0:
        y = x.to(DT)
    elif UPCAST == 1:
        y = x.to(tl.float16)
    elif UPCAST == 2:
        # e4m3 s.eeee.mmm -> fp16 s.0eeee.mmm0000000: the same exponent field under fp16's bias 15
        # (e4m3's is 7) and the same mantissa bits, i.e. value * 2^-8; e4m3 subnormals (exponent
        # field 0) land on fp16 subnormals with the same scaling. int16 maths (0x80 << 8 wraps to
        # the sign bit); zero-extended from the byte.
        b = x.to(tl.uint8, bitcast=True).to(tl.int16)
        y = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)
    else:
        # The same bits, 4 bytes per 32-bit register: prmt spreads bytes b0..b3 into the high
        # bytes of two f16x2 registers (h = b << 8), then (h & 0x7fff) >> 1 | (h & 0x8000).
        y = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 a<2>, c<2>;
            prmt.b32 a0, 0, $2, 0x5140;
            prmt.b32 a1, 0, $2, 0x7362;
            and.b32 c0, a0, 0x7fff7fff;
            and.b32 c1, a1, 0x7fff7fff;
            shr.b32 c0, c0, 1;
            shr.b32 c1, c1, 1;
            lop3.b32 $0, c0, 0x80008000, a0, 0xf8;
            lop3.b32 $1, c1, 0x80008000, a1, 0xf8;
            }""",
            constraints="=r,=r,r", args=[x.to(tl.uint8, bitcast=True)], dtype=tl.float16,
            is_pure=True, pack=4)
    return y


class FusedRopeKV(NamedTuple):
    """This step's rotary embedding and KV write, for paged_decode_attention to do (module doc)."""
    positions: torch.Tensor      # (T,) int
    cos_sin: torch.Tensor        # (max_position, head_dim) [cos | sin] fp32 (rope.py's table)
    k: torch.Tensor              # (T, num_kv_heads, head_dim) this step's keys, unrotated
    v: torch.Tensor              # (T, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor   # (T,) cache slot of each row's new token, < 0: no write


@triton.jit
def _rotate(x_ptr, partner_offs, mask, x, cos, sin, d, HALF: tl.constexpr):
    """x rotated by HF's rotate_half (fp32 maths, rounded to x's dtype): x's partner elements are
    loaded from x_ptr + partner_offs (d +- HALF)."""
    x2 = tl.load(x_ptr + partner_offs, mask=mask, other=0.0).to(tl.float32)
    sgn = tl.where(d < HALF, -1.0, 1.0)
    return (x.to(tl.float32) * cos + sgn * x2 * sin).to(x.dtype)


@triton.jit
def _merge_head(part_acc_ptr, part_ml_ptr, b, h, stride_pa_b, stride_pa_h, stride_pa_s,
                stride_pm_b, stride_pm_h, stride_pm_s, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """(BLOCK_D,) fp32 output of query head h of sequence b from its splits' partial (m, l, acc)
    (module doc), read through L2 (.cg): other programs of this launch may have stored them."""
    sp = tl.arange(0, SPLITS_PAD)
    smask = sp < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    pm = part_ml_ptr + b.to(tl.int64) * stride_pm_b + h * stride_pm_h + sp * stride_pm_s
    m = tl.load(pm, mask=smask, other=float("-inf"), cache_modifier=".cg")     # (SPLITS_PAD,)
    l = tl.load(pm + 1, mask=smask, other=0.0, cache_modifier=".cg")
    m_all = tl.max(m, axis=0)
    m_all = tl.where(m_all > float("-inf"), m_all, 0.0)      # every split empty: a context of 0
    w = tl.where(m > float("-inf"), tl.exp2(m - m_all), 0.0)  # empty splits weigh nothing
    acc = tl.load(part_acc_ptr + b.to(tl.int64) * stride_pa_b + h * stride_pa_h + sp[:, None] * stride_pa_s
                  + d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0,
                  cache_modifier=".cg")                     # (SPLITS_PAD, BLOCK_D)
    num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(l * w, axis=0)
    return num / tl.where(den > 0, den, 1.0)


# Step-dependent scalars and pointers into the engine's per-step staging buffers: specializing on
# their values or 16-byte alignment would compile a new variant mid-serving (a ~1 s stall).
_STEP_PTRS = ["block_tables_ptr", "context_lens_ptr", "qsl_ptr", "pos_ptr", "slot_ptr"]


@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=_STEP_PTRS)
def _decode_stage1_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, qsl_ptr,
    out_ptr, part_acc_ptr, part_ml_ptr, qk_scale, v_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_pa_b, stride_pa_h, stride_pa_s, stride_pm_b, stride_pm_h, stride_pm_s,
    pos_ptr, cs_ptr, kn_ptr, vn_ptr, slot_ptr, stride_cs, stride_knt, stride_knh, stride_vnt, stride_vnh,
    inv_k_scale, inv_v_scale, fp8_max, cnt_ptr,
    GROUP: tl.constexpr, HPP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HAS_QSL: tl.constexpr, DIRECT: tl.constexpr, MERGE_LAST: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr, ROPE: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Program (b, j, split): query heads j*HPP .. j*HPP+HPP-1 (of KV head g = j*HPP // GROUP)
    over partition `split` of sequence b's context. ROPE (module doc): pos_ptr, cs_ptr (cos | sin
    table), kn_ptr, vn_ptr (this step's unrotated k, v), slot_ptr (their cache slots); KV_FP8:
    written scaled and saturated to +-fp8_max, as kv_cache_write does. MERGE_LAST: cnt_ptr holds
    an arrival counter per (b, j); the last of its NUM_SPLITS programs merges and writes out."""
    pdl_wait(PDL)                  # kernels/_pdl.py: before the early return of prefill rows too
    b = tl.program_id(0)
    h0 = tl.program_id(1) * HPP                             # the block's first query head
    g = h0 // GROUP                                         # their KV head
    split = tl.program_id(2)
    if HAS_QSL:
        row = tl.load(qsl_ptr + b).to(tl.int64)
        if tl.load(qsl_ptr + b + 1) - row != 1:
            return                                              # a prefill row: not ours
    else:
        row = b.to(tl.int64)
    n_ctx = tl.load(context_lens_ptr + b)
    lo = tl.where(window > 0, tl.maximum(n_ctx - window, 0), 0)   # sliding window: the last `window` keys
    part = tl.cdiv(tl.cdiv(n_ctx - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * part
    end = tl.minimum(start + part, n_ctx)

    heads = h0 + tl.arange(0, GROUP_PAD)                    # (GROUP_PAD,) this block's query heads
    hmask = tl.arange(0, GROUP_PAD) < HPP
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q_offs = row * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_ptr + q_offs + d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)  # (GROUP_PAD, BLOCK_D)
    if ROPE:                       # BLOCK_D == HEAD_DIM: d +- HALF is the rotate_half partner
        HALF = HEAD_DIM // 2
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        pos = tl.load(pos_ptr + row).to(tl.int64)
        cos = tl.load(cs_ptr + pos * stride_cs + d % HALF).to(tl.float32)
        sin = tl.load(cs_ptr + pos * stride_cs + HALF + d % HALF).to(tl.float32)
        q = _rotate(q_ptr, q_offs + partner[None, :], hmask[:, None], q, cos[None, :], sin[None, :], d[None, :], HALF)
        # this step's key and value of KV head g, as the cache stores them
        kn_offs = row * stride_knt + g * stride_knh
        kn = tl.load(kn_ptr + kn_offs + d)
        kr = _rotate(kn_ptr, kn_offs + partner, d < HEAD_DIM, kn, cos, sin, d, HALF)
        vn = tl.load(vn_ptr + row * stride_vnt + g * stride_vnh + d)
        if KV_FP8:
            kw = tl.clamp(kr.to(tl.float32) * inv_k_scale, -fp8_max, fp8_max).to(k_cache_ptr.dtype.element_ty)
            vw = tl.clamp(vn.to(tl.float32) * inv_v_scale, -fp8_max, fp8_max).to(v_cache_ptr.dtype.element_ty)
        else:
            kw, vw = kr.to(k_cache_ptr.dtype.element_ty), vn.to(v_cache_ptr.dtype.element_ty)
        # the partition that holds the new key (the context's last) takes it from registers after
        # its tiles instead of reading it back from the cache; of the KV head's head blocks the
        # first one writes it
        has_new = (end == n_ctx) & (start < end)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        if has_new & (slot >= 0) & (h0 % GROUP == 0):
            tl.store(k_cache_ptr + (slot // PAGE) * stride_kb + (slot % PAGE) * stride_ks + g * stride_kh + d, kw)
            tl.store(v_cache_ptr + (slot // PAGE) * stride_vb + (slot % PAGE) * stride_vs + g * stride_vh + d, vw)
        end = end - has_new.to(tl.int32)
    if UPCAST != 0:
        q = q.to(tl.float16)       # fp8 cache, fp16 dots: exact for bf16 q with |q| < 65504

    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, BLOCK_D), tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)                    # (BLOCK_N,) token positions
        tmask = tok < end
        k, v = gather_kv_tile(bt_row, k_cache_ptr, v_cache_ptr, tok, tmask, d, dmask, g, stride_kb, stride_ks,
                              stride_kh, stride_vb, stride_vs, stride_vh, PAGE, True, False)  # (BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(_upcast_tile(k, UPCAST, q.dtype)), input_precision=F32_DOTS) * qk_scale   # log2
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), _upcast_tile(v, UPCAST, q.dtype), input_precision=F32_DOTS)
        m = m_new
    if ROPE:
        if has_new:                # the new key: one more online-softmax step, the tiles' roundings
            k1 = _upcast_tile(kw[None, :], UPCAST, q.dtype).to(tl.float32)          # (1, BLOCK_D)
            v1 = _upcast_tile(vw[None, :], UPCAST, q.dtype).to(tl.float32)
            s1 = tl.sum(q.to(tl.float32) * k1, axis=1) * qk_scale                   # (GROUP_PAD,)
            m_new = tl.maximum(m, s1)
            alpha = tl.exp2(m - m_new)
            p1 = tl.exp2(s1 - m_new)
            l = l * alpha + p1
            acc = acc * alpha[:, None] + p1.to(q.dtype).to(tl.float32)[:, None] * v1
            m = m_new

    acc = acc * v_scale                                     # fp8 cache: the V scale (else 1; x 2^8 for bits)
    if DIRECT:
        l_safe = tl.where(l > 0, l, 1.0)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])
    else:
        pa = part_acc_ptr + b.to(tl.int64) * stride_pa_b + heads[:, None] * stride_pa_h + split * stride_pa_s + d[None, :]
        tl.store(pa, acc, mask=hmask[:, None] & dmask[None, :])
        pm = part_ml_ptr + b.to(tl.int64) * stride_pm_b + heads * stride_pm_h + split * stride_pm_s
        tl.store(pm, m, mask=hmask)
        tl.store(pm + 1, l, mask=hmask)
        if MERGE_LAST:
            tl.debug_barrier()                              # every thread's partial stored ...
            cnt = cnt_ptr + b * tl.num_programs(1) + tl.program_id(1)
            seen = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")   # ... then released
            if seen == NUM_SPLITS - 1:                      # the last: the others' are visible
                for i in tl.static_range(HPP):
                    h = h0 + i
                    o = _merge_head(part_acc_ptr, part_ml_ptr, b, h, stride_pa_b, stride_pa_h, stride_pa_s,
                                    stride_pm_b, stride_pm_h, stride_pm_s, HEAD_DIM, BLOCK_D, NUM_SPLITS,
                                    SPLITS_PAD)
                    tl.store(out_ptr + row * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty),
                             mask=dmask)
                tl.store(cnt, 0)


@triton.jit(do_not_specialize_on_alignment=["qsl_ptr"])
def _decode_stage2_kernel(
    qsl_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    stride_ot, stride_oh, stride_pa_b, stride_pa_h, stride_pa_s, stride_pm_b, stride_pm_h, stride_pm_s,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HAS_QSL: tl.constexpr, PDL: tl.constexpr,
):
    """The "two_pass" merge: program (b, h) writes query head h of sequence b."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    if HAS_QSL:
        row = tl.load(qsl_ptr + b).to(tl.int64)
        if tl.load(qsl_ptr + b + 1) - row != 1:
            return
    else:
        row = b.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    o = _merge_head(part_acc_ptr, part_ml_ptr, b, h, stride_pa_b, stride_pa_h, stride_pa_s,
                    stride_pm_b, stride_pm_h, stride_pm_s, HEAD_DIM, BLOCK_D, NUM_SPLITS, SPLITS_PAD)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device,
                      tuning: DecodeAttentionTuning = DEFAULT_TUNING) -> int:
    """Enough programs to fill the GPU tuning.long_programs_per_sm times over, with at least
    tuning.long_min_tokens tokens each, at most tuning.long_max_splits.

    Depends only on host-side sizes, so a CUDA graph captured for (num_seqs, max_model_len)
    stays valid for every shorter context."""
    programs = num_seqs * num_kv_heads
    by_occupancy = triton.cdiv(tuning.long_programs_per_sm * num_sms(device), max(1, programs))
    by_length = triton.cdiv(max(1, max_context_len), tuning.long_min_tokens)
    return int(max(1, min(by_occupancy, by_length, tuning.long_max_splits)))


class DecodeSplit(NamedTuple):
    num_splits: int
    block_n: int | None = None            # keys per tile; None: paged_decode_attention's default
    heads_per_program: int | None = None  # None: all G query heads of a KV head
    num_warps: int | None = None          # None: paged_decode_attention's default

    @property
    def fine(self) -> bool:
        """More than one program per (sequence, KV head): RoPE + KV write go into the kernel."""
        return self.num_splits > 1 or self.heads_per_program is not None


def choose_short_split(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device,
                       group: int = 1, tuning: DecodeAttentionTuning = DEFAULT_TUNING) -> DecodeSplit:
    """For contexts of at most SHORT_SPLIT_CONTEXT tokens (a short decode graph's bound): blocks of
    tuning.short_heads_per_program of the `group` query heads of a KV head (None: the whole group)
    and up to tuning.short_max_splits partitions of short_block_n-key tiles, as many as keep 2
    programs per SM, each program of short_num_warps warps.

    At batch 1 a whole 128-token context in one program per KV head is 8 programs running a
    chain of dependent loads; 8 partitions of 16 keys each make it 64 programs of one tile."""
    assert max_context_len <= SHORT_SPLIT_CONTEXT, "choose_short_split is for short contexts"
    hpp = tuning.short_heads_per_program
    if hpp is not None and (hpp >= group or group % hpp):
        hpp = None                                  # a block of the whole group
    programs = max(1, num_seqs * num_kv_heads * (group // hpp if hpp else 1))
    by_occupancy = triton.cdiv(2 * num_sms(device), programs)
    by_length = triton.cdiv(max(1, max_context_len), tuning.short_block_n)
    splits = int(max(1, min(tuning.short_max_splits, by_occupancy, by_length)))
    fine = splits > 1 or hpp is not None
    return DecodeSplit(splits, tuning.short_block_n, hpp, tuning.short_num_warps) if fine else DecodeSplit(1)


def choose_decode_split(num_seqs: int, num_kv_heads: int, max_context_len: int,
                        device: torch.device, group: int = 1, kv_dtype: torch.dtype | None = None,
                        tuning: DecodeAttentionTuning = DEFAULT_TUNING) -> DecodeSplit:
    """The split of a step whose contexts are at most max_context_len: choose_short_split for
    short contexts, else choose_num_splits with the long-context tiles (long_num_warps_fp8 warps
    for an fp8 cache of kv_dtype)."""
    if max_context_len <= SHORT_SPLIT_CONTEXT:
        return choose_short_split(num_seqs, num_kv_heads, max_context_len, device, group, tuning)
    splits = choose_num_splits(num_seqs, num_kv_heads, max_context_len, device, tuning)
    if splits == 1:
        return DecodeSplit(1)
    warps = tuning.long_num_warps_fp8 if kv_dtype in _FP8_DTYPES else tuning.long_num_warps
    return DecodeSplit(splits, tuning.long_block_n, None, warps)


def _fp8_upcast_code(cache_dtype: torch.dtype, fp8_upcast: str) -> tuple[int, float]:
    """(UPCAST constexpr, factor folded into both scales) for a cache dtype and an fp8_upcast name."""
    if fp8_upcast not in FP8_UPCAST_CODES:
        raise ValueError(f"fp8_upcast must be one of {sorted(FP8_UPCAST_CODES)}, got {fp8_upcast!r}")
    if cache_dtype not in _FP8_DTYPES:
        return 0, 1.0                       # a bf16/fp16/fp32 cache: tiles already in q's dtype
    code = FP8_UPCAST_CODES[fp8_upcast]
    if code >= 2 and cache_dtype != torch.float8_e4m3fn:
        code = 1                            # the bit tricks decode e4m3; e5m2 -> fp16 is exact
    if code == 3 and interpreting():
        code = 2                            # inline PTX can't be interpreted: its bit-identical twin
    return code, (_FP8_BITS_SCALE if code >= 2 else 1.0)


@triton.jit
def _fp8_upcast_probe_kernel(x_ptr, y_ptr, n, UPCAST: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(y_ptr + i, _upcast_tile(x, UPCAST, tl.float32).to(tl.float32), mask=i < n)


def fp8_upcast_probe(x: torch.Tensor, fp8_upcast: str) -> torch.Tensor:
    """fp32 of what the decode kernel's dots see for fp8 values x (1-D, <= 4096): the values, times
    2^-8 for the bit variants. For checking each upcast exactly (all 256 bytes) on the device."""
    assert x.dim() == 1 and x.dtype in _FP8_DTYPES and x.numel() <= 4096
    code, _ = _fp8_upcast_code(x.dtype, fp8_upcast)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    _fp8_upcast_probe_kernel[(1,)](x, y, x.numel(), UPCAST=code, BLOCK=max(128, next_pow2(x.numel())),
                                   num_warps=1)
    return y


def fp8_upcast_probe_ref(x: torch.Tensor, fp8_upcast: str) -> torch.Tensor:
    """Plain-torch fp8_upcast_probe: the fp8 values in fp32, times 2^-8 for the bit variants on e4m3."""
    code, mul = _fp8_upcast_code(x.dtype, fp8_upcast)
    return x.float() / mul


def e4m3_to_f16_bits_ref(x: torch.Tensor) -> torch.Tensor:
    """The bit variants' shift/mask in torch: e4m3 bytes -> the fp16 whose value is x * 2^-8."""
    b = x.view(torch.uint8).to(torch.int32)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)                  # an fp16 bit pattern, < 2^16
    return (bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.float16)   # as int16, no overflow


def paged_decode_attention(
    q: torch.Tensor,             # (T, num_heads, head_dim)
    k_cache: torch.Tensor,       # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,       # (num_blocks, block_size, num_kv_heads, head_dim)
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    context_lens: torch.Tensor,  # (B,) int32, tokens in the cache per sequence (this step's included)
    scale: float,
    *,
    max_context_len: int,        # host-side bound on context_lens (picks num_splits)
    query_start_loc: torch.Tensor | None = None,  # (B+1,) int32; None: T == B, one row each
    out: torch.Tensor | None = None,              # (T, num_heads, head_dim)
    num_splits: int | None = None,
    sliding_window: int | None = None,            # attend to the last `sliding_window` keys only
    k_scale: float = 1.0,                         # fp8 caches: the stored values times these
    v_scale: float = 1.0,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp8_upcast: str | None = None,                # fp8 caches: "bf16" | "f16" | "f16_bits" | "f16_asm" (tuning's)
    rope: FusedRopeKV | None = None,              # RoPE + this step's KV write fused in (module doc)
    merge: str | None = None,                     # split partials: "last" | "two_pass" (tuning.merge)
    heads_per_program: int | None = None,         # query heads per program, a divisor of the group
    tuning: DecodeAttentionTuning = DEFAULT_TUNING,   # the choices for what is not given above
) -> torch.Tensor:
    """Attention of each sequence's single new query over its paged context (module docstring)."""
    T, n_heads, head_dim = q.shape
    n_blocks, page, n_kv, head_dim_c = k_cache.shape
    B = block_tables.shape[0]
    assert v_cache.shape == k_cache.shape, "k_cache and v_cache must have one shape"
    assert head_dim_c == head_dim, f"cache head_dim {head_dim_c} != q's {head_dim}"
    assert n_heads % n_kv == 0, f"num_heads {n_heads} must be a multiple of num_kv_heads {n_kv}"
    assert context_lens.shape == (B,), f"context_lens must be ({B},), got {tuple(context_lens.shape)}"
    assert block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
    if query_start_loc is None:
        assert T == B, f"without query_start_loc q needs one row per sequence: {T} rows for {B} sequences"
    else:
        assert query_start_loc.shape == (B + 1,), "query_start_loc must be (B+1,)"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    check_device(q, k_cache, v_cache, block_tables, context_lens, query_start_loc)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if B == 0:
        return out
    group = n_heads // n_kv
    if num_splits is None:
        auto = choose_decode_split(B, n_kv, max_context_len, q.device, group, k_cache.dtype, tuning)
        num_splits, block_n = auto.num_splits, block_n or auto.block_n
        heads_per_program = heads_per_program or auto.heads_per_program
        num_warps = num_warps or auto.num_warps
    hpp = heads_per_program or group
    assert group % hpp == 0, f"heads_per_program {hpp} must divide the {group} query heads per KV head"
    # Tiles measured on an H200 (bench/gpu_bench.py --sweep, Llama-8B heads): 64 x 2 stages when
    # each program walks a whole context, 128 x 3 stages for the shorter split partitions.
    # An fp8 cache moves half the bytes per key: 128-key tiles x 3 stages won in both modes
    # (swept on the H200).
    split = num_splits > 1
    wide_tiles = (split or k_cache.dtype.itemsize == 1) and head_dim <= 128
    if block_n is None:
        block_n = 128 if wide_tiles else (64 if head_dim <= 128 else 32)
    if num_warps is None:
        num_warps = 4
    if num_stages is None:
        num_stages = 3 if wide_tiles else 2
    upcast, kv_mul = _fp8_upcast_code(k_cache.dtype, tuning.fp8_upcast if fp8_upcast is None else fp8_upcast)
    merge = tuning.merge if merge is None else merge
    if merge not in SPLIT_MERGES:
        raise ValueError(f"merge must be one of {SPLIT_MERGES}, got {merge!r}")
    direct = num_splits == 1
    counters = None
    if not direct and merge == "last" and B * (n_heads // hpp) <= _COUNTER_SLOTS:
        counters = arrival_counters(q.device, "decode_attention", _COUNTER_SLOTS)   # None: two passes
    if direct:
        part_acc = part_ml = out     # unused
        pa_strides, pm_strides = (0, 0, 0), (0, 0, 0)
    else:
        part_acc = torch.empty((B, n_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((B, n_heads, num_splits, 2), dtype=torch.float32, device=q.device)
        pa_strides = part_acc.stride()[:3]
        pm_strides = part_ml.stride()[:3]
    qsl = query_start_loc if query_start_loc is not None else context_lens
    BLOCK_D = next_pow2(head_dim)
    rope_args = _rope_args(rope, q, k_cache, k_scale, v_scale)
    _decode_stage1_kernel[(B, n_heads // hpp, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, qsl, out, part_acc, part_ml,
        scale * k_scale * kv_mul * LOG2E, v_scale * kv_mul, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        *pa_strides, *pm_strides, *rope_args, out if counters is None else counters,
        GROUP=group, HPP=hpp, GROUP_PAD=max(16, next_pow2(hpp)), HEAD_DIM=head_dim, BLOCK_D=BLOCK_D,
        BLOCK_N=block_n, PAGE=page, NUM_SPLITS=num_splits, SPLITS_PAD=next_pow2(num_splits),
        HAS_QSL=query_start_loc is not None, DIRECT=direct, MERGE_LAST=counters is not None,
        UPCAST=upcast, ROPE=rope is not None, KV_FP8=rope is not None and k_cache.dtype in _FP8_DTYPES,
        num_warps=num_warps, num_stages=num_stages, **pdl_kwargs(q),
    )
    if not direct and counters is None:
        _decode_stage2_kernel[(B, n_heads)](
            qsl, out, part_acc, part_ml, out.stride(0), out.stride(1), *pa_strides, *pm_strides,
            HEAD_DIM=head_dim, BLOCK_D=BLOCK_D, NUM_SPLITS=num_splits, SPLITS_PAD=next_pow2(num_splits),
            HAS_QSL=query_start_loc is not None, num_warps=tuning.merge_num_warps, **pdl_kwargs(q),
        )
    return out


def _rope_args(rope: FusedRopeKV | None, q: torch.Tensor, k_cache: torch.Tensor, k_scale: float,
               v_scale: float) -> tuple:
    """The stage-1 kernel's RoPE + KV-write arguments (placeholders without `rope`)."""
    if rope is None:
        return (q, q, q, q, q, 0, 0, 0, 0, 0, 1.0, 1.0, 0.0)
    T, n_kv, head_dim = q.shape[0], k_cache.shape[2], q.shape[2]
    cs = rope.cos_sin.reshape(rope.cos_sin.shape[0], -1)
    assert head_dim == next_pow2(head_dim) and cs.shape[1] == head_dim, "fused RoPE: head_dim a power of two"
    assert rope.k.shape == (T, n_kv, head_dim) and rope.v.shape == rope.k.shape, "rope.k, rope.v: (T, nkv, D)"
    assert rope.positions.shape == (T,) and rope.slot_mapping.shape == (T,)
    assert cs.stride(-1) == 1 and rope.k.stride(-1) == 1 and rope.v.stride(-1) == 1
    check_device(q, rope.positions, cs, rope.k, rope.v, rope.slot_mapping)
    fp8_max = torch.finfo(k_cache.dtype).max if k_cache.dtype in _FP8_DTYPES else 0.0
    return (rope.positions, cs, rope.k, rope.v, rope.slot_mapping, cs.stride(0), rope.k.stride(0),
            rope.k.stride(1), rope.v.stride(0), rope.v.stride(1), 1.0 / k_scale, 1.0 / v_scale, fp8_max)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """(n, num_kv_heads, head_dim): a sequence's first n cached tokens, in order (for references)."""
    page = cache.shape[1]
    blocks = block_table[: (n + page - 1) // page].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:n]


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale,
                               query_start_loc=None, sliding_window=None, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
    """Plain-torch reference in fp32 (rows of prefill sequences are left as zeros)."""
    B = block_tables.shape[0]
    n_heads, n_kv = q.shape[1], k_cache.shape[2]
    out = torch.zeros_like(q, dtype=torch.float32)
    for b in range(B):
        if query_start_loc is None:
            row = b
        else:
            row = int(query_start_loc[b])
            if int(query_start_loc[b + 1]) - row != 1:
                continue
        n = int(context_lens[b])
        if n == 0:
            continue
        k = gather_context(k_cache, block_tables[b], n).float().repeat_interleave(n_heads // n_kv, dim=1) * k_scale
        v = gather_context(v_cache, block_tables[b], n).float().repeat_interleave(n_heads // n_kv, dim=1) * v_scale
        s = torch.einsum("hd,nhd->hn", q[row].float(), k) * scale          # (H, n)
        if sliding_window:
            s[:, : max(0, n - sliding_window)] = float("-inf")
        out[row] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out.to(q.dtype)
