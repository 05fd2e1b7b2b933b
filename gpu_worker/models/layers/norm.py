"""RMSNorm, computed in fp32 and cast back before the weight, exactly as Hugging Face does."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None, kernels=None):
        super().__init__()
        self.kernels = kernels   # gpu_worker.models.layers.fused launchers (CUDA), or None: torch ops
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))  # (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim) -> (..., dim)
        if self.kernels is not None:
            return self.kernels.rmsnorm(x, self.weight, self.eps).out
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast before multiplying by the weight: HF's order, so bf16 results match too.
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual); residual None: (RMSNorm(x), x). (T, dim) each.
        One fused kernel on CUDA; the sum is rounded to x's dtype either way (HF's residual)."""
        if self.kernels is not None:
            return tuple(self.kernels.rmsnorm(x, self.weight, self.eps, residual))
        if residual is not None:
            x = x + residual
        return self(x), x
