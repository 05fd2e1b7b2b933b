"""kvmesh GPU worker: the engine (scheduler, paged KV blocks, sampler) and the model runner.

Offline use, as in vLLM:

    from gpu_worker import LLM, SamplingParams
    outputs = LLM(model="/path/to/model").generate("Hello", SamplingParams(max_tokens=16))

Names are imported lazily so that `import gpu_worker.<submodule>` stays cheap.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "gpu_worker.llm",
    "RequestOutput": "gpu_worker.llm",
    "CompletionOutput": "gpu_worker.llm",
    "Logprob": "gpu_worker.llm",
    "SamplingParams": "services.protocol.sampling",
    "EngineConfig": "gpu_worker.config",
    "Engine": "gpu_worker.engine",
    "RequestError": "gpu_worker.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gpu_worker' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
