"""Greedy parity with transformers after the history of a chat went to a lower KV tier and came
back, on every architecture and tier combination, and with speculation (n-gram, draft model, MTP)
under preemption; a 10-turn chat through the engine; the
load-or-recompute policies; integrity of every tier at the end."""
from __future__ import annotations

import json

import pytest
import torch

from gpu_worker.engine import Engine
from services.protocol.sampling import SamplingParams
from tests.gpu_worker.kv_tiers.conftest import MAX_STEPS, check_all_tiers, chat, tier_stats, tiered_engine
from tests.gpu_worker.spec_decode.mtp_models import random_mtp
from tests.gpu_worker.spec_decode.spec_fakes import repetitive

TIER_CONFIGS = {
    "cpu": dict(kv_offload_cpu_gb=0.001),
    "disk": dict(kv_offload_disk_gb=0.001),                          # device -> disk directly
    "cpu+disk": dict(kv_offload_cpu_gb=0.00002, kv_offload_disk_gb=0.001),   # a few host slots
}


def with_dir(config: dict, tmp_path) -> dict:
    config = dict(config)
    if "kv_offload_disk_gb" in config:
        config["kv_offload_dir"] = str(tmp_path / "kv")
    return config


@pytest.mark.parametrize("tiers", list(TIER_CONFIGS))
def test_offload_and_reload_match_transformers(arch_model, tiers, tmp_path):
    model_dir, hf = arch_model
    eng = tiered_engine(model_dir, **with_dir(TIER_CONFIGS[tiers], tmp_path))
    turns = chat(eng, 3)
    for prompt, answer, _ in turns:
        assert answer == hf.greedy(prompt, len(answer))[0]
    stats = tier_stats(eng)
    loaded = sum(stats["loaded_blocks"].values())
    assert loaded > 0, stats
    if tiers == "cpu+disk":
        assert stats["loaded_blocks"]["disk"] > 0 and stats["offloaded_blocks"]["disk"] > 0, stats
    assert turns[-1][2] > 0                              # history reused: cached tokens reported
    check_all_tiers(eng)


def test_ten_turn_chat_reuses_history_from_lower_tiers(llama, tmp_path):
    """The device pool cannot hold the history next to the other traffic: every turn after the
    first reloads it (prefix hit counted, cached_tokens reported) and the tokens are transformers'."""
    model_dir, hf = llama
    eng = tiered_engine(model_dir, num_gpu_blocks=40, kv_offload_cpu_gb=0.00004,
                        kv_offload_dir=str(tmp_path / "kv"), kv_offload_disk_gb=0.001)
    baseline = tiered_engine(model_dir, num_gpu_blocks=40)
    turns = chat(eng, 10)
    plain = chat(baseline, 10)
    for (prompt, answer, cached), (_, plain_answer, plain_cached) in zip(turns, plain):
        assert answer == plain_answer == hf.greedy(prompt, len(answer))[0]
        assert plain_cached == 0                           # without tiers the history is gone
    for prompt, _, cached in turns[1:]:
        assert cached >= len(prompt) - 2 * 4 - 5, (cached, len(prompt))  # all but the new message
    stats = eng.stats()
    assert stats.prefix_hit_tokens >= sum(c for _, _, c in turns) > 0
    assert baseline.stats().prefix_hit_tokens < stats.prefix_hit_tokens
    assert tier_stats(eng)["decisions"]["load"] == 9
    check_all_tiers(eng)
    check_all_tiers(baseline)


@pytest.mark.parametrize("policy", ["never", "always"])
def test_policies_never_and_always(llama, policy, tmp_path):
    model_dir, hf = llama
    eng = tiered_engine(model_dir, kv_offload_cpu_gb=0.001, kv_load_policy=policy)
    turns = chat(eng, 3)
    for prompt, answer, _ in turns:
        assert answer == hf.greedy(prompt, len(answer))[0]
    stats = tier_stats(eng)
    if policy == "never":
        assert sum(stats["loaded_blocks"].values()) == 0 and stats["decisions"]["recompute"] == 2
        assert all(cached == 0 for _, _, cached in turns)
    else:
        assert stats["decisions"]["load"] == 2 and stats["loaded_blocks"]["cpu"] > 0
    check_all_tiers(eng)


def test_auto_policy_splits_when_the_tail_is_slow(llama, tmp_path):
    """A few host slots: the history's first blocks come back from host memory, its tail (evicted
    first, so demoted first) from disk. With the disk made far slower to read than recomputing,
    auto loads the host part and recomputes the rest (a partial reload): transformers' tokens."""
    model_dir, hf = llama
    eng = tiered_engine(model_dir, kv_offload_cpu_gb=6e-6,                     # 3 slots of 2 KiB
                        kv_offload_dir=str(tmp_path / "kv"), kv_offload_disk_gb=0.001, kv_load_policy="auto")
    assert eng.kv_tiers.host.num_slots == 3

    def slow_disk(eng, turn, next_prompt):
        eng.kv_tiers.policy.bandwidth.update(cpu=1e12, disk=1.0)   # bytes per second
        eng.kv_tiers.policy.prefill_rate = 1e6              # tokens per second

    turns = chat(eng, 3, between=slow_disk)
    for prompt, answer, _ in turns:
        assert answer == hf.greedy(prompt, len(answer))[0]
    stats = tier_stats(eng)
    # turn 2's history (3 blocks) fits in the host tier; turn 3's (6) spills its tail to disk
    assert stats["decisions"] == {"load": 1, "recompute": 0, "split": 1}, stats["decisions"]
    assert stats["loaded_blocks"]["cpu"] > 0 and stats["loaded_blocks"]["disk"] == 0, stats
    assert stats["recomputed_tier_tokens"] > 0
    check_all_tiers(eng)


