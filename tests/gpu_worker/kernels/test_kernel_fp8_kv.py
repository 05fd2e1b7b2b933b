"""FP8 (e4m3) KV cache: the write saturates and scales, the attention kernels scale back; the
decode kernel's fp8 upcast variants (bf16 / fp16 dots, the e4m3 -> fp16 bit trick)."""
import pytest
import torch

from gpu_worker.kernels.kv_cache_write import kv_cache_write, kv_cache_write_ref
from gpu_worker.kernels.paged_decode_attention import (e4m3_to_f16_bits_ref, fp8_upcast_probe, fp8_upcast_probe_ref,
                                                       paged_decode_attention, paged_decode_attention_ref)
from gpu_worker.kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from gpu_worker.tuning import DecodeAttentionTuning
from test_kernel_paged_decode import make_paged

F8 = torch.float8_e4m3fn
FP16_DOTS_TOL = 1e-3       # fp16 dots: p rounded to fp16 (2^-11 relative); observed ~5e-5


def test_fp8_kv_write_scales_and_saturates(randn):
    """Values on the e4m3 grid once scaled: the interpreter's fp32->fp8 rounding is not trustworthy
    (like its bf16), so the test checks scaling and saturation, not rounding (the GPU rounds)."""
    T, n_kv, d = 17, 2, 64
    k = (randn(T, n_kv, d, scale=4.0) * 2.0).to(F8).float() * 0.5      # k / 0.5 lands on the grid
    v = (randn(T, n_kv, d, scale=4.0) * 0.5).to(F8).float() * 2.0
    k[0, 0, 0] = 1e4                                            # beyond e4m3's 448 * scale: saturates
    kc, vc = torch.zeros(4, 16, n_kv, d, dtype=F8), torch.zeros(4, 16, n_kv, d, dtype=F8)
    kc2, vc2 = kc.clone(), vc.clone()
    slots = torch.randperm(64)[:T]
    kv_cache_write(k, v, kc, vc, slots, k_scale=0.5, v_scale=2.0)
    kv_cache_write_ref(k, v, kc2, vc2, slots, k_scale=0.5, v_scale=2.0)
    assert torch.equal(kc.float(), kc2.float()) and torch.equal(vc.float(), vc2.float())
    assert kc.float().abs().max() == 448.0


def test_e4m3_to_f16_bit_trick_is_exact_for_every_byte():
    """(b & 0x80) << 8 | (b & 0x7F) << 7 read as fp16 is the e4m3 value * 2^-8 for all 254 non-NaN
    bytes (zeros, subnormals, +-448 included); the NaN codes 0x7F/0xFF read as +-480 * 2^-8. The
    kernel's upcasts (through a probe kernel) give the same values bit for bit."""
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(F8)
    finite = ~torch.isnan(x.float())
    assert int(finite.sum()) == 254
    got = e4m3_to_f16_bits_ref(x)
    assert got.dtype == torch.float16
    assert torch.equal(got.float()[finite], x.float()[finite] * 2.0 ** -8)
    assert got.float()[~finite].tolist() == [480 / 256, -480 / 256]
    assert torch.equal(got[x.float() == 0].view(torch.int16), torch.tensor([0, -32768], dtype=torch.int16))  # +-0
    for name in ("bf16", "f16", "f16_bits", "f16_asm"):   # f16_asm runs as f16_bits in the interpreter
        assert torch.equal(fp8_upcast_probe(x, name)[finite], fp8_upcast_probe_ref(x, name)[finite]), name
    e5 = x.view(torch.float8_e5m2)                           # e5m2: the bit variants fall back to f16
    ok = torch.isfinite(e5.float()) & (e5.float().abs() >= 2.0 ** -14)   # normals: the interpreter
    # converts e5m2 subnormals to fp16 wrongly (on the GPU e5m2 -> fp16 is a byte shift)
    assert torch.equal(fp8_upcast_probe(e5, "f16_bits")[ok], e5.float()[ok])


