"""The Triton backend inside the model on the CPU (Triton's interpreter): chunked prefills behind a
cached prefix, through fresh_prefill_attention, reproduce Hugging Face's fp32 logits and greedy
tokens (the GPU runs the same steps in tests/gpu_worker/models/test_model_gpu.py)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_model_parity import assert_close, hf_logits, long_chunk_run  # noqa: E402

from gpu_worker.make_model import make_model  # noqa: E402


@pytest.mark.parametrize("arch", ["llama", "qwen3"])                 # head_dim 16 and 32
def test_chunks_behind_a_prefix_match_hf_on_the_triton_backend(tmp_path, monkeypatch, arch):
    import gpu_worker.attention.triton_backend as tb
    prefixes = []
    real = tb.fresh_prefill_attention
    monkeypatch.setattr(tb, "fresh_prefill_attention",
                        lambda *a, **kw: prefixes.append(kw["prefix"] is not None) or real(*a, **kw))
    model_dir = str(make_model(tmp_path / arch, arch, "tiny", seed=1, progress=False))
    seqs = long_chunk_run(model_dir, 1024, "cpu")
    assert prefixes and all(prefixes), prefixes            # both prefill steps, every layer, behind a prefix
    assert_close(seqs, hf_logits(model_dir, [s.tokens for s in seqs]))   # 1e-4 of the logits' std, argmax equal
