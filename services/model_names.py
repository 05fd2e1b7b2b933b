"""The names a served model answers to in a request's `model`, as vLLM's `--served-model-name`.

    kvmesh worker --model /models/llama-3-8b --served-model-name llama3,llama
        served names  ["llama3", "llama"]   listed by GET /v1/models in this order; the first is the
                                            name responses carry
        path aliases  ["/models/llama-3-8b"] accepted, never listed: clients written against
                                            `vllm serve PATH` (vLLM's own `vllm bench serve`) send
                                            the path they were given

Each worker publishes both lists in its registry record (gpu_worker/service/main.py); gateways
read them from there (services/gateway/models.py), so a hand-started stack and `kvmesh serve`
(which passes --model and --served-model-name to every worker) answer to the same names.
"""
from __future__ import annotations

import os
from pathlib import Path

NULL_MODEL_NAME = "null-model"


def served_names(served_model_name: list[str], model_path: str) -> list[str]:
    """The names given (order kept; the configs refuse a name twice, one twice from code counts
    once), else the model directory's name."""
    if served_model_name:
        return list(dict.fromkeys(served_model_name))
    return [Path(model_path).name if model_path else NULL_MODEL_NAME]


def path_aliases(model_path: str) -> list[str]:
    """The model path as given to --model, without a trailing slash, and made absolute."""
    if not model_path:
        return []
    trimmed = model_path.rstrip("/") or model_path
    return list(dict.fromkeys([model_path, trimmed, os.path.abspath(trimmed)]))
