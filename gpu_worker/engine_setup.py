"""Resolves an EngineConfig's "auto"/None fields against the model and the machine, and loads
the model runner and its KV cache.

    device      auto -> cuda when available, else cpu
    dtype       auto -> fp32 on CPU; on GPU the checkpoint's dtype, fp32 checkpoints in bf16
    backend     auto -> triton on GPU when its backend module exists, else torch
    kv_cache_dtype  auto -> the dtype above; fp8 -> float8_e4m3fn (half the bytes per block)
    num_blocks  num_gpu_blocks, else profiled from GPU memory (one kvmesh engine of a GPU at a
                time: measuring_memory), else (CPU) enough for max_num_seqs full-length
                sequences within cpu_kv_cache_bytes
    max_model_len  the model's max_position_embeddings, capped by KV capacity (and by
                max_num_batched_tokens without chunked prefill); a larger explicit value errors
    weights_digest  the checkpoint's content digest (weights_digest.py), hashed beside the load;
                "" for a runner given in-process (tests), whose weights came from no files
    draft runner   speculative_config's draft_model: loaded beside the target before the KV
                cache is sized; each block then holds both models' K/V (same block ids);
                mtp: the model's own MTP layer (spec_decode/mtp_runner.py), its K/V likewise
    tuning      config.tuning; with speculation, without the fused RoPE decode kernel (runner_tuning)
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpu_worker.config import EngineConfig

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}   # None: the model's dtype


@dataclass(frozen=True)
class EngineSetup:
    model_config: Any
    runner: Any
    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    model_id: str
    num_blocks: int
    max_model_len: int
    draft_runner: Any = None     # speculative draft_model's runner, or mtp's MtpRunner; KV cache allocated
                                 # like the target's
    weights_digest: str = ""     # what KV tiers and P/D hand-offs check beyond the shape (kv_transfer/layout.py)


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"invalid engine argument device: {config.device!r} but no CUDA GPU is visible; use device='cpu'")
    return torch.device(config.device)


def measuring_memory(config: EngineConfig, runner: Any = None) -> contextlib.AbstractContextManager:
    """For an engine that sizes its KV cache by measuring a CUDA device: that device's lock
    (device_memory_lock.py), held by Engine from its weights' load to its CUDA graphs; else nothing."""
    if runner is not None or config.num_gpu_blocks is not None:
        return contextlib.nullcontext()
    device = resolve_device(config)
    if device.type != "cuda":
        return contextlib.nullcontext()
    from gpu_worker.device_memory_lock import measuring_device
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = "".join(c for c in str(torch.cuda.get_device_properties(index).uuid) if c.isalnum() or c == "-")
    return measuring_device(uuid or f"index{index}")


