"""Tensor parallelism on the CPU: 2 gloo ranks (this process + one child) reproduce TP=1.

Same prompts, same paged batches: logits close and greedy tokens identical, for a tiny llama
(untied lm_head, llama3 rope), a tiny qwen3 (tied embeddings, q/k norm, head_dim 32), a tiny
qwen2 (q/k/v biases sliced with their heads), a KV-head
count smaller than the rank count (KV heads replicated) and a vocabulary that does not divide
evenly (padded vocab shards).
"""
from __future__ import annotations

import pytest

from gpu_worker.make_model import make_model
from gpu_worker.model_config import ModelConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.parallel.tp_linear import kv_heads_per_rank
from gpu_worker.parallel.tp_worker import TPModelRunner
from parallel_helpers import greedy_run

PROMPTS = [[1, 17, 300, 45, 9, 800, 23, 5, 61, 2, 99], [5, 400, 12, 7, 3, 250, 70], [42, 43]]
STEPS = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_models")
    return {
        "llama": make_model(root / "llama", "llama", "tiny", seed=3, progress=False),
        "qwen3": make_model(root / "qwen3", "qwen3", "tiny", seed=3, progress=False),
        "qwen2": make_model(root / "qwen2", "qwen2", "tiny", seed=3, progress=False),   # q/k/v bias
        # 1 KV head over 2 ranks (replicated), vocabulary 1001 (ranks hold 501 rows, one padded)
        "llama_mqa_oddvocab": make_model(root / "mqa", "llama", "tiny", seed=4, progress=False,
                                         kv_heads=1, vocab_size=1001),
    }


def _compare(model_dir) -> None:
    cfg = ModelConfig.from_dir(model_dir)
    ref_tokens, ref_logits = greedy_run(ModelRunner(cfg, str(model_dir)), PROMPTS, STEPS)
    tp = TPModelRunner(cfg, str(model_dir), tensor_parallel_size=2, timeout_s=120)
    try:
        assert tp.vocab_size == cfg.vocab_size
        kv_per_rank = kv_heads_per_rank(cfg.num_kv_heads, 2)
        assert tp.block_size_bytes(16) == 16 * 2 * cfg.num_layers * kv_per_rank * cfg.head_dim * 4
        tokens, logits = greedy_run(tp, PROMPTS, STEPS)
    finally:
        tp.close()
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits):
        assert ours.shape == ref.shape == (len(PROMPTS), cfg.vocab_size)
        assert (ours - ref).abs().max() < 1e-4 * ref.std()


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen2", "llama_mqa_oddvocab"])
def test_tp2_matches_tp1(models, name):
    _compare(models[name])


def test_tp_runner_rejects_indivisible_heads(models, tmp_path):
    odd = make_model(tmp_path / "odd", "llama", "tiny", seed=1, progress=False, heads=3, kv_heads=1, hidden=48)
    with pytest.raises(ValueError, match="num_attention_heads"):
        TPModelRunner(ModelConfig.from_dir(odd), str(odd), tensor_parallel_size=2, timeout_s=60)


def test_idle_longer_than_the_collective_timeout(models):
    """Followers wait for commands on the control group, which has no practical timeout: an idle
    period longer than the model collectives' timeout must not kill them."""
    import time
    model_dir = str(models["qwen3"])
    cfg = ModelConfig.from_dir(model_dir)
    tp = TPModelRunner(cfg, model_dir, tensor_parallel_size=2, timeout_s=5)
    try:
        first, _ = greedy_run(tp, PROMPTS[:1], 1)
        time.sleep(6)
        assert all(p.poll() is None for p in tp.children)
        again, _ = greedy_run(tp, PROMPTS[:1], 1)
    finally:
        tp.close()
    assert first == again


def test_dead_rank_is_an_error_not_a_hang(models):
    model_dir = str(models["llama"])
    tp = TPModelRunner(ModelConfig.from_dir(model_dir), model_dir, tensor_parallel_size=2, timeout_s=60)
    try:
        tp.children[0].kill()
        tp.children[0].wait()
        with pytest.raises(RuntimeError, match="exited"):
            tp.allocate_kv_cache(8, 4)
    finally:
        tp.close()


def test_decode_graphs_are_captured_on_every_rank(models):
    """capture_cuda_graphs reaches every rank (on the CPU the graphs replay eagerly, with the
    same collectives); decode steps then take the graph path on all ranks in lockstep."""
    model_dir = str(models["llama"])
    cfg = ModelConfig.from_dir(model_dir)
    ref_tokens, ref_logits = greedy_run(ModelRunner(cfg, model_dir), PROMPTS, STEPS)
    tp = TPModelRunner(cfg, model_dir, tensor_parallel_size=2, timeout_s=120)
    try:
        def prepare(runner):     # what the engine does on CUDA: warm up, then capture
            runner.warmup(4)
            runner.capture_cuda_graphs(4, 64)
        tokens, logits = greedy_run(tp, PROMPTS, STEPS, before_first_step=prepare)
        assert tp.rank0.decode_graphs is not None
    finally:
        tp.close()
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits):
        assert (ours - ref).abs().max() < 1e-4 * ref.std()
