"""KV write, RMSNorm, RoPE and SwiGLU vs their torch references on awkward sizes."""
import pytest
import torch

from gpu_worker.kernels.kv_cache_write import kv_cache_write, kv_cache_write_ref
from gpu_worker.kernels.rmsnorm import rmsnorm, rmsnorm_ref
from gpu_worker.kernels.rope import build_cos_sin_cache, rope_, rope_inv_freq, rope_ref
from gpu_worker.kernels.swiglu import swiglu, swiglu_ref


@pytest.mark.parametrize("T,n_kv,head_dim", [(1, 1, 64), (17, 2, 128), (257, 8, 64)])
def test_kv_cache_write(randn, T, n_kv, head_dim):
    page, n_blocks = 16, (T + 15) // 16 + 4
    k, v = randn(T, n_kv, head_dim), randn(T, n_kv, head_dim)
    slots = torch.randperm(n_blocks * page)[:T].long()
    slots[T // 2] = -1                                         # a padding row: never written
    kc, vc = randn(n_blocks, page, n_kv, head_dim), randn(n_blocks, page, n_kv, head_dim)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kv_cache_write(k, v, kc, vc, slots)
    kv_cache_write_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_kv_cache_write_strided_views(randn):
    """k and v as views of a fused qkv projection output (row stride > heads * head_dim)."""
    T, n_q, n_kv, d = 17, 4, 2, 64
    qkv = randn(T, (n_q + 2 * n_kv) * d)
    k = qkv[:, n_q * d:(n_q + n_kv) * d].view(T, n_kv, d)
    v = qkv[:, (n_q + n_kv) * d:].view(T, n_kv, d)
    kc, vc = torch.zeros(4, 8, n_kv, d), torch.zeros(4, 8, n_kv, d)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    slots = torch.arange(T).long() + 5
    kv_cache_write(k, v, kc, vc, slots)
    kv_cache_write_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@pytest.mark.parametrize("T,hidden", [(1, 64), (17, 96), (257, 128)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm(randn, rel_err, T, hidden, with_residual):
    x, w = randn(T, hidden), randn(hidden)
    res = randn(T, hidden) if with_residual else None
    out, new_res = rmsnorm(x, w, 1e-5, res)
    ref_out, ref_res = rmsnorm_ref(x, w, 1e-5, res)
    assert rel_err(out, ref_out) < 1e-6
    assert torch.equal(new_res, ref_res)


def test_rmsnorm_per_head_on_a_strided_view(randn, rel_err):
    """Qwen3's q/k norms: (T, heads, head_dim) views of a fused projection."""
    T, n, d = 5, 3, 64
    qkv = randn(T, 2 * n * d)
    q = qkv[:, : n * d].view(T, n, d)
    w = randn(d)
    out, _ = rmsnorm(q, w, 1e-6)
    assert out.shape == (T, n, d) and rel_err(out, rmsnorm_ref(q, w, 1e-6).out) < 1e-6


def test_rope_accepts_the_models_stacked_cache(randn):
    inv = rope_inv_freq(64, 10000.0)
    flat = build_cos_sin_cache(inv, 128)
    stacked = torch.stack([flat[:, :32], flat[:, 32:]], dim=1)          # (P, 2, half), the model's layout
    pos = torch.tensor([0, 5, 127])
    q1, k1 = randn(3, 2, 64), randn(3, 1, 64)
    q2, k2 = q1.clone(), k1.clone()
    rope_(pos, q1, k1, flat)
    rope_(pos, q2, k2, stacked)
    assert torch.equal(q1, q2) and torch.equal(k1, k2)


@pytest.mark.parametrize("T,n_q,n_kv,head_dim", [(1, 4, 1, 64), (17, 8, 2, 128), (257, 4, 4, 64)])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope(randn, rel_err, T, n_q, n_kv, head_dim, scaling):
    cache = build_cos_sin_cache(rope_inv_freq(head_dim, 10000.0, scaling), 4096)
    positions = torch.randint(0, 4096, (T,))
    qkv = randn(T, (n_q + 2 * n_kv) * head_dim)                # q, k as strided views of a fused qkv
    q = qkv[:, : n_q * head_dim].view(T, n_q, head_dim)
    k = qkv[:, n_q * head_dim:(n_q + n_kv) * head_dim].view(T, n_kv, head_dim)
    q_ref, k_ref = rope_ref(positions, q, k, cache)
    v_before = qkv[:, (n_q + n_kv) * head_dim:].clone()
    rope_(positions, q, k, cache)
    assert rel_err(q, q_ref) < 1e-6 and rel_err(k, k_ref) < 1e-6
    assert torch.equal(qkv[:, (n_q + n_kv) * head_dim:], v_before)


def test_llama3_inv_freq_matches_transformers():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, rope_scaling=scaling,
                      max_position_embeddings=131072)
    try:
        hf, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    except Exception as exc:   # the helper's signature moves between transformers versions
        pytest.skip(f"transformers' llama3 rope init not callable here: {exc}")
    ours = rope_inv_freq(128, 500000.0, scaling)
    assert torch.allclose(ours, hf.float(), rtol=1e-5)


@pytest.mark.parametrize("T,inter", [(1, 64), (17, 1100), (257, 96)])
def test_swiglu(randn, rel_err, T, inter):
    x = randn(T, 2 * inter, scale=3.0)
    assert rel_err(swiglu(x), swiglu_ref(x)) < 1e-6


@pytest.mark.parametrize("T,n_q,n_kv,head_dim", [(1, 4, 1, 64), (17, 8, 2, 128), (257, 4, 4, 64)])
def test_rope_kv_write_equals_rope_then_write(randn, T, n_q, n_kv, head_dim):
    from gpu_worker.kernels.rope_kv_write import rope_kv_write, rope_kv_write_ref
    cache = build_cos_sin_cache(rope_inv_freq(head_dim, 10000.0), 2048)
    positions = torch.randint(0, 2048, (T,))
    qkv = randn(T, (n_q + 2 * n_kv) * head_dim)
    page, n_blocks = 16, T // 16 + 3
    kc, vc = randn(n_blocks, page, n_kv, head_dim), randn(n_blocks, page, n_kv, head_dim)
    slots = torch.randperm(n_blocks * page)[:T]
    slots[T // 2] = -1

    def views(x):
        return (x[:, : n_q * head_dim].view(T, n_q, head_dim),
                x[:, n_q * head_dim:(n_q + n_kv) * head_dim].view(T, n_kv, head_dim),
                x[:, (n_q + n_kv) * head_dim:].view(T, n_kv, head_dim))

    qkv2, kc2, vc2 = qkv.clone(), kc.clone(), vc.clone()
    rope_kv_write(positions, *views(qkv), cache, kc, vc, slots)
    rope_kv_write_ref(positions, *views(qkv2), cache, kc2, vc2, slots)
    assert torch.allclose(qkv, qkv2, rtol=1e-6, atol=1e-6)
    assert torch.allclose(kc, kc2, rtol=1e-6, atol=1e-6) and torch.equal(vc, vc2)
