"""Tiny random models of every architecture, written once per test session by make-model."""
from __future__ import annotations

import pytest

from gpu_worker.make_model import make_model

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: str(make_model(root / arch, arch, "tiny", seed=1, progress=False)) for arch in ARCHS}


@pytest.fixture(scope="session")
def make_tiny(tmp_path_factory):
    """make_tiny(arch, **shape_overrides) -> a fresh model directory."""
    counter = iter(range(10**6))

    def make(arch: str, **overrides) -> str:
        out = tmp_path_factory.mktemp(f"{arch}_variant_{next(counter)}")
        return str(make_model(out, arch, "tiny", seed=2, progress=False, **overrides))

    return make
