"""Mixtral and Qwen3-MoE end to end: make-model writes what transformers loads, the decoder with
SparseMoE layers reproduces transformers' logits and greedy tokens, and expert parallelism
(EP=2, all-to-all) and MoE tensor parallelism (TP=2) over 2 gloo ranks reproduce one rank."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.make_model import make_model
from gpu_worker.model_config import ModelConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.moe import SparseMoE
from gpu_worker.parallel.tp_worker import TPModelRunner
from parallel_helpers import greedy_run

PROMPTS = [[1, 17, 300, 45, 9, 800, 23, 5, 61, 2, 99], [5, 400, 12, 7, 3, 250, 70], [42, 43]]
STEPS = 4


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_models")
    return {
        "mixtral": str(make_model(root / "mixtral", "mixtral", "tiny", seed=5, progress=False)),
        "qwen3_moe": str(make_model(root / "qwen3_moe", "qwen3_moe", "tiny", seed=5, progress=False)),
        # a dense MLP in layer 0, top-k weights not renormalized
        "qwen3_moe_mixed": str(make_model(root / "qwen3_moe_mixed", "qwen3_moe", "tiny", seed=6, progress=False,
                                          mlp_only_layers=(0,), norm_topk=False)),
    }


def _hf_greedy(model_dir: str, prompts: list[list[int]], steps: int):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            seq, per_step = list(prompt), []
            for _ in range(steps + 1):
                last = hf(torch.tensor([seq])).logits[0, -1].float()
                per_step.append(last)
                seq.append(int(last.argmax()))
            tokens.append(seq[len(prompt):])
            logits.append(per_step)
    return tokens, logits


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen3_moe_mixed"])
def test_moe_model_matches_transformers(moe_models, name):
    model_dir = moe_models[name]
    cfg = ModelConfig.from_dir(model_dir)
    runner = ModelRunner(cfg, model_dir)
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in runner.model.model.layers]
    assert sparse == [i in cfg.moe_layers for i in range(cfg.num_layers)]
    assert any(sparse) and (name != "qwen3_moe_mixed" or not sparse[0])
    tokens, logits = greedy_run(runner, PROMPTS, STEPS)
    ref_tokens, ref_logits = _hf_greedy(model_dir, PROMPTS, STEPS)
    assert tokens == ref_tokens
    for step, ours in enumerate(logits):
        for i in range(len(PROMPTS)):
            ref = ref_logits[i][step]
            assert (ours[i] - ref).abs().max() < 1e-4 * ref.std()


@pytest.mark.parametrize("name,expert_parallel", [("mixtral", True), ("qwen3_moe_mixed", True),
                                                  ("qwen3_moe", False)])
def test_moe_parallel_matches_single_rank(moe_models, name, expert_parallel):
    model_dir = moe_models[name]
    cfg = ModelConfig.from_dir(model_dir)
    ref_tokens, ref_logits = greedy_run(ModelRunner(cfg, model_dir), PROMPTS, STEPS)
    tp = TPModelRunner(cfg, model_dir, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
                       timeout_s=120)
    try:
        moe = next(layer.mlp for layer in tp.rank0.model.model.layers if isinstance(layer.mlp, SparseMoE))
        if expert_parallel:
            assert moe.num_local_experts == cfg.num_experts // 2
        else:
            assert moe.intermediate == cfg.moe_intermediate_size // 2
        tokens, logits = greedy_run(tp, PROMPTS, STEPS)
    finally:
        tp.close()
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits):
        assert (ours - ref).abs().max() < 1e-4 * ref.std()


def test_make_model_cli_writes_moe_configs(tmp_path):
    import json
    from gpu_worker.make_model import main
    assert main(["--arch", "mixtral", "--size", "tiny", str(tmp_path / "m")]) == 0
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    assert raw["architectures"] == ["MixtralForCausalLM"] and raw["num_local_experts"] == 4
    cfg = ModelConfig.from_dir(tmp_path / "m")
    assert cfg.family == "mixtral" and cfg.moe_layers == (0, 1) and cfg.num_experts_per_tok == 2


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_sizes_hold_about_their_parameter_count(arch):
    import math
    from gpu_worker.make_model import SHAPES, _tensor_specs
    for size, lo, hi in (("1b", 1.0e9, 2.5e9), ("8b", 7.0e9, 10e9)):
        n = sum(math.prod(shape) for _, shape, _, _ in _tensor_specs(arch, SHAPES[(arch, size)]))
        assert lo < n < hi, (arch, size, n)