def resolve_dtype(config: EngineConfig, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    if device.type == "cpu":
        return torch.float32
    dtype = _DTYPES.get(str(checkpoint_dtype).replace("torch.", ""), torch.bfloat16)
    return torch.bfloat16 if dtype == torch.float32 else dtype


def resolve_backend(config: EngineConfig, device: torch.device) -> str:
    if config.attention_backend != "auto":
        if config.attention_backend == "triton" and device.type != "cuda":
            raise ValueError("invalid engine argument attention_backend: 'triton' needs a CUDA device; use 'torch'")
        return config.attention_backend
    if device.type == "cuda" and importlib.util.find_spec("gpu_worker.attention.triton_backend"):
        return "triton"
    return "torch"


def resolve_setup(config: EngineConfig, *, runner: Any = None, model_config: Any = None) -> EngineSetup:
    device = resolve_device(config)
    weights_digest = ""
    if runner is None:
        from gpu_worker.model_config import ModelConfig
        from gpu_worker.weights_digest import DigestJob
        model_config = ModelConfig.from_dir(config.model)
        dtype = resolve_dtype(config, device, model_config.torch_dtype)
        backend = resolve_backend(config, device)
        digest = DigestJob(config.model)      # beside the load, over the same files
        try:
            runner = _load_runner(config, model_config, device, dtype, backend)
        except BaseException:
            digest.cancel()
            raise
        weights_digest = digest.result()
        log.info("weights of %s: digest %s", config.model, weights_digest)
    else:
        assert model_config is not None, "a given runner needs its model_config"
        dtype = resolve_dtype(config, device, getattr(model_config, "torch_dtype", "float32"))
        backend = resolve_backend(config, device)
    model_id = config.model_id or Path(config.model).resolve().name or str(config.model)

    model_max = int(model_config.max_position_embeddings)
    wanted_len = config.max_model_len or model_max
    if wanted_len > model_max:
        raise ValueError(f"invalid engine argument max_model_len: {wanted_len} exceeds the model's "
                         f"max_position_embeddings ({model_max})")
    if not config.enable_chunked_prefill:
        wanted_len = _cap(config, wanted_len, config.max_num_batched_tokens,
                          "max_num_batched_tokens (chunked prefill is off, so a prompt must fit in one step)")
    draft = _load_draft(config, model_config, runner, device, dtype, backend, wanted_len)
    num_blocks = _num_blocks(config, runner, device, wanted_len, draft)
    max_model_len = _cap(config, wanted_len, num_blocks * config.block_size,
                         f"the KV cache capacity ({num_blocks} blocks x {config.block_size} tokens)")
    runner.allocate_kv_cache(num_blocks, config.block_size)
    if draft is not None:
        draft.allocate_kv_cache(num_blocks, config.block_size)
    return EngineSetup(model_config, runner, device, dtype, backend, model_id, num_blocks, max_model_len, draft,
                       weights_digest)


def runner_tuning(config: EngineConfig) -> Any:
    """The kernel tuning the runners get: config.tuning, with fuse_rope_decode off when the engine
    speculates. Verification steps run as decode rows, several of one sequence in one step
    (batch_builder.build_decode_rows), and the fused kernel writes each row's K/V inside the
    attention launch, where a later row of the same sequence may read that slot before it is
    written; unfused, every row's K/V is written by the kernel before attention."""
    if config.speculative is None:
        return config.tuning
    return dataclasses.replace(config.tuning, fuse_rope_decode=False)


def _load_runner(config: EngineConfig, model_config: Any, device: torch.device, dtype: torch.dtype,
                 backend: str) -> Any:
    from gpu_worker.parallel import create_model_runner
    return create_model_runner(model_config, config.model, device=str(device), dtype=dtype,
                               attention_backend=backend, seed=config.seed,
                               quantization=config.quantization,
                               kv_cache_dtype=_KV_CACHE_DTYPES[config.kv_cache_dtype],
                               tensor_parallel_size=config.tensor_parallel_size,
                               enable_expert_parallel=config.enable_expert_parallel,
                               tuning=runner_tuning(config))


def _load_draft(config: EngineConfig, model_config: Any, runner: Any, device: torch.device, dtype: torch.dtype,
                backend: str, max_model_len: int) -> Any:
    """The draft model's runner, or the MTP layer's, when speculative_config asks for one, else None."""
    spec = config.speculative
    if spec is not None and spec.method == "mtp":
        from gpu_worker.spec_decode.mtp_runner import MtpRunner
        return MtpRunner(runner, config.model)
    if spec is None or spec.method != "draft_model":
        return None
    from gpu_worker.spec_decode.draft_model import load_draft_runner
    return load_draft_runner(spec.model, model_config, config.model, device=device, dtype=dtype,
                             attention_backend=backend, kv_cache_dtype=_KV_CACHE_DTYPES[config.kv_cache_dtype],
                             seed=config.seed, tuning=runner_tuning(config), max_model_len=max_model_len)


def _cap(config: EngineConfig, length: int, limit: int, what: str) -> int:
    if length <= limit:
        return length
    if config.max_model_len is not None:
        raise ValueError(f"invalid engine argument max_model_len: {length} does not fit {what}; "
                         f"lower max_model_len or raise the limit")
    log.info("max_model_len capped to %d by %s", limit, what)
    return limit


def _num_blocks(config: EngineConfig, runner: Any, device: torch.device, max_len: int, draft: Any) -> int:
    if config.num_gpu_blocks is not None:
        return config.num_gpu_blocks
    target_bytes = int(runner.block_size_bytes(config.block_size))
    block_bytes = target_bytes + (int(draft.block_size_bytes(config.block_size)) if draft is not None else 0)
    if device.type == "cuda":
        # size the profiling forward like the largest step the engine will run, and its draw
        # like the largest batch of sequences; the draft's (MTP layer's) weights are loaded, so
        # they are counted
        blocks = int(runner.profile_num_blocks(config.block_size, config.gpu_memory_utilization,
                                               config.max_num_batched_tokens, config.max_num_seqs))
        return max(1, blocks * target_bytes // block_bytes)    # a block holds both models' K/V
    per_seq = -(-max_len // config.block_size)
    budget = max(1, config.cpu_kv_cache_bytes // max(1, block_bytes))
    return max(1, min(config.max_num_seqs * per_seq, budget))
