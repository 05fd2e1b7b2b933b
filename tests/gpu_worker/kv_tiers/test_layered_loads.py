"""Loads inside the step: a prompt whose history sits in the host tier runs in the step that
admits it, its blocks landing layer by layer inside that step's forward (layer i's just before
layer i runs, after layer i's copy); greedy tokens are transformers'. Which loads join their step
(LoadPolicy.joins_step), how a load splits into layer groups, and on CUDA the per-group events
the step stream waits for. (Loads beside the step: test_overlapped_loads.py.)"""
from __future__ import annotations

import pytest
import torch

from gpu_worker.kv_tiers import block_mover
from gpu_worker.kv_tiers.block_mover import BlockMover
from gpu_worker.kv_tiers.load_policy import LoadPolicy
from tests.gpu_worker.kv_tiers.conftest import (
    MAX_STEPS, check_all_tiers, greedy, push_out, run, tier_stats, tiered_engine, tokens)

TIERS = dict(kv_offload_cpu_gb=0.001)
CUDA = dict(device="cuda", dtype="float32", attention_backend="triton", cuda_graph_max_bs=16)


def _history_in_host_tier(eng) -> list[int]:
    history = tokens(20, 1)
    answer, _ = run(eng, "turn-0", history)
    push_out(eng, 1)
    return history + answer + tokens(5, 2)


def _record_layers(eng, log: list, monkeypatch) -> None:
    """Log ("scatter", layer) for every per-layer scatter and ("attend", i) as layer i's
    attention starts (eager forwards and piecewise graphs both call it)."""
    mover = eng.kv_tiers.mover
    scatter = mover.scatter_layer

    def logged_scatter(staged, block_ids, layer):
        log.append(("scatter", layer))
        scatter(staged, block_ids, layer)
    monkeypatch.setattr(mover, "scatter_layer", logged_scatter)
    for i, layer in enumerate(eng.runner.model.model.layers):
        attend = layer.self_attn.attend

        def logged_attend(*args, i=i, attend=attend):
            log.append(("attend", i))
            return attend(*args)
        monkeypatch.setattr(layer.self_attn, "attend", logged_attend)


def _interleaved(num_layers: int) -> list:
    """Layer i's blocks land after layer i - 1 attended and before layer i attends."""
    return [e for i in range(num_layers) for e in (("scatter", i), ("attend", i))]


def _finish(eng, outputs: dict[str, list[int]]) -> None:
    for _ in range(MAX_STEPS):
        if not eng.has_unfinished_requests():
            return
        for d in eng.step():
            outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
    raise AssertionError("not finished")


def _step_outputs(eng, outputs: dict[str, list[int]]) -> list[str]:
    deltas = eng.step()
    for d in deltas:
        outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
    return [d.request_id for d in deltas if d.new_token_ids]


def test_an_idle_engine_prefills_while_the_history_lands_layer_by_layer(llama, monkeypatch):
    model_dir, hf = llama
    eng = tiered_engine(model_dir, num_gpu_blocks=32, **TIERS)
    prompt = _history_in_host_tier(eng)
    log: list = []
    _record_layers(eng, log, monkeypatch)
    eng.add_request("next", prompt, greedy(4))
    outputs: dict[str, list[int]] = {}
    assert _step_outputs(eng, outputs) == ["next"]          # its first token in the admitting step
    assert not eng.scheduler.loading
    num_layers = len(eng.runner.model.model.layers)
    assert log == _interleaved(num_layers)
    _finish(eng, outputs)
    assert outputs["next"] == hf.greedy(prompt, 4)[0]
    assert tier_stats(eng)["loaded_blocks"]["cpu"] >= 5
    assert eng.stats().prefix_hit_tokens >= 5 * 4
    check_all_tiers(eng)


def test_a_load_that_fits_under_the_step_joins_it_beside_a_running_request(llama):
    model_dir, hf = llama
    eng = tiered_engine(model_dir, num_gpu_blocks=32, **TIERS)
    prompt = _history_in_host_tier(eng)
    other = tokens(9, 3)
    outputs: dict[str, list[int]] = {}
    eng.add_request("other", other, greedy(8))
    while not outputs.get("other"):
        _step_outputs(eng, outputs)
    policy = eng.kv_tiers.policy
    policy.bandwidth["cpu"], policy.prefill_rate = 1e15, 1.0      # the copy predicted far under the step
    eng.add_request("next", prompt, greedy(4))
    assert sorted(_step_outputs(eng, outputs)) == ["next", "other"]
    _finish(eng, outputs)
    assert outputs["next"] == hf.greedy(prompt, 4)[0]
    assert outputs["other"] == hf.greedy(other, 8)[0]
    check_all_tiers(eng)


