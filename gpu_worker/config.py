"""EngineConfig: every knob of one engine, named as in vLLM so users need not relearn them.

The fields, their help, bounds and offline defaults are services/engine_args.py's EngineArgs,
the one list every entry point (LLM, kvmesh generate / worker / serve, Helm) is generated from.
`EngineConfig.from_kwargs` rejects unknown names; `Engine` resolves the "auto"/None fields
against the model and the device.

`EngineConfig.tuning` (gpu_worker/tuning.py's KernelTuning) holds the kernel choices; its default
is built at construction by `tuning_from_env`, the one place that reads the KVMESH_* tuning
overrides (TUNING_ENV), so that benchmarks can A/B a serving stack without new flags.

`EngineConfig.kv_offload_shared_key` is the MAC key of the shared KV tier's files: a secret, so no
flag (argv is readable by every local user) and no repr; a worker derives it from its trust
directory.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Mapping

from gpu_worker.tuning import DecodeAttentionTuning, KernelTuning
from services.engine_args import EngineArgs
from services.options import is_unset, out_of_bounds
from services.speculative import SpeculativeConfig, parse_speculative_config


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
class EngineConfig(EngineArgs):
    """One engine's configuration: services/engine_args.py's EngineArgs (every flag-settable
    field, with its help and bounds, and the offline defaults) plus the kernel tuning."""

    tuning: KernelTuning = field(default_factory=tuning_from_env)
    """Kernel choices (gpu_worker/tuning.py): decode-attention splits and tiles, the decode GEMV
    path, PDL. No flag: the H200-measured defaults with the KVMESH_* overrides of the environment
    (tuning_from_env), read when the config is built."""

    kv_offload_shared_key: bytes | None = field(default=None, repr=False)
    """The shared KV tier's MAC key (32 to 64 bytes; gpu_worker/kv_tiers/shared_file.py), required
    with kv_offload_shared_dir: every engine that shares the directory must hold it, and nothing
    else may. A worker derives it from its trust directory's worker secret
    (services/security/bundle.shared_kv_key); offline, pass secrets.token_bytes(32) kept as
    privately as the directory. No flag: argv is readable by every local user."""

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"invalid engine argument {name}: {why}")

        if not self.model:
            raise bad("model", "give the model directory")
        spec = self.speculative_config
        if isinstance(spec, Mapping):
            # vLLM's LLM(speculative_config={...}) passes the object; the field holds its JSON, as
            # a flag or a variable gives it (and as a worker's flag carries it)
            object.__setattr__(self, "speculative_config", json.dumps(dict(spec), default=str))  # a Path model
        elif spec is not None and not isinstance(spec, str):
            raise bad("speculative_config", f"must be a JSON object (a dict, or its text), got {type(spec).__name__}")
        for f in dataclasses.fields(EngineArgs):
            value = getattr(self, f.name)
            if is_unset(value, f.metadata):        # 0 / "": the served configs' "not set"
                object.__setattr__(self, f.name, None)
                continue
            why = out_of_bounds(value, f.metadata)
            if why:
                raise bad(f.name, f"{why}, got {value!r}")
        if self.kv_cache_dtype == "fp8" and self.tensor_parallel_size > 1:
            raise bad("kv_cache_dtype", "'fp8' is not supported with tensor_parallel_size > 1 yet; use 'auto'")
        if (self.kv_offload_dir is None) != (self.kv_offload_disk_gb == 0.0):
            raise bad("kv_offload_dir", "kv_offload_dir and kv_offload_disk_gb go together: give both or neither")
        if (self.kv_offload_shared_dir is None) != (self.kv_offload_shared_gb == 0.0):
            raise bad("kv_offload_shared_dir", "kv_offload_shared_dir and kv_offload_shared_gb go together: give "
                                               "both or neither")
        if self.kv_offload_shared_dir is not None and self.kv_offload_dir is not None:
            # the shared tier's bound deletes the oldest block files in its directory's
            # subdirectories (kvmesh serve's <dir>/worker-N among them), and the disk tier's
            # directory is one engine's alone: they must not meet
            shared, private = (os.path.realpath(p) for p in (self.kv_offload_shared_dir, self.kv_offload_dir))
            if os.path.commonpath([shared, private]) in (shared, private):
                raise bad("kv_offload_shared_dir", f"{self.kv_offload_shared_dir!r} and kv_offload_dir "
                                                   f"{self.kv_offload_dir!r} overlap; give the shared and the "
                                                   "private disk tier separate directories, neither inside the "
                                                   "other")
        if self.kv_offload_shared_dir is not None:
            if self.kv_offload_shared_key is None:
                raise bad("kv_offload_shared_dir", "the shared tier needs kv_offload_shared_key, the key that "
                                                   "authenticates its files (other processes may write that "
                                                   "directory): kvmesh worker and serve derive it from the "
                                                   "trust directory, LLM(...) takes it, kvmesh generate has none")
            key = self.kv_offload_shared_key
            # shared_file.check_key's bounds, not imported: this module stays free of torch
            if not isinstance(key, bytes) or not 32 <= len(key) <= 64:
                raise bad("kv_offload_shared_key", "must be 32 to 64 bytes")
        if self.kv_offload_enabled and not self.enable_prefix_caching:
            raise bad("kv_offload_cpu_gb", "KV offload needs enable_prefix_caching (blocks are found by their hash)")
        try:
            spec = self.speculative
        except ValueError as e:                    # names the bad key
            raise bad("speculative_config", str(e).removeprefix("invalid speculative_config: ")) from None
        if spec is not None and spec.method in ("draft_model", "mtp") and self.tensor_parallel_size > 1:
            # the draft's / MTP layer's weights (an MoE MTP layer's experts too) live on one rank
            ep = (", with or without enable_expert_parallel (the MTP layer's experts are not sharded)"
                  if self.enable_expert_parallel and spec.method == "mtp" else "")
            raise bad("speculative_config", f"{spec.method} runs with tensor_parallel_size 1 only{ep}; use "
                                            "ngram or tensor_parallel_size=1")
        if not isinstance(self.tuning, KernelTuning):
            raise bad("tuning", f"must be a gpu_worker.tuning.KernelTuning, got {type(self.tuning).__name__}")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config parsed (None: no speculation); a bad value raises a ValueError
        naming its key."""
        return parse_speculative_config(self.speculative_config)

    @property
    def kv_offload_enabled(self) -> bool:
        """True when the engine has a KV tier below the device (host memory, disk or shared)."""
        return self.kv_offload_cpu_gb > 0 or self.kv_offload_dir is not None or self.kv_offload_shared_dir is not None

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
