"""rank_workers: prefix hits against load, tier credits, KV overflow, configurable weights."""
from __future__ import annotations

from prefix_cache_svc.routing import RoutingWeights, WorkerLoad, rank_workers
from services.protocol.kv_events import MatchResponse, WorkerMatch

PROMPT = 1024  # tokens: 64 blocks of 16


def load(wid, running=0, waiting=0, free=1000, total=1000, seqs=64):
    return WorkerLoad(wid, running, waiting, free, total, seqs)


def match(*workers):
    return MatchResponse(block_size=16, query_blocks=64, workers=[WorkerMatch(*w) for w in workers])


def order(ranked):
    return [s.worker_id for s in ranked]


def test_equal_load_longer_prefix_wins():
    m = match(("a", 64, 64, 64), ("b", 10, 10, 10))
    ranked = rank_workers([load("b"), load("a"), load("c")], m, PROMPT)
    assert order(ranked) == ["a", "b", "c"]
    # the block holding the last prompt token is always recomputed: at most 63 of 64 blocks saved
    assert ranked[0].hit == 63 / 64 and ranked[0].cached_tokens == 1008 and ranked[2].cached_tokens == 0


def test_overloaded_worker_with_the_prefix_loses_to_an_idle_one():
    m = match(("busy", 64, 64, 64))
    ranked = rank_workers([load("busy", running=64, waiting=80), load("idle")], m, PROMPT)
    assert order(ranked) == ["idle", "busy"]


def test_lightly_loaded_worker_with_the_prefix_beats_an_idle_one():
    m = match(("warm", 64, 64, 64))
    ranked = rank_workers([load("warm", running=8, waiting=2), load("idle")], m, PROMPT)
    assert order(ranked) == ["warm", "idle"]


def test_gpu_hit_beats_cpu_hit_beats_disk_hit():
    m = match(("g", 64, 64, 64), ("c", 64, 0, 64), ("d", 64, 0, 0))
    assert order(rank_workers([load("d"), load("c"), load("g")], m, PROMPT)) == ["g", "c", "d"]


def test_kv_overflow_is_penalised():
    m = match(("full", 8, 8, 8))
    ranked = rank_workers([load("full", free=10), load("roomy")], m, PROMPT)
    assert order(ranked) == ["roomy", "full"]


def test_weights_change_the_trade_off():
    m = match(("busy", 64, 64, 64))
    loads = [load("busy", running=48, waiting=80), load("idle")]
    assert order(rank_workers(loads, m, PROMPT)) == ["idle", "busy"]
    greedy = RoutingWeights(hit_weight=5.0)
    assert order(rank_workers(loads, m, PROMPT, greedy)) == ["busy", "idle"]


def test_no_match_info_ranks_by_load_with_stable_ties():
    loads = [load("b", running=5), load("a", running=5), load("c", running=1)]
    assert order(rank_workers(loads, None, PROMPT)) == ["c", "a", "b"]
    unavailable = MatchResponse(block_size=16, query_blocks=0, available=False)
    assert order(rank_workers(loads, unavailable, PROMPT)) == ["c", "a", "b"]


def test_prefix_scorer_adapts_the_schedulers_worker_view():
    from types import SimpleNamespace

    from prefix_cache_svc.routing import prefix_scorer

    def view(wid, running=0, waiting=0):
        return SimpleNamespace(id=wid, running=running, waiting=waiting, free_blocks=500,
                               cached_blocks=500, total_blocks=1000, max_num_seqs=64)

    m = match(("warm", 64, 64, 64))
    scorer = prefix_scorer(m, PROMPT)
    workers = [view("idle"), view("warm", running=4)]
    assert min(workers, key=lambda w: (scorer(w, None), w.id)).id == "warm"
    assert min([view("idle"), view("warm", running=64, waiting=100)],
               key=lambda w: (scorer(w, None), w.id)).id == "idle"
