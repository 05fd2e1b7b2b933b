"""TPRankRunner: one rank's ModelRunner (its shard of the weights and of the KV cache).

Every rank runs the same calls in the same order (the driver broadcasts each one), so the
collectives inside forward line up. It is the ordinary ModelRunner with the model swapped for
this rank's TPCausalLM: `self.config` holds the *local* shapes, so the KV cache holds this
rank's KV heads only; `vocab_size` reports the full vocabulary (logits are all-gathered).
"""
from __future__ import annotations

import torch

from gpu_worker.model_config import ModelConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.parallel.state import ParallelContext
from gpu_worker.parallel.tp_model import TPCausalLM, load_sharded_weights
from gpu_worker.tuning import KernelTuning


class TPRankRunner(ModelRunner):
    def __init__(self, config: ModelConfig, model_dir: str, ctx: ParallelContext,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 attention_backend: str = "torch", seed: int = 0, tuning: KernelTuning = KernelTuning()):
        self.ctx = ctx
        super().__init__(config, model_dir, device, dtype, attention_backend, seed, tuning=tuning)
        self.full_config = config
        self.config = self.model.cfg                 # local shapes: the KV cache holds this rank's heads

    def _new_model(self, config: ModelConfig, dtype: torch.dtype) -> TPCausalLM:
        return TPCausalLM(config, self.attention, dtype, self.ctx, self.tuning, self.kernels)

    def _load_weights(self, model_dir: str) -> None:
        load_sharded_weights(self.model, model_dir, progress=self.ctx.rank == 0)

    @property
    def vocab_size(self) -> int:
        return self.full_config.vocab_size

    def has_expert_parallel_layers(self) -> bool:
        return any(getattr(layer.mlp, "expert_parallel", False) for layer in self.model.model.layers)
