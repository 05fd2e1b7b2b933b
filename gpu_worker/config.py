"""EngineConfig: every knob of one engine, named as in vLLM so users need not relearn them.

Each field's comment is its `--help` text. `EngineConfig.from_kwargs` rejects unknown names;
`Engine` resolves the "auto"/None fields against the model and the device (see `resolved`).

`EngineConfig.tuning` (gpu_worker/tuning.py's KernelTuning) holds the kernel choices; its default
is built at construction by `tuning_from_env`, the one place that reads the KVMESH_* tuning
overrides (TUNING_ENV), so that benchmarks can A/B a serving stack without new flags.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Mapping

from gpu_worker.tuning import DecodeAttentionTuning, KernelTuning

_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16", "half", "float")
_DEVICES = ("auto", "cpu", "cuda")
_BACKENDS = ("auto", "torch", "triton")
_QUANTIZATIONS = (None, "fp8", "fp8_lm_head")
_KV_CACHE_DTYPES = ("auto", "fp8")
_KV_LOAD_POLICIES = ("auto", "always", "never")
_MAX_OFFLOAD_GB = 65536.0


def tuning_from_env(env: Mapping[str, str] | None = None) -> KernelTuning:
    """KernelTuning's defaults with the KVMESH_* overrides of `env` (default: os.environ)
    applied; a bad value raises a ValueError naming the variable. The names are declared in
    services/config.py's TUNING_ENV (so that a service started with them set accepts them)."""
    env = os.environ if env is None else env

    def number(name: str, default: int) -> int:
        value = env.get(name, str(default))
        if not value.isdigit():
            raise ValueError(f"{name}={value!r}: expected an integer >= 0")
        return int(value)

    def switch(name: str, default: bool, meaning: str) -> bool:
        value = env.get(name, "1" if default else "0")
        if value not in ("0", "1"):
            raise ValueError(f"{name}={value!r}: expected 0 or 1 ({meaning})")
        return value == "1"

    weights = env.get("KVMESH_DECODE_GEMV_WEIGHTS", "all")
    if weights not in ("fp8", "all"):
        raise ValueError(f"KVMESH_DECODE_GEMV_WEIGHTS={weights!r}: expected 'fp8' or 'all'")
    spec = env.get("KVMESH_DECODE_ATTENTION")
    try:
        attention = DecodeAttentionTuning() if spec is None else DecodeAttentionTuning.parse(spec)
    except ValueError as e:
        raise ValueError(f"KVMESH_DECODE_ATTENTION: {e}") from None
    return KernelTuning(
        decode_attention=attention,
        decode_gemv_max_m=number("KVMESH_DECODE_GEMV_MAX_M", 1),
        decode_gemv_weights=weights,
        decode_gemv_fuse=switch("KVMESH_DECODE_GEMV_FUSE", False, "1: norms and SwiGLU in the GEMVs' epilogues"),
        fp8_gemv_max_m=number("KVMESH_FP8_GEMV_MAX_M", 4),
        pdl=switch("KVMESH_PDL", True, "0: programmatic dependent launch off"),
    )


