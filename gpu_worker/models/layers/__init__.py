"""Small building blocks of the decoder: RMSNorm, rotary embedding, gated MLP."""
from gpu_worker.models.layers.mlp import GatedMLP
from gpu_worker.models.layers.norm import RMSNorm
from gpu_worker.models.layers.rope import RotaryEmbedding, rope_inv_freq

__all__ = ["GatedMLP", "RMSNorm", "RotaryEmbedding", "rope_inv_freq"]
