"""Grouped GEMM: one matmul per group over consecutive row ranges, in one call.

    x (A, K), rows sorted by group; counts (G,): group g owns rows [off[g-1], off[g])
    weight (G, N, K)                  (nn.Linear layout per group)
    out[rows of g] = x[rows of g] @ weight[g].T     -> (A, N)

The MoE layer sorts its (token, expert) assignments by expert and runs every expert in one
pass. torch's grouped_mm does that in one kernel (CUDA bf16 on SM80+, and on the CPU); other
CUDA dtypes use the Triton kernel in grouped_gemm_triton.py; `grouped_linear_ref` loops over
groups (the reference both are tested against).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(A, K) sorted rows, (G, N, K) weights, (G,) row counts -> (A, N) in x's dtype."""
    assert x.dim() == 2 and weight.dim() == 3 and x.shape[1] == weight.shape[2], (x.shape, weight.shape)
    assert counts.shape == (weight.shape[0],), (counts.shape, weight.shape)
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[1])
    if _fast_path_ok(x, weight):
        offs = counts.cumsum(0).to(torch.int32)                     # (G,) end of each group
        return _grouped_mm(x, weight.transpose(1, 2), offs=offs)    # b: (G, K, N) column-major view
    if x.device.type == "cuda" and x.stride(1) == 1 and weight.stride(2) == 1:
        from gpu_worker.models.grouped_gemm_triton import grouped_gemm_triton   # lazy: needs triton
        return grouped_gemm_triton(x, weight, counts)
    return grouped_linear_ref(x, weight, counts)


def grouped_linear_ref(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(x.shape[0], weight.shape[1])                   # (A, N)
    start = 0
    for g, n in enumerate(counts.tolist()):
        if n:
            out[start:start + n] = x[start:start + n] @ weight[g].t()
        start += n
    return out


def _fast_path_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if _grouped_mm is None or x.dtype != weight.dtype:
        return False
    if x.device.type == "cpu":
        return True
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    # The CUDA kernel wants SM80+ and 16-byte aligned rows.
    return torch.cuda.get_device_capability(x.device)[0] >= 8 and x.shape[1] % 8 == 0 and weight.shape[1] % 8 == 0
