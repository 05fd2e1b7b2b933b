"""One tensor-parallel rank's shard of the decoder, and loading its slice of the checkpoint.

The shard is the ordinary CausalLM built from a *local* ModelConfig (heads, KV heads,
intermediate size and vocabulary divided by N), so attention, RoPE and the KV cache need no
change; then the layers that talk are swapped for their parallel twins:

    embed_tokens -> VocabParallelEmbedding        (all-reduce)
    MoE mlp      -> SparseMoE with the context     (experts split by expert: all-to-all;
                                                    or by intermediate: all-reduce)
    qkv_proj     -> ColumnParallelLinear           rows: this rank's q heads | kv heads | kv heads
    o_proj       -> RowParallelLinear              (all-reduce)
    gate_up_proj -> ColumnParallelLinear           rows: gate[r-th block] | up[r-th block]
    down_proj    -> RowParallelLinear              (all-reduce)
    lm_head      -> vocab-parallel logits          (all-gather)

`hf_shard(name)` says which slice of each full checkpoint tensor this rank reads; the row
ranges of fused parameters come from the decoder's own `hf_weight_targets` on the local shapes.
"""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import torch

from gpu_worker.attention.base import AttentionBackend
from gpu_worker.loader import copy_checkpoint, nextn_prefixes
from gpu_worker.model_config import ModelConfig, ModelLoadError
from gpu_worker.models.decoder import CausalLM
from gpu_worker.models.moe import EXPERT_NAMES, SparseMoE
from gpu_worker.parallel.state import ParallelContext
from gpu_worker.tuning import KernelTuning
from gpu_worker.parallel.tp_linear import (ColumnParallelLinear, RowParallelLinear, Shard, even_shard,
                                           head_shard, kv_head_shard, kv_heads_per_rank)
from gpu_worker.parallel.vocab_parallel import (VocabParallelEmbedding, padded_vocab_per_rank,
                                                vocab_parallel_logits, vocab_shard)

_LAYER = re.compile(r"^model\.layers\.\d+\.(.+)$")


def local_config(cfg: ModelConfig, ctx: ParallelContext) -> ModelConfig:
    """The shapes one rank holds."""
    n = ctx.world_size
    if cfg.num_heads % n:
        raise ValueError(f"num_attention_heads ({cfg.num_heads}) must be divisible by "
                         f"tensor_parallel_size ({n})")
    if cfg.intermediate_size % n:
        raise ValueError(f"intermediate_size ({cfg.intermediate_size}) must be divisible by "
                         f"tensor_parallel_size ({n})")
    changes = dict(num_heads=cfg.num_heads // n, num_kv_heads=kv_heads_per_rank(cfg.num_kv_heads, n),
                   intermediate_size=cfg.intermediate_size // n,
                   vocab_size=padded_vocab_per_rank(cfg.vocab_size, n))
    if getattr(cfg, "num_experts", 0):
        what, total = (("num_experts", cfg.num_experts) if ctx.expert_parallel
                       else ("moe_intermediate_size", cfg.moe_intermediate_size))
        if total % n:
            raise ValueError(f"{what} ({total}) must be divisible by tensor_parallel_size ({n})"
                             + ("" if ctx.expert_parallel else "; or enable expert parallelism"))
    return replace(cfg, **changes)


