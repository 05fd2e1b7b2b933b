"""DeepSeek-V3's multi-token-prediction (MTP) module, one depth of it:

    h_i     (T, H)  the target's residual stream at position i, before its final norm
    e_i     (T, H)  the target's embedding of token t_{i+1} (shared embed_tokens)
    x_i = eh_proj([enorm(e_i) ; hnorm(h_i)])           (T, 2H) -> (T, H)
    g_i = one decoder layer(x_i)                        its own paged KV, position i's RoPE
    logits = lm_head(shared_head.norm(g_i))             predicts t_{i+2} (the target's lm_head)

g_i (pre-norm) is also what the next chained step reads in place of h_i (vLLM's DeepSeek MTP
proposer, one module reused for every draft). The layer's MLP is the one the target's family
gives a decoder layer at index N (DeepSeek-V3's rule, which vLLM's deepseek_mtp.py follows: its
layer 61 is MoE): Mixtral's and Qwen3-MoE's (unless mlp_only_layers / decoder_sparse_step make N
dense) is the SparseMoE of models/moe.py, the same router and experts as the decoder's MoE layers
(cfg.mtp_moe_layers); the dense families' is a GatedMLP of the model's intermediate_size.

Checkpoint names, DeepSeek-V3's: the module is layer N = num_hidden_layers of the decoder,

    model.layers.{N}.enorm.weight  .hnorm.weight  .eh_proj.weight (H, 2H)
    model.layers.{N}.input_layernorm / self_attn.* / post_attention_layernorm / mlp.*  (a decoder layer;
        MoE: {block}.gate.weight and {block}.experts.{e}.{gate,up,down}.weight in the family's names,
        block_sparse_moe / w1 w3 w2 for Mixtral, mlp / gate_proj up_proj down_proj for Qwen3-MoE)
    model.layers.{N}.shared_head.norm.weight
    model.layers.{N}.embed_tokens.weight, .shared_head.head.weight   (DeepSeek's copies of the
        target's embedding and lm_head: accepted and not read, the target's own are used)
"""
from __future__ import annotations

import torch
from torch import nn

from gpu_worker.attention.base import AttentionBackend
from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.model_config import ModelConfig
from gpu_worker.models.decoder import DecoderLayer, KVCache, WeightTarget, layer_weight_targets
from gpu_worker.models.layers import RMSNorm, RotaryEmbedding
from gpu_worker.tuning import KernelTuning

# Tensors a DeepSeek-style MTP layer may carry that duplicate the target's (not loaded).
SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def mtp_prefix(cfg: ModelConfig, index: int = 0) -> str:
    return f"model.layers.{cfg.num_layers + index}."


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
                 tuning: KernelTuning = KernelTuning(), kernels=None):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = cfg
        # its own module (the target's would be re-materialized by this module's to_empty); its
        # cos/sin table is the target's tensor, set by the owner (MtpRunner)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.enorm = RMSNorm(h, eps, dtype, kernels)
        self.hnorm = RMSNorm(h, eps, dtype, kernels)
        self.eh_proj = nn.Linear(2 * h, h, bias=False, dtype=dtype)
        # layer_idx N, past the decoder's: its MLP is sparse iff N is in cfg.mtp_moe_layers
        self.layer = DecoderLayer(cfg, self.rope, backend, dtype, cfg.num_layers, tuning, kernels)
        self.head_norm = RMSNorm(h, eps, dtype, kernels)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                batch: ForwardBatch) -> torch.Tensor:
        """embeds (T, H) of t_{i+1}, hidden (T, H) = h_i -> g_i (T, H), before the head's norm."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))    # (T, H)
        x, residual = self.layer(x, None, positions, kv, batch, None)
        return x if residual is None else x + residual

    def hf_weight_targets(self) -> dict[str, WeightTarget]:
        p = mtp_prefix(self.cfg)
        targets = {p + "enorm.weight": WeightTarget(self.enorm.weight),
                   p + "hnorm.weight": WeightTarget(self.hnorm.weight),
                   p + "eh_proj.weight": WeightTarget(self.eh_proj.weight),
                   p + "shared_head.norm.weight": WeightTarget(self.head_norm.weight)}
        targets.update(layer_weight_targets(self.cfg, self.layer, p))
        return targets