def test_which_loads_join_their_step():
    policy = LoadPolicy("auto", block_bytes=1000, block_size=10)
    assert policy.joins_step(load_s=9.0, step_tokens=1, others_running=False)    # nobody waits
    assert not policy.joins_step(load_s=0.0, step_tokens=1, others_running=True)   # no rate yet
    policy.prefill_rate = 1000.0
    assert policy.joins_step(load_s=0.1, step_tokens=100, others_running=True)     # 0.1 s <= 0.1 s
    assert not policy.joins_step(load_s=0.2, step_tokens=100, others_running=True)


def test_layer_groups_bound_copy_sizes_and_counts():
    def mover(num_layers: int, head_dim: int) -> BlockMover:
        k = torch.zeros(2, 16, 8, head_dim, dtype=torch.float16)      # a layer's K: 32 KiB a block at 128
        return BlockMover([(k, k)] * num_layers)
    m = mover(32, 128)                                  # 2 MiB blocks: 8 groups of 256 KiB
    assert (m.block_bytes, m.layer_groups(1), m.layer_groups(1024), m.layer_groups(10_000)) == (2 << 20, 8, 4, 1)
    assert mover(4, 1024).layer_groups(1) == 4         # never more groups than layers
    assert mover(2, 8).layer_groups(1) == 1             # tiny blocks: one copy each
    staged = m.stage([torch.zeros(m.block_shape, dtype=torch.uint8)], [None], groups=8)
    assert (staged.per_group, len(staged.ready)) == (4, 8)         # off CUDA: done, no events
    assert m.stage([torch.zeros(m.block_shape, dtype=torch.uint8)], [None], groups=5).per_group == 7   # 7+7+7+7+4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("piecewise_tokens", [0, 256])
def test_on_cuda_each_layer_waits_for_its_own_copy(llama, monkeypatch, piecewise_tokens):
    """One event per layer (every layer its own group here), and the step stream waits for them
    in layer order; with piecewise graphs layer i's blocks land inside the forward, just before
    layer i's attention; with only a prefill graph, all of them before it. Tokens are transformers'."""
    monkeypatch.setattr(block_mover, "_MIN_GROUP_COPY", 1)
    model_dir, hf = llama
    eng = tiered_engine(model_dir, num_gpu_blocks=32, piecewise_graph_max_tokens=piecewise_tokens, **TIERS, **CUDA)
    prompt = _history_in_host_tier(eng)
    num_layers = len(eng.runner.model.model.layers)
    mover, staged_loads, waited = eng.kv_tiers.mover, [], []
    stage = mover.stage

    def kept(*args, **kw):
        staged_loads.append(stage(*args, **kw))
        return staged_loads[-1]
    monkeypatch.setattr(mover, "stage", kept)
    wait_event = torch.cuda.Stream.wait_event
    monkeypatch.setattr(torch.cuda.Stream, "wait_event", lambda s, e: (waited.append(e), wait_event(s, e))[1])
    log: list = []
    _record_layers(eng, log, monkeypatch)
    eng.add_request("next", prompt, greedy(4))
    outputs: dict[str, list[int]] = {}
    _finish(eng, outputs)
    assert outputs["next"] == hf.greedy(prompt, 4)[0]
    (staged,) = staged_loads
    assert len(staged.ready) == num_layers and all(isinstance(e, torch.cuda.Event) for e in staged.ready)
    assert [e for e in waited if any(e is r for r in staged.ready)][:num_layers] == staged.ready   # layer order
    first = log.index(("scatter", 0))
    landed = log[first:first + 2 * num_layers]
    if piecewise_tokens:
        assert landed == _interleaved(num_layers)
    else:                                              # the prefill graph replays: no eager attention
        assert landed[:num_layers] == [("scatter", i) for i in range(num_layers)]
    check_all_tiers(eng)
    eng.close()
