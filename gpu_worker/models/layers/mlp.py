"""SwiGLU MLP with gate and up projections fused into one matmul."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)). gate_up_proj.weight = cat([gate_proj.weight, up_proj.weight])."""
    kernels = None   # gpu_worker.models.layers.fused launchers (CUDA), set by CausalLM

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # (T, hidden)
        gate_up = self.gate_up_proj(x)                      # (T, 2 * inter)
        if self.kernels is not None:
            return self.down_proj(self.kernels.swiglu(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)  # 2 x (T, inter)
        return self.down_proj(F.silu(gate) * up)            # (T, hidden)