class TPCausalLM(CausalLM):
    """One rank's shard. `cfg` holds the local shapes, `full_cfg` the model's."""

    def __init__(self, full_cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
                 ctx: ParallelContext, tuning: KernelTuning = KernelTuning(), kernels=None):
        super().__init__(local_config(full_cfg, ctx), backend, dtype, tuning, kernels)
        self.full_cfg, self.ctx = full_cfg, ctx
        cfg, hidden = self.cfg, full_cfg.hidden_size
        self.model.embed_tokens = VocabParallelEmbedding(full_cfg.vocab_size, hidden, ctx, dtype)
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.qkv_proj = ColumnParallelLinear(hidden, cfg.q_size + 2 * cfg.kv_size, cfg.qkv_bias, ctx, dtype)
            attn.o_proj = RowParallelLinear(cfg.q_size, hidden, cfg.o_proj_bias, ctx, dtype)
            if isinstance(layer.mlp, SparseMoE):     # experts sharded by expert or by intermediate
                layer.mlp = SparseMoE(hidden, full_cfg.moe_intermediate_size, full_cfg.num_experts,
                                      full_cfg.num_experts_per_tok, full_cfg.norm_topk_prob, dtype, ctx)
            else:
                inter = layer.mlp.intermediate
                layer.mlp.gate_up_proj = ColumnParallelLinear(hidden, 2 * inter, False, ctx, dtype)
                layer.mlp.down_proj = RowParallelLinear(inter, hidden, False, ctx, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, H) -> (S, V) float32, identical on every rank."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return vocab_parallel_logits(hidden, weight, self.full_cfg.vocab_size, self.ctx)

    def hf_shard(self, name: str) -> Shard | None:
        """Which slice of the full checkpoint tensor `name` this rank loads (None: all of it)."""
        cfg, ctx = self.full_cfg, self.ctx
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return vocab_shard(cfg.vocab_size, ctx)
        m = _LAYER.match(name)
        if m is None:
            return None
        part = m.group(1)
        if part in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
            return head_shard(cfg.num_heads, cfg.head_dim, ctx)
        if part.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
            return kv_head_shard(cfg.num_kv_heads, cfg.head_dim, ctx)
        if part == "self_attn.o_proj.weight":
            return head_shard(cfg.num_heads, cfg.head_dim, ctx, dim=1)
        if part in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            return even_shard(cfg.intermediate_size, ctx, 0, "intermediate_size")
        if part == "mlp.down_proj.weight":
            return even_shard(cfg.intermediate_size, ctx, 1, "intermediate_size")
        layer = self.model.layers[int(name.split(".")[2])]
        if isinstance(layer.mlp, SparseMoE):
            expert = layer.mlp.hf_expert_slice(part, EXPERT_NAMES[cfg.family])
            return Shard(*expert) if expert is not None else None
        return None

    def hf_skipped_names(self) -> set[str]:
        """Checkpoint tensors this rank does not load: other ranks' experts."""
        skipped: set[str] = set()
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, SparseMoE):
                skipped |= layer.mlp.hf_other_experts(f"model.layers.{i}.", EXPERT_NAMES[self.full_cfg.family])
        return skipped


def load_sharded_weights(model: TPCausalLM, model_dir: str | Path, progress: bool = True) -> None:
    """Read this rank's slice of every checkpoint tensor (safetensors slices: only those bytes)."""
    def copy(f, name: str, target) -> int:
        return _copy_slice(target, f.get_slice(name), model.hf_shard(name), name)
    copy_checkpoint(model_dir, model.hf_weight_targets(), copy, progress=progress,
                    desc=f"loading weights (rank {model.ctx.rank})", skipped=model.hf_skipped_names(),
                    ignored_prefixes=nextn_prefixes(model.full_cfg))


def _copy_slice(target, lazy, shard: Shard | None, name: str) -> int:
    """Copies this rank's slice of one tensor; returns the bytes read."""
    shape = lazy.get_shape()
    index = [slice(None)] * len(shape)
    if shard is not None:
        index[shard.dim] = slice(shard.start, shard.stop)
    tensor = lazy[tuple(index)]
    dst = target.param if target.start is None else target.param[target.start:target.stop]
    if shard is not None and shard.dim == 0 and tensor.shape[0] < dst.shape[0] and name.endswith(
            ("embed_tokens.weight", "lm_head.weight")):
        dst[tensor.shape[0]:].zero_()          # vocabulary padding rows of the last rank
        dst = dst[:tensor.shape[0]]
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"tensor {name} slice has shape {tuple(tensor.shape)}, this rank expects "
                             f"{tuple(dst.shape)}")
    dst.copy_(tensor.to(device=dst.device, dtype=dst.dtype))
    return tensor.numel() * tensor.element_size()
