"""Rotary position embedding in Hugging Face's `rotate_half` convention (not interleaved pairs).

A head vector x of size D is split into halves x1 = x[:D/2], x2 = x[D/2:]; with angle
theta_i = position * inv_freq[i]:

    out[:D/2] = x1 * cos - x2 * sin
    out[D/2:] = x2 * cos + x1 * sin

cos/sin are precomputed in fp32 for every position up to the cache length, then cast to the
activation dtype at use (as HF does), so results match HF exactly in fp32 and closely in bf16.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from gpu_worker.model_config import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """(head_dim/2,) fp32 inverse frequencies, with HF's "linear" / "llama3" scaling."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by `factor`, blend in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None, max_positions: int):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.max_positions = max_positions
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)

    def build_cache(self, device: torch.device | str) -> None:
        """Fill the (P, 2, D/2) fp32 cos/sin table for every position the model supports (64 MiB
        for a 128k-context, head_dim 128 model); call once the module is on its device. A fixed
        table keeps forward free of host syncs, so it can be captured in a CUDA graph."""
        n = self.max_positions
        # inv_freq is computed on the CPU, as HF does, then moved.
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)  # (D/2,)
        pos = torch.arange(n, dtype=torch.int64, device=device).float()
        freqs = pos[:, None] * inv_freq[None, :]                # (P, D/2), same product HF forms
        self.cos_sin = torch.stack([freqs.cos(), freqs.sin()], dim=1)  # (P, 2, D/2)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions (T,); q (T, nh, D); k (T, nkv, D)
        cs = self.cos_sin[positions].to(q.dtype)                # (T, 2, D/2)
        cos, sin = cs[:, 0, None, :], cs[:, 1, None, :]         # (T, 1, D/2) each
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)                                  # (T, h, D/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # (T, h, D)
