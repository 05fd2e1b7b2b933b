"""Fast-path pieces (batch builder, batched sampler, fused-kernel wiring) checked on the CPU."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Small tensors: one thread is as fast, and spinning OpenMP threads on shared cores is not."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from gpu_worker.make_model import make_model
    return str(make_model(tmp_path_factory.mktemp("perf_llama"), "llama", "tiny", seed=3, progress=False))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    from gpu_worker.make_model import make_model
    return str(make_model(tmp_path_factory.mktemp("perf_qwen3"), "qwen3", "tiny", seed=4, progress=False))