@dataclass(frozen=True)
class EngineConfig:
    model: str
    """Path of a Hugging Face model directory (config.json, *.safetensors, tokenizer files)."""
    max_num_seqs: int = 256
    """Most sequences (samples) in one step's batch."""
    max_num_batched_tokens: int = 2048
    """Most tokens (decode tokens + prefill chunks) in one step's batch."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output) in tokens; default: the model's
    max_position_embeddings, capped by the KV-cache capacity (and by max_num_batched_tokens when
    chunked prefill is off)."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes (same model, same cache_salt)."""
    enable_chunked_prefill: bool = True
    """Split long prompts into chunks that share steps with running decodes."""
    num_gpu_blocks: int | None = None
    """KV-cache blocks to allocate; default: profiled from free GPU memory, or a CPU budget."""
    gpu_memory_utilization: float = 0.9
    """This engine's share of the GPU's total memory (weights + activations + KV cache), vLLM's
    meaning: memory other processes or engines already hold is not charged, so two engines at
    0.45 share one GPU; asking for more than is free is an error."""
    dtype: str = "auto"
    """Weights/activations dtype: auto (the model's dtype on GPU, fp32 on CPU; fp32 models run
    in bf16 on GPU), float32, float16, bfloat16."""
    device: str = "auto"
    """cuda, cpu or auto (cuda when available)."""
    seed: int = 0
    """Engine seed: weights init of random layers and the seed of requests that give none."""
    attention_backend: str = "auto"
    """torch (reference, any device), triton (GPU), or auto (triton on GPU when available)."""
    max_n: int = 16
    """Largest n (samples per request) accepted."""
    model_id: str | None = None
    """Identity mixed into prefix-cache block hashes (default: the model directory's name)."""
    cpu_kv_cache_bytes: int = 1 << 30
    """CPU only, when num_gpu_blocks is not given: most bytes the KV cache may take."""
    enforce_eager: bool = False
    """Never use CUDA graphs (by default decode steps replay graphs captured at startup on CUDA
    with the triton attention backend)."""
    async_scheduling: bool = False
    """Schedule and launch step N+1 while step N runs on the GPU: its decode inputs are step N's
    sampled tokens, read on the device; step() then returns step N's deltas (one step late).
    Hides the host's per-step work behind the GPU's. Steps where a request uses penalties (they
    need the tokens on the host) run one at a time."""
    cuda_graph_max_bs: int = 1024
    """Largest decode batch captured in a CUDA graph (capped by max_num_seqs, so only engines
    allowed more than 512 sequences capture past vLLM's 512); larger decode batches run eagerly.
    At 1,024 sequences, graphs up to 1,024 rows made vLLM's ShareGPT-like run 2.2% faster than
    graphs up to 512 (on the H200), for ~3 s more capture."""
    prefill_graph_max_tokens: int = 1024
    """A step whose only sequence prefills at most this many tokens of its prompt (all of it, or
    the part after a cached prefix) replays a CUDA graph captured at startup (sizes every 32
    tokens; 0: none). Eager prefills that short are host-bound: this is the time to first token
    of a lone request, and of a chat's next turn."""
    piecewise_graph_max_tokens: int = 0
    """Steps of 5 to this many tokens (capped by max_num_batched_tokens) that no whole-step graph
    serves (prefill beside decodes, several prompts) replay the model between attentions from
    CUDA graphs captured at startup, attention itself running eagerly (sizes every 64 tokens;
    not with tensor parallelism or MoE layers). Launched eagerly, such a step costs ~18 ms of
    Python on the H200's host, more than its GPU time up to ~1,000 tokens. 0 (the default): none,
    since on the H200's concurrency-64 serving load they sped up host-bound steps of ~576
    tokens and changed nothing from 768 tokens up, where the GPU's work is the bound
    (BENCHMARKS.md; try 2048)."""
    tensor_parallel_size: int = 1
    """GPUs one worker shards the model over (attention heads, MLP, vocabulary; one all-reduce
    per sub-layer); ranks 1.. run as child processes of the worker. 1 = no parallelism."""
    enable_expert_parallel: bool = False
    """MoE models with tensor_parallel_size > 1: place whole experts on ranks (all-to-all token
    dispatch) instead of splitting every expert across all ranks."""
    quantization: str | None = None
    """Weight quantization: None (weights in `dtype`) or "fp8" (vLLM's dynamic FP8: the decoder
    layers' linear weights in e4m3 with one scale per output channel, activations quantized per
    token at run time; embeddings and lm_head stay in `dtype`, as in vLLM) or "fp8_lm_head" (the
    same plus the lm_head in e4m3: half of the head's 1 GB read per decode step of Llama-8B, at
    the cost of the logits' precision). Best on Hopper GPUs; elsewhere the same maths runs
    dequantized."""
    kv_cache_dtype: str = "auto"
    """KV-cache storage: auto (the model's dtype) or fp8 (float8_e4m3fn, one byte per element:
    twice the blocks of a 16-bit cache for the same memory). K and V are stored divided by a
    per-tensor scale of 1.0 (vLLM's default without calibration) and dequantized when read."""
    kv_offload_cpu_gb: float = 0.0
    """GiB of host memory (pinned on CUDA) for a KV tier below the device: cached blocks that the
    device's LRU evicts are copied there (asynchronously on CUDA) and loaded back when a prompt's
    prefix is found there (a multi-turn chat's history). 0: no host tier."""
    kv_offload_dir: str | None = None
    """Directory of a local-disk KV tier below the host tier (blocks the host tier evicts; without
    a host tier, blocks the device evicts). Created 0700, one 0600 file per block, each with a
    checksummed header; block files found there at start-up are deleted. None: no disk tier."""
    kv_offload_disk_gb: float = 0.0
    """Most GiB the disk tier's files take (with kv_offload_dir)."""
    kv_load_policy: str = "auto"
    """For a prompt whose prefix sits in a lower KV tier: auto (load or recompute, whichever is
    predicted faster from the tiers' measured bandwidth and the recent prefill rate, or load the
    first blocks and compute the rest), always (load), never (recompute)."""
    tuning: KernelTuning = field(default_factory=tuning_from_env)
    """Kernel choices (gpu_worker/tuning.py): decode-attention splits and tiles, the decode GEMV
    path, PDL. Default: the H200-measured defaults with the KVMESH_* overrides of the
    environment (tuning_from_env), read when the config is built."""

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"invalid engine argument {name}: {why}")

        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_n", "cuda_graph_max_bs",
                     "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise bad(name, f"must be at least 1, got {getattr(self, name)}")
        for name in ("prefill_graph_max_tokens", "piecewise_graph_max_tokens"):
            if getattr(self, name) < 0:
                raise bad(name, f"must be at least 0, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", f"must be at least 2, got {self.max_model_len}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise bad("num_gpu_blocks", f"must be at least 1, got {self.num_gpu_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in _DTYPES:
            raise bad("dtype", f"must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.device not in _DEVICES and not self.device.startswith("cuda:"):
            raise bad("device", f"must be one of {', '.join(_DEVICES)} or cuda:N, got {self.device!r}")
        if self.attention_backend not in _BACKENDS:
            raise bad("attention_backend", f"must be one of {', '.join(_BACKENDS)}, got {self.attention_backend!r}")
        if self.quantization not in _QUANTIZATIONS:
            raise bad("quantization", f"must be one of {', '.join(map(str, _QUANTIZATIONS))}, got {self.quantization!r}")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"must be one of {', '.join(_KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8" and self.tensor_parallel_size > 1:
            raise bad("kv_cache_dtype", "'fp8' is not supported with tensor_parallel_size > 1 yet; use 'auto'")
        if self.cpu_kv_cache_bytes < 1:
            raise bad("cpu_kv_cache_bytes", "must be positive")
        for name in ("kv_offload_cpu_gb", "kv_offload_disk_gb"):
            if not 0.0 <= getattr(self, name) <= _MAX_OFFLOAD_GB:
                raise bad(name, f"must be in [0, {_MAX_OFFLOAD_GB}], got {getattr(self, name)}")
        if self.kv_offload_dir is not None and not (isinstance(self.kv_offload_dir, str)
                                                   and 0 < len(self.kv_offload_dir) <= 4096):
            raise bad("kv_offload_dir", "must be a directory path of 1 to 4096 characters")
        if (self.kv_offload_dir is None) != (self.kv_offload_disk_gb == 0.0):
            raise bad("kv_offload_dir", "kv_offload_dir and kv_offload_disk_gb go together: give both or neither")
        if self.kv_load_policy not in _KV_LOAD_POLICIES:
            raise bad("kv_load_policy", f"must be one of {', '.join(_KV_LOAD_POLICIES)}, got {self.kv_load_policy!r}")
        if self.kv_offload_enabled and not self.enable_prefix_caching:
            raise bad("kv_offload_cpu_gb", "KV offload needs enable_prefix_caching (blocks are found by their hash)")
        if self.kv_offload_enabled and self.tensor_parallel_size > 1:
            raise bad("kv_offload_cpu_gb", "KV offload is not supported with tensor_parallel_size > 1 yet")
        if not isinstance(self.tuning, KernelTuning):
            raise bad("tuning", f"must be a gpu_worker.tuning.KernelTuning, got {type(self.tuning).__name__}")

    @property
    def kv_offload_enabled(self) -> bool:
        """True when the engine has a KV tier below the device (host memory or disk)."""
        return self.kv_offload_cpu_gb > 0 or self.kv_offload_dir is not None

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Like the constructor, but an unknown argument raises a TypeError that lists the valid ones."""
        unknown = sorted(set(kwargs) - set(cls.field_names()))
        if unknown:
            raise TypeError(
                f"unknown engine argument(s): {', '.join(unknown)}; "
                f"valid ones are: {', '.join(cls.field_names())}")
        return cls(**kwargs)
