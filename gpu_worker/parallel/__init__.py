"""Tensor and expert parallelism inside one GPU worker.

One worker drives a group of `tensor_parallel_size` ranks, one per GPU: rank 0 lives in the
worker process (it owns the engine), ranks 1..N-1 are child processes (tp_worker.py) that
follow rank 0's broadcast commands. NCCL carries the model's collectives on GPUs, gloo on CPUs;
gloo always carries the small control messages.

    state.py          process-group setup (TCP store on loopback) and the collectives used
    tp_linear.py      column / row parallel linears and how checkpoint tensors shard over ranks
    vocab_parallel.py vocab-sharded embedding and lm_head (logits all-gathered)
    tp_model.py       builds one rank's shard of the decoder and loads its slice of the weights
    tp_runner.py      one rank's ModelRunner (its shard of weights and KV cache)
    tp_protocol.py    rank 0's commands to the followers, as int64 tensors
    tp_worker.py      the rank-0 driver (TPModelRunner) and the follower processes' loop
    tp_tiers.py       KV tiers over the ranks: rank 0's mirror and the followers' slots and files
    tp_tier_records.py  the tiers' operations as int64 records

Entry point for the engine: `create_model_runner(...)` below.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gpu_worker.tuning import KernelTuning

if TYPE_CHECKING:
    from gpu_worker.model_config import ModelConfig


def create_model_runner(config: ModelConfig, model_dir: str, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, attention_backend: str = "torch", seed: int = 0,
                        tensor_parallel_size: int = 1, enable_expert_parallel: bool = False,
                        quantization: str | None = None, kv_cache_dtype: torch.dtype | None = None,
                        tuning: KernelTuning = KernelTuning()):
    """A ModelRunner for tensor_parallel_size 1, else a TPModelRunner driving that many ranks
    (rank 0 in this process, one child process per further rank; call its close() at shutdown).
    enable_expert_parallel: MoE experts placed whole on ranks instead of each one split.
    quantization ("fp8", "fp8_lm_head") and an fp8 kv_cache_dtype are single-rank only for now.
    tuning: the kernels' choices (EngineConfig.tuning), on every rank."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
    if tensor_parallel_size == 1:
        from gpu_worker.model_runner import ModelRunner
        return ModelRunner(config, model_dir, device=device, dtype=dtype,
                           attention_backend=attention_backend, seed=seed, quantization=quantization,
                           kv_cache_dtype=kv_cache_dtype, tuning=tuning)
    if kv_cache_dtype is not None and kv_cache_dtype.itemsize == 1:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype} is not supported with tensor_parallel_size > 1 yet")
    if quantization is not None:
        raise ValueError(f"quantization={quantization!r} is not supported with tensor_parallel_size > 1 yet")
    from gpu_worker.parallel.tp_worker import TPModelRunner
    return TPModelRunner(config, model_dir, device=device, dtype=dtype, attention_backend=attention_backend,
                         seed=seed, tensor_parallel_size=tensor_parallel_size,
                         enable_expert_parallel=enable_expert_parallel, tuning=tuning)

