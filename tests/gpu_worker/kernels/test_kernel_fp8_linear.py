"""FP8 linear: weight quantization, the per-token quantization kernel and the dequantized maths."""
import torch

from gpu_worker.kernels.fp8_linear import (F8, F8_MAX, fp8_linear, fp8_linear_ref, quantize_per_token,
                                           quantize_per_token_ref, quantize_weight_fp8)


def test_weight_quantization_error_is_small(randn, rel_err):
    w = randn(48, 80)
    q = quantize_weight_fp8(w)
    assert q.weight.dtype == F8 and q.scale.shape == (48,)
    assert torch.allclose(q.weight.float().abs().amax(1), torch.full((48,), F8_MAX))   # each row spans the range
    assert rel_err(q.weight.float() * q.scale[:, None], w) < 0.05                       # e4m3: 3 mantissa bits


def test_per_token_kernel_matches_reference():
    """Rows on the e4m3 grid times a power of two (the interpreter's fp8 rounding is not trusted;
    the GPU bench checks rounding): scales exact, values exact; an all-zero row is safe."""
    M, K = 5, 5000                                          # K > one 4096-wide tile
    grid_vals = (torch.randn(M, K) * 100).to(F8).float()
    grid_vals[:, 7] = F8_MAX                                 # amax = 448 * 2^-3 -> scale exactly 2^-3
    x = grid_vals * 0.125
    x[3] = 0.0
    q, s = quantize_per_token(x)
    q_ref, s_ref = quantize_per_token_ref(x)
    assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())
    assert torch.isfinite(s).all() and torch.all(q[3].float() == 0)


def test_fp8_linear_fallback_matches_reference(randn, rel_err):
    x = (torch.randn(3, 7, 64) * 100).to(F8).float()       # on the e4m3 grid (see above)
    x[..., 0] = F8_MAX
    x = x * 0.0078125
    w, bias = randn(32, 64), randn(32)
    q = quantize_weight_fp8(w)
    y = fp8_linear(x, q, bias)
    assert y.shape == (3, 7, 32)
    assert rel_err(y, fp8_linear_ref(x, q, bias)) < 1e-3                    # fallback: same maths
    assert rel_err(y, x @ w.t() + bias) < 0.1                               # and close to the bf16 layer