@pytest.mark.parametrize("upcast,group,num_splits", [
    ("f16", 1, 3), ("f16", 8, 1), ("f16_bits", 1, 1), ("f16_bits", 4, 3), ("f16_bits", 8, 4)])
def test_fp8_decode_upcast_variants(randn, rel_err, upcast, group, num_splits):
    """fp16-dot variants vs the fp32 maths over the same fp8 values: contexts 1/17/257, scattered
    blocks with holes and a shared prefix, split and unsplit."""
    n_kv, d, page = 1, 64, 16
    ctx = [1, 17, 257]
    k_cache, v_cache, tables = make_paged(randn, ctx, n_kv, d, page, share_prefix=True)
    kc, vc = (k_cache * 8).to(F8), (v_cache * 8).to(F8)
    lens = torch.tensor(ctx, dtype=torch.int32)
    q = randn(3, n_kv * group, d)
    out = paged_decode_attention(q, kc, vc, tables, lens, d ** -0.5, max_context_len=257, num_splits=num_splits,
                                 k_scale=0.125, v_scale=0.25, block_n=32, fp8_upcast=upcast)
    ref = paged_decode_attention_ref(q, kc, vc, tables, lens, d ** -0.5, k_scale=0.125, v_scale=0.25)
    assert rel_err(out, ref) < FP16_DOTS_TOL


def test_fp8_upcast_name_is_checked():
    kc = torch.zeros(1, 16, 1, 64, dtype=F8)
    with pytest.raises(ValueError, match="fp8_upcast"):
        paged_decode_attention(torch.zeros(1, 1, 64), kc, kc, torch.zeros(1, 1, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32), 1.0, max_context_len=1, fp8_upcast="fp8")


def test_fp8_cache_attention_matches_dequantized_reference(randn, rel_err):
    n_kv, group, d, page = 2, 4, 64, 16
    ctx = [40, 17]
    k_cache, v_cache, tables = make_paged(randn, ctx, n_kv, d, page)
    kc, vc = (k_cache * 8).to(F8), (v_cache * 8).to(F8)
    lens = torch.tensor(ctx, dtype=torch.int32)
    ks, vs = 0.125, 0.25
    q = randn(2, n_kv * group, d)
    ref = paged_decode_attention_ref(q, kc, vc, tables, lens, 0.125, k_scale=ks, v_scale=vs)
    for splits in (1, 2):
        out = paged_decode_attention(q, kc, vc, tables, lens, 0.125, max_context_len=40, num_splits=splits,
                                     k_scale=ks, v_scale=vs, block_n=16, fp8_upcast="bf16")   # q's dtype: fp32 here
        assert rel_err(out, ref) < 1e-5
    # the tuning's default (whatever the fp8 sweep chose), with a sliding window and
    # query_start_loc rows
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    out = paged_decode_attention(q, kc, vc, tables, lens, 0.125, max_context_len=40, num_splits=2,
                                 k_scale=ks, v_scale=vs, block_n=16, query_start_loc=qsl, sliding_window=20)
    ref_w = paged_decode_attention_ref(q, kc, vc, tables, lens, 0.125, k_scale=ks, v_scale=vs, sliding_window=20)
    assert rel_err(out, ref_w) < (1e-5 if DecodeAttentionTuning().fp8_upcast == "bf16" else FP16_DOTS_TOL)
    qsl = torch.tensor([0, 9, 10], dtype=torch.int32)
    q = randn(10, n_kv * group, d)
    new = dict(k_new=randn(10, n_kv, d), v_new=randn(10, n_kv, d))     # this step's K/V: raw, unscaled
    out = paged_prefill_attention(q, kc, vc, tables, lens, qsl, 0.125, max_query_len=9, k_scale=ks, v_scale=vs,
                                  block_m=16, block_n=16, **new)
    ref = paged_prefill_attention_ref(q, kc, vc, tables, lens, qsl, 0.125, k_scale=ks, v_scale=vs, **new)
    assert rel_err(out, ref) < 1e-5
