"""The tensors of `{"method": "mtp"}` beside the target's: the multi-token-prediction module's
weights (from the target's own checkpoint, gpu_worker/models/mtp_module.py), a one-layer paged
KV cache addressed by the target's block ids, and its forwards. The embedding and the lm_head
are the target's.

    block id b:  target layers' K/V at [b]  |  MTP layer's K/V at [b]
    one block table per sequence, one BlockManager: allocation, rollback, copy-on-write and the
    prefix cache account for both (each block costs the target's bytes plus one layer's)
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.loader import _copy, check_checkpoint
from gpu_worker.model_config import ModelLoadError
from gpu_worker.model_runner import copy_cache_blocks, make_attention_backend, pin_decode_splits
from gpu_worker.models.decoder import KVCache
from gpu_worker.models.moe import SparseMoE
from gpu_worker.models.mtp_module import SHARED_COPIES, MTPModule, mtp_prefix

log = logging.getLogger(__name__)


def _load(module: MTPModule, model_dir: str) -> None:
    """Copies the MTP layer's tensors; others of that layer (beyond DeepSeek's copies of the
    shared embedding and head) mean a layer this module cannot run: ModelLoadError naming one.
    A missing one (a dense layer's mlp.* where the family's rule makes the layer MoE, or the
    other way round) is check_checkpoint's ModelLoadError, naming it."""
    from safetensors import safe_open

    targets = module.hf_weight_targets()
    prefix = mtp_prefix(module.cfg)
    shards = check_checkpoint(model_dir, set(targets))
    unknown = []
    with torch.no_grad():
        for file, names in shards.items():
            mine = [n for n in names if n.startswith(prefix)]
            if not mine:
                continue
            with safe_open(str(Path(model_dir) / file), framework="pt", device="cpu") as f:
                for name in mine:
                    if name in targets:
                        _copy(targets[name], f.get_tensor(name), name)
                    elif not name.endswith(SHARED_COPIES):
                        unknown.append(name)
    if unknown:
        # e.g. DeepSeek-V3's shared experts or routing bias: a layer unlike the family's decoder layer
        mlp = "MoE" if isinstance(module.layer.mlp, SparseMoE) else "dense"
        raise ModelLoadError(f"{model_dir}: the multi-token-prediction layer holds {len(unknown)} tensor(s) "
                             f"kvmesh's MTP layer (a {module.cfg.family} decoder layer with a {mlp} MLP) "
                             f"does not use, e.g. {unknown[:3]}; method mtp cannot serve this checkpoint")


class MtpRunner:
    def __init__(self, target, model_dir: str) -> None:
        """`target`: the engine's ModelRunner (tensor parallel 1), weights loaded."""
        cfg = target.config
        if cfg.num_nextn_predict_layers < 1:
            raise ValueError(f"invalid speculative_config: method mtp needs a model with multi-token-prediction "
                             f"layers, and {model_dir!r} has none (config.json num_nextn_predict_layers is 0); "
                             "use ngram or draft_model, or `kvmesh make-model --mtp-layers 1`")
        self.target = target
        self.config = cfg
        self.device, self.kv_cache_dtype = target.device, target.kv_cache_dtype
        self.attention = make_attention_backend(target.attention.name, target.device, cfg, target.tuning)
        with torch.device("meta"):
            module = MTPModule(cfg, self.attention, target.dtype, target.tuning, target.kernels)
        self.module = module.to_empty(device=self.device).eval().requires_grad_(False)
        self.module.rope.cos_sin = target.model.rope.cos_sin          # one cos/sin table
        _load(self.module, model_dir)
        self.kv_caches: list[KVCache] = []
        if cfg.num_nextn_predict_layers > 1:
            log.info("%s has %d MTP layers; the first is chained for every draft", model_dir,
                     cfg.num_nextn_predict_layers)

    def block_size_bytes(self, block_size: int) -> int:
        """K and V of the one MTP layer for a block."""
        cfg = self.config
        return 2 * block_size * cfg.num_kv_heads * cfg.head_dim * self.kv_cache_dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        shape = (num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
        self.kv_caches = []
        self.kv_caches = [(torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
                           torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device))]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        if src:
            copy_cache_blocks(self.kv_caches, src, dst, self.device)

    def close(self) -> None:
        self.kv_caches = []
        self.module = None
        if self.device.type == "cuda":      # give the device memory back (as ModelRunner.close)
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """batch: MTP rows, row at position i holding input token t_{i+1}; hidden (T, H): h_i (the
        target's pre-norm stream, or the previous chained step's g). Writes the layer's K/V at
        the rows' slots. -> g (T, H)."""
        batch = self.target.prepare_inputs(batch)
        # the target's split-count classes, whose kernel variants its warmup compiled
        pin_decode_splits(self.attention, batch, self.config.num_kv_heads, self.device, self.target.tuning)
        embeds = self.target.model.model.embed_tokens(batch.input_ids)                 # (T, H)
        return self.module(embeds, hidden, batch.positions, self.kv_caches[0], batch)

    @torch.inference_mode()
    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """(S, H) -> (S, V) through the module's norm and the target's head (the model's dtype)."""
        return self.target.model.compute_logits_raw(self.module.head_norm(g))
