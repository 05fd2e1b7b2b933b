"""SpeculativeConfig: `--speculative-config`, a JSON object as vLLM spells it, parsed and checked.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}
    {"method": "mtp", "num_speculative_tokens": 2}

Every method takes "disable_by_batch_size" (more running sequences: no drafts) and
"backoff_max_steps" (a sequence whose drafts keep failing goes 1, 2, 4 ... up to this many steps
without drafts, so that async scheduling keeps its step ahead: gpu_worker/spec_decode/backoff.py;
0: never back off).

ngram: prompt lookup (no model). draft_model: a smaller model with the target's tokenizer,
loaded beside it (gpu_worker/spec_decode/draft_model.py). mtp: the model's own
multi-token-prediction layer (config.json num_nextn_predict_layers >= 1), chained
num_speculative_tokens times (gpu_worker/spec_decode/mtp.py); "draft_tensor_parallel_size" is
accepted as vLLM spells it, and only 1. Unknown keys, wrong types and values out of bounds raise
a ValueError naming the key (a draft directory that does not load fails when the engine starts).
No torch here: every service's config embeds the field (services/engine_args.py), and a bad
value fails at start-up in the process that reads it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "mtp")
MAX_SPECULATIVE_TOKENS = 8
MAX_LOOKUP = 64            # longest n-gram searched: bounds the proposer's per-step cost
MAX_CONFIG_CHARS = 4096
MAX_MODEL_PATH_CHARS = 1024
# Sequences in a step above which speculation switches itself off: a guess on the safe side
# (batched decode already keeps the GPU busy) until bench/spec_decode_bench.py's crossover sweep
# (its "recommended_disable_by_batch_size") has run on the H200.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
# The longest back-off of a sequence whose drafts keep failing: it then verifies about once per
# 64 steps (a batch-1 cost near 1/64 of a verification step's), and a sequence that starts to
# repeat waits at most 64 steps before it drafts again.
DEFAULT_BACKOFF_MAX_STEPS = 64
MAX_BACKOFF_STEPS = 1 << 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4       # most draft tokens verified per sequence and step
    prompt_lookup_min: int = 2            # shortest n-gram matched
    prompt_lookup_max: int = 5            # longest n-gram matched (tried first)
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE   # more running sequences: no drafts
    backoff_max_steps: int = DEFAULT_BACKOFF_MAX_STEPS   # longest back-off of a failing sequence; 0: none
    model: str | None = None              # draft_model: the draft's model directory
    draft_tensor_parallel_size: int = 1   # draft_model: only 1 (the draft runs on the target's device)


_BOUNDS = {"num_speculative_tokens": (1, MAX_SPECULATIVE_TOKENS), "prompt_lookup_min": (1, MAX_LOOKUP),
           "prompt_lookup_max": (1, MAX_LOOKUP), "disable_by_batch_size": (1, 1 << 20),
           "backoff_max_steps": (0, MAX_BACKOFF_STEPS),
           "draft_tensor_parallel_size": (1, 1)}


def _bad(key: str, why: str) -> ValueError:
    return ValueError(f"invalid speculative_config: {key} {why}")


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """None or "" -> None (no speculation); else the checked config."""
    if not text:
        return None
    if len(text) > MAX_CONFIG_CHARS:
        raise _bad("(the whole value)", f"must be at most {MAX_CONFIG_CHARS} characters")
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise _bad("(the whole value)", f"is not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(raw, dict):
        raise _bad("(the whole value)", 'must be a JSON object, e.g. {"method": "ngram", "num_speculative_tokens": 4}')
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise _bad(repr(unknown[0]), f"is not a known key; known keys: {', '.join(sorted(known))}")
    if "method" not in raw:
        raise _bad("method", f"is required (one of: {', '.join(METHODS)})")
    if raw["method"] not in METHODS:
        raise _bad("method", f"must be one of: {', '.join(METHODS)} (got {raw['method']!r})")
    for key, (lo, hi) in _BOUNDS.items():
        if key in raw:
            value = raw[key]
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise _bad(key, f"must be an integer in [{lo}, {hi}], got {value!r}")
    _check_model(raw)
    config = SpeculativeConfig(**raw)
    if config.prompt_lookup_min > config.prompt_lookup_max:
        raise _bad("prompt_lookup_min", f"({config.prompt_lookup_min}) must not exceed prompt_lookup_max "
                                        f"({config.prompt_lookup_max})")
    return config


def _check_model(raw: dict) -> None:
    """"model" goes with draft_model, and only with it."""
    model = raw.get("model")
    if raw["method"] != "draft_model":
        if model is not None or "draft_tensor_parallel_size" in raw:
            key = "model" if model is not None else "draft_tensor_parallel_size"
            raise _bad(key, f"applies to method draft_model only (method is {raw['method']!r})")
        return
    if not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_PATH_CHARS:
        raise _bad("model", f"is required with draft_model: the draft's model directory, a string of 1 to "
                            f"{MAX_MODEL_PATH_CHARS} characters")
