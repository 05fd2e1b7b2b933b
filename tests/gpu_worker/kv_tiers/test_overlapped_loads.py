"""Loads beside the step: a prompt whose history comes back from a lower tier, with a request
running and a load predicted to take longer than the step's compute, waits for its blocks in
`loading` while the batch goes on without it (a running request keeps producing tokens in that
step), then joins; greedy tokens are transformers', an abort while loading frees everything, and
no block leaks in any tier. (Loads inside the step: test_layered_loads.py.)"""
from __future__ import annotations

from tests.gpu_worker.kv_tiers.conftest import (
    MAX_STEPS, check_all_tiers, decoding, greedy, push_out, run, tier_stats, tiered_engine, tokens)

TIERS = dict(kv_offload_cpu_gb=0.001, kv_load_policy="always")


def _slow_loads(eng) -> None:
    """The host tier predicted at 1 byte/s: a load cannot hide under a step (LoadPolicy.joins_step),
    and `always` loads all the same."""
    eng.kv_tiers.policy.bandwidth["cpu"] = 1.0


def _history_in_host_tier(eng) -> list[int]:
    """A prompt whose first blocks sit in the host tier only (the device evicted them)."""
    history = tokens(20, 1)
    answer, _ = run(eng, "turn-0", history)
    push_out(eng, 1)
    return history + answer + tokens(5, 2)


def _finish(eng, outputs: dict[str, list[int]]) -> None:
    for _ in range(MAX_STEPS):
        if not eng.has_unfinished_requests():
            return
        for d in eng.step():
            outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
    raise AssertionError("not finished")


def test_the_batch_runs_on_while_a_prompt_loads_its_history(llama, tmp_path):
    model_dir, hf = llama
    eng = tiered_engine(model_dir, num_gpu_blocks=32, **TIERS)
    prompt = _history_in_host_tier(eng)
    other = tokens(9, 3)
    outputs = {"other": decoding(eng, "other", other, 8)}
    _slow_loads(eng)
    eng.add_request("next", prompt, greedy(4))
    deltas = eng.step()                                   # admits "next": its load starts
    assert [s.request.request_id for s in eng.scheduler.loading] == ["next"]
    assert [d.request_id for d in deltas] == ["other"]    # the running request went on
    outputs["other"] += deltas[0].new_token_ids
    _finish(eng, outputs)
    assert outputs["next"] == hf.greedy(prompt, 4)[0]
    assert outputs["other"] == hf.greedy(other, 8)[0]
    stats = tier_stats(eng)
    assert stats["loaded_blocks"]["cpu"] >= 5, stats
    assert eng.stats().prefix_hit_tokens >= 5 * 4
    check_all_tiers(eng)


def test_a_request_aborted_while_loading_frees_everything(llama, tmp_path):
    model_dir, hf = llama
    eng = tiered_engine(model_dir, num_gpu_blocks=32, **TIERS)
    prompt = _history_in_host_tier(eng)
    other = tokens(9, 4)
    outputs = {"other": decoding(eng, "other", other, 6)}
    _slow_loads(eng)
    eng.add_request("next", prompt, greedy(4))
    outputs["other"] += [t for d in eng.step() for t in d.new_token_ids]
    assert eng.scheduler.loading
    eng.abort_request("next")
    assert not eng.scheduler.loading and not eng.scheduler._loads
    _finish(eng, outputs)
    assert "next" not in outputs
    assert outputs["other"] == hf.greedy(other, 6)[0]
    assert tier_stats(eng)["loaded_blocks"]["cpu"] == 0          # the load never landed
    check_all_tiers(eng)
    # the history is still in the host tier: the same prompt loads it again, correctly
    answer, cached = run(eng, "again", prompt)
    assert answer == hf.greedy(prompt, 4)[0] and cached >= 5 * 4
    check_all_tiers(eng)


def test_a_loading_request_keeps_its_batch_slot(llama, tmp_path):
    """max_num_seqs counts sequences that wait for their blocks: two turns that both load, beside
    one running request, in a batch of 2: one loads, the other waits its turn."""
    model_dir, hf = llama
    eng = tiered_engine(model_dir, num_gpu_blocks=32, max_num_seqs=2, **TIERS)
    prompt = _history_in_host_tier(eng)
    other = tokens(9, 5)
    outputs = {"other": decoding(eng, "other", other, 6)}
    _slow_loads(eng)
    eng.add_request("next-a", prompt, greedy(4))
    eng.add_request("next-b", prompt, greedy(4))
    for d in eng.step():
        outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
    sched = eng.scheduler
    assert len(sched.running) + len(sched.loading) == 2 and len(sched.waiting) == 1
    _finish(eng, outputs)
    assert outputs["next-a"] == outputs["next-b"] == hf.greedy(prompt, 4)[0]
    assert outputs["other"] == hf.greedy(other, 6)[0]
    check_all_tiers(eng)
