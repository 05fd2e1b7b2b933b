"""The Triton grouped GEMM against the loop reference, under TRITON_INTERPRET=1 on the CPU."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"   # before triton compiles anything (as tests/gpu_worker/kernels)

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from gpu_worker.models.grouped_gemm import grouped_linear_ref  # noqa: E402


@pytest.mark.parametrize("counts,n,k", [([3, 0, 20, 1], 40, 24), ([0, 0, 70], 16, 64), ([1] * 5, 130, 80),
                                        ([0, 0, 0], 8, 16), ([17, 33], 64, 100)])
def test_grouped_gemm_triton_matches_reference(counts, n, k):
    from gpu_worker.models.grouped_gemm_triton import grouped_gemm_triton
    g = torch.Generator().manual_seed(sum(counts) + n)
    # bf16-representable fp32 values, as the kernel tests do (bf16 maths is broken in the interpreter)
    x = torch.randn(sum(counts), k, generator=g).bfloat16().float()
    w = torch.randn(len(counts), n, k, generator=g).bfloat16().float()
    c = torch.tensor(counts)
    out = grouped_gemm_triton(x, w, c)
    assert out.shape == (sum(counts), n)
    assert torch.allclose(out, grouped_linear_ref(x, w, c), rtol=1e-4, atol=1e-3)
