"""Session-wide tiny random models (one per architecture) and their Hugging Face references."""
from __future__ import annotations

import pytest
import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models: one thread is as fast, and spinning OpenMP threads on shared cores is not."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class HFReference:
    """Greedy decoding with transformers (fp32), memoized per prompt."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self._memo: dict[tuple, tuple[list[int], torch.Tensor]] = {}

    @torch.no_grad()
    def greedy(self, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
        """-> (tokens, (steps, vocab) log-softmax of the logits that chose them)."""
        key = (tuple(prompt), steps)
        if key not in self._memo:
            tokens, logprobs = [], []
            for _ in range(steps):      # full recompute: no dependence on HF's cache API
                logits = self.model(input_ids=torch.tensor([prompt + tokens])).logits   # (1, L, V)
                lp = torch.log_softmax(logits[0, -1].float(), dim=-1)                   # (V,)
                tokens.append(int(lp.argmax()))
                logprobs.append(lp)
            self._memo[key] = (tokens, torch.stack(logprobs))
        return self._memo[key]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    from gpu_worker.make_model import make_model
    root = tmp_path_factory.mktemp("engine_models")
    return {arch: str(make_model(root / arch, arch=arch, size="tiny", progress=False)) for arch in ARCHS}


_HF: dict[str, HFReference] = {}


@pytest.fixture(params=ARCHS)
def arch_model(request, tiny_models) -> tuple[str, HFReference]:
    """(model_dir, hf_reference) for each architecture."""
    arch = request.param
    if arch not in _HF:
        _HF[arch] = HFReference(tiny_models[arch])
    return tiny_models[arch], _HF[arch]
