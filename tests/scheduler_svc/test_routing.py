"""Worker scoring: prefix hits against load, tier credits, KV overflow, weights, the baselines."""
from __future__ import annotations

import pytest

from scheduler_svc.core import SchedulerCore
from scheduler_svc.prefix_hints import PrefixHints
from scheduler_svc.routing import (
    CacheAware, RoutingWeights, WorkerView, cache_aware, least_loaded, make_scorer, pick, prefix_hit, round_robin)
from services.config import SchedulerConfig, parse_config
from services.protocol.kv_events import MatchResponse, WorkerMatch
from services.protocol.messages import Dispatch, Submit
from services.protocol.sampling import SamplingParams

PROMPT = 1024  # tokens: 64 blocks of 16


def request(n: int = PROMPT, rid: str = "r") -> Submit:
    return Submit(request_id=rid, tenant="t", prompt_token_ids=list(range(n)), params=SamplingParams(max_tokens=4),
                  reply_addr="tcp://gw:1", detok_addr="tcp://dt:1")


def view(wid: str, *, running: int = 0, waiting: int = 0, inflight: int = 0, free: int = 1000, total: int = 1000,
         seqs: int = 64) -> WorkerView:
    return WorkerView(id=wid, epoch=1, addr=f"tcp://{wid}:1", max_num_seqs=seqs, running=running, waiting=waiting,
                      free_blocks=free, total_blocks=total, inflight={f"{wid}-{i}" for i in range(inflight)})


def match(*workers) -> MatchResponse:
    return MatchResponse(block_size=16, query_blocks=64, workers=[WorkerMatch(*w) for w in workers])


def order(workers, hint=None, scorer=cache_aware, req=None):
    req = req or request()
    return [w.id for w in sorted(workers, key=lambda w: (scorer(w, req, hint), w.id))]


def test_equal_load_longer_prefix_wins():
    m = match(("a", 64, 64, 64), ("b", 10, 10, 10))
    assert order([view("b"), view("a"), view("c")], m) == ["a", "b", "c"]
    # the block holding the last prompt token is always recomputed: at most 63 of 64 blocks saved
    assert prefix_hit("a", PROMPT, m) == (63 / 64, 63)
    assert prefix_hit("c", PROMPT, m) == (0.0, 0)


def test_overloaded_worker_with_the_prefix_loses_to_an_idle_one():
    m = match(("busy", 64, 64, 64))
    assert order([view("busy", running=64, waiting=80), view("idle")], m) == ["idle", "busy"]
    # the scheduler's own in-flight count is load too (a burst before the next status report)
    assert order([view("busy", inflight=150), view("idle")], m) == ["idle", "busy"]


def test_lightly_loaded_worker_with_the_prefix_beats_an_idle_one():
    m = match(("warm", 64, 64, 64))
    assert order([view("warm", running=8, waiting=2), view("idle")], m) == ["warm", "idle"]


def test_gpu_hit_beats_cpu_hit_beats_disk_hit():
    m = match(("g", 64, 64, 64), ("c", 64, 0, 64), ("d", 64, 0, 0))
    assert order([view("d"), view("c"), view("g")], m) == ["g", "c", "d"]
    hits = {w: prefix_hit(w, PROMPT, m).hit for w in "gcd"}
    assert hits["g"] == pytest.approx(63 / 64)
    assert hits["c"] == pytest.approx(0.8 * 63 / 64)   # documented tier weights: GPU 1.0, CPU 0.8, disk 0.5
    assert hits["d"] == pytest.approx(0.5 * 63 / 64)


def test_kv_overflow_is_penalised():
    m = match(("full", 8, 8, 8))
    assert order([view("full", free=10), view("roomy")], m) == ["roomy", "full"]


def test_weights_change_the_trade_off():
    m = match(("busy", 64, 64, 64))
    workers = [view("busy", running=48, waiting=80), view("idle")]
    assert order(workers, m) == ["idle", "busy"]
    assert order(workers, m, CacheAware(RoutingWeights(hit_weight=5.0))) == ["busy", "idle"]


def test_no_or_unavailable_match_ranks_by_load_with_stable_ties():
    workers = [view("b", running=5), view("a", running=5), view("c", running=1)]
    assert order(workers, None) == ["c", "a", "b"]
    assert order(workers, MatchResponse(block_size=0, query_blocks=0, available=False)) == ["c", "a", "b"]
    # an unavailable answer that still names workers gives no credit
    stale = MatchResponse(block_size=16, query_blocks=64, workers=[WorkerMatch("b", 64, 64, 64)], available=False)
    assert order(workers, stale) == ["c", "a", "b"]


def test_unknown_kv_size_skips_the_kv_terms():
    m = match(("w", 64, 64, 64))
    assert order([view("w", free=0, total=0), view("x", free=0, total=0)], m) == ["w", "x"]


def test_round_robin_and_least_loaded_through_the_core():
    for policy, expect in (("round_robin", ["w1", "w2", "w1", "w2"]), ("least_loaded", ["w1", "w2", "w1", "w2"])):
        core = SchedulerCore(scorer=make_scorer(policy))
        core.set_workers([view("w1"), view("w2")])
        got = []
        for i in range(4):
            [d] = [e for e in core.submit(request(rid=f"{policy}{i}")) if isinstance(e.msg, Dispatch)]
            got.append(d.dest.split("//")[1].split(":")[0])
        assert got == expect, policy
    assert make_scorer("round_robin") is round_robin and make_scorer("least_loaded") is least_loaded
    with pytest.raises(ValueError):
        make_scorer("random")


def test_cache_aware_in_the_core_follows_the_hint_until_load_says_otherwise():
    core = SchedulerCore(scorer=make_scorer("cache_aware"), prefix_hints=PrefixHints())
    core.set_workers([view("w1", seqs=4), view("w2", seqs=4)])
    m = match(("w2", 64, 64, 64))
    dests = []
    for i in range(8):
        core.submit(request(rid=f"r{i}"))
        [d] = [e for e in core.prefix_matched(f"r{i}", m) if isinstance(e.msg, Dispatch)]
        dests.append(d.dest)
    # the prefix holder takes the first ones; once its queue grows the idle worker takes over
    assert dests[0] == "tcp://w2:1" and "tcp://w1:1" in dests
    assert pick([core.workers["w1"], core.workers["w2"]], request(), core.scorer, None).id in ("w1", "w2")


def test_routing_config_from_flags_and_env():
    cfg = parse_config(SchedulerConfig, ["--routing", "round_robin", "--route-hit-weight", "2.5"], "t",
                       env={"KVMESH_ROUTE_CPU_CREDIT": "0.6"})
    assert cfg.routing == "round_robin" and cfg.route_hit_weight == 2.5 and cfg.route_cpu_credit == 0.6
    from services.config import ConfigError
    with pytest.raises(ConfigError):
        parse_config(SchedulerConfig, [], "t", env={"KVMESH_ROUTING": "random"})