def test_async_scheduling_with_tiers(llama, tmp_path):
    """One step ahead (async_scheduling): loads and offloads happen in schedule(), before the
    launch, exactly as in the synchronous loop."""
    model_dir, hf = llama
    eng = tiered_engine(model_dir, async_scheduling=True, kv_offload_cpu_gb=6e-6,
                        kv_offload_dir=str(tmp_path / "kv"), kv_offload_disk_gb=0.001)
    turns = chat(eng, 4)
    for prompt, answer, _ in turns:
        assert answer == hf.greedy(prompt, len(answer))[0]
    assert sum(tier_stats(eng)["loaded_blocks"].values()) > 0
    check_all_tiers(eng)


def test_an_fp8_cache_round_trips_through_the_tiers(llama, tmp_path):
    """The tiers move the cache's bytes: an fp8 cache comes back bit for bit, so the tokens are
    those of the same engine without tiers (fp8 is not transformers' numerics)."""
    model_dir, _ = llama
    kw = dict(kv_cache_dtype="fp8", num_gpu_blocks=24)
    tiered = tiered_engine(model_dir, kv_offload_cpu_gb=6e-6, kv_offload_dir=str(tmp_path / "kv"),
                           kv_offload_disk_gb=0.001, **kw)
    plain = tiered_engine(model_dir, **kw)
    assert [a for _, a, _ in chat(tiered, 3)] == [a for _, a, _ in chat(plain, 3)]
    assert tier_stats(tiered)["loaded_blocks"]["cpu"] > 0 and tier_stats(tiered)["loaded_blocks"]["disk"] > 0
    check_all_tiers(tiered)


CUDA = dict(device="cuda", dtype="float32", attention_backend="triton", cuda_graph_max_bs=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_offload_and_reload_on_the_gpu(arch_model, async_scheduling, tmp_path):
    """The CUDA path as it serves (streams of its own, pinned host slots, device events, CUDA
    graphs, Triton kernels): transformers' tokens after the history went to host and disk."""
    model_dir, hf = arch_model
    eng = tiered_engine(model_dir, kv_offload_cpu_gb=6e-6, kv_offload_dir=str(tmp_path / "kv"),
                        kv_offload_disk_gb=0.001, async_scheduling=async_scheduling, **CUDA)
    turns = chat(eng, 4)
    for prompt, answer, _ in turns:
        assert answer == hf.greedy(prompt, len(answer))[0]
    stats = tier_stats(eng)
    assert stats["loaded_blocks"]["cpu"] > 0 and stats["loaded_blocks"]["disk"] > 0, stats
    check_all_tiers(eng)
    eng.close()


@pytest.mark.parametrize("method", ["ngram", "draft_model", "mtp"])
def test_speculation_with_tiers_and_preemption_matches_one_plain_engine(method, tmp_path):
    """Speculation on an engine whose history comes back from host memory and disk while a
    small pool preempts (n = 2, async scheduling): the plain engine's greedy tokens, every block
    of every tier back."""
    model_dir = random_mtp("llama", tmp_path / "model")   # its own draft model, and its MTP layer
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
            "draft_model": {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3},
            "mtp": {"method": "mtp", "num_speculative_tokens": 2, "backoff_max_steps": 0}}[method]
    plain = tiered_engine(model_dir, num_gpu_blocks=512)
    eng = tiered_engine(model_dir, num_gpu_blocks=20, speculative_config=json.dumps(spec), async_scheduling=True,
                        kv_offload_cpu_gb=1e-5, kv_offload_dir=str(tmp_path / "kv"), kv_offload_disk_gb=0.001)

    def drive(e: Engine) -> dict:
        out: dict = {}
        for i in range(3):
            e.add_request(f"r{i}", repetitive(22 + 5 * i, 3 + i, i), SamplingParams(temperature=0.0, max_tokens=16,
                                                                                  ignore_eos=True, n=2))
        for _ in range(MAX_STEPS):
            if not e.has_unfinished_requests():
                break
            for d in e.step():
                out.setdefault((d.request_id, d.index), []).extend(d.new_token_ids)
        return out

    want = drive(plain)
    turns, got = chat(eng, 2), drive(eng)
    assert [a for _, a, _ in turns] == [a for _, a, _ in chat(plain, 2)]
    assert got == want
    assert eng.stats().num_preemptions > 0 and eng.stats().extra["spec_decode"]["proposed"] > 0
    assert sum(tier_stats(eng)["loaded_blocks"].values()) > 0
    check_all_tiers(eng)
