"""FP8 (e4m3) KV cache: the write saturates and scales, the attention kernels scale back."""
import torch

from gpu_worker.kernels.kv_cache_write import kv_cache_write, kv_cache_write_ref
from gpu_worker.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
from gpu_worker.kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from test_kernel_paged_decode import make_paged

F8 = torch.float8_e4m3fn


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


def test_fp8_cache_attention_matches_dequantized_reference(randn, rel_err):
    n_kv, group, d, page = 2, 4, 64, 16
    ctx = [40, 17]
    k_cache, v_cache, tables = make_paged(randn, ctx, n_kv, d, page)
    kc, vc = (k_cache * 8).to(F8), (v_cache * 8).to(F8)
    lens = torch.tensor(ctx, dtype=torch.int32)
    ks, vs = 0.125, 0.25
    q = randn(2, n_kv * group, d)
    for splits in (1, 2):
        out = paged_decode_attention(q, kc, vc, tables, lens, 0.125, max_context_len=40, num_splits=splits,
                                     k_scale=ks, v_scale=vs, block_n=16)
        ref = paged_decode_attention_ref(q, kc, vc, tables, lens, 0.125, k_scale=ks, v_scale=vs)
        assert rel_err(out, ref) < 1e-5
    qsl = torch.tensor([0, 9, 10], dtype=torch.int32)
    q = randn(10, n_kv * group, d)
    out = paged_prefill_attention(q, kc, vc, tables, lens, qsl, 0.125, max_query_len=9, k_scale=ks, v_scale=vs,
                                  block_m=16, block_n=16)
    ref = paged_prefill_attention_ref(q, kc, vc, tables, lens, qsl, 0.125, k_scale=ks, v_scale=vs)
    assert rel_err(out, ref) < 1e-5
