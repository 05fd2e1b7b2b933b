"""SwiGLU MLP with gate and up projections fused into one matmul."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)). gate_up_proj.weight = cat([gate_proj.weight, up_proj.weight])."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype | None = None, kernels=None):
        super().__init__()
        self.kernels = kernels   # gpu_worker.models.layers.fused launchers (CUDA), or None: torch ops
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # (T, hidden)
        return self.down_proj(self.activation(x))           # (T, hidden)

    def activation(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, inter), down_proj's input
        gate_up = self.gate_up_proj(x)                      # (T, 2 * inter)
        if self.kernels is not None:
            return self.kernels.swiglu(gate_up)
        gate, up = gate_up.split(self.intermediate, dim=-1)  # 2 x (T, inter)
        return F.silu(gate) * up
