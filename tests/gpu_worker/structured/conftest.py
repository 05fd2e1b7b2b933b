"""One tiny random-weight llama (with its real tokenizer) for the constrained-decoding tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models: one thread is as fast, and spinning OpenMP threads on shared cores is not."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from gpu_worker.make_model import make_model
    return str(make_model(tmp_path_factory.mktemp("structured_models") / "llama", arch="llama", size="tiny",
                          progress=False))


@pytest.fixture(scope="session")
def tokenizer(tiny_llama):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(tiny_llama)
