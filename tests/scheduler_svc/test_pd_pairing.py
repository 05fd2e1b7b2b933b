"""Prefill/decode pairing in the scheduler core: the skip-P rule, layout checks, a request in
flight on two workers, aborts to both, a worker of the pair dying."""
from __future__ import annotations

import logging

from scheduler_svc.core import Limits, SchedulerCore
from scheduler_svc.routing import WorkerView, cache_aware, route
from services.protocol.kv_events import MatchResponse, WorkerMatch
from services.protocol.messages import Abort, AwaitKV, Dispatch, RequestFailed, Submit, WorkerStatus
from services.protocol.sampling import SamplingParams

GW, DT = "tcp://gw:1", "tcp://detok:1"
LAYOUT = {"model_id": "m", "block_size": 16, "kv_dtype": "float32", "num_layers": 2, "num_kv_heads": 2,
          "head_dim": 16, "tp_size": 1}
MIN = 64


def submit(rid: str, prompt_len: int) -> Submit:
    return Submit(request_id=rid, tenant="t", prompt_token_ids=list(range(prompt_len)),
                  params=SamplingParams(max_tokens=8, n=2), reply_addr=GW, detok_addr=DT)


def worker(wid: str, role: str, layout: dict | None = LAYOUT, inflight: int = 0, transport: str = "zmq") -> WorkerView:
    return WorkerView(id=wid, epoch=1, addr=f"tcp://{wid}:1#worker", role=role, max_num_seqs=8, max_model_len=4096,
                      kv_addr=f"tcp://{wid}:2#worker" if role == "decode" else "", kv_layout=layout,
                      inflight={f"{wid}-{i}" for i in range(inflight)}, kv_transport=transport)


def core_with(*views: WorkerView) -> SchedulerCore:
    """Requests here never move to another worker (test_migration.py has those that do)."""
    core = SchedulerCore(Limits(pd_min_prefill_tokens=MIN, max_migrations=0), scorer=cache_aware)
    core.set_workers(list(views))
    return core


def messages(out, kind):
    return [(e.dest, e.msg) for e in out if isinstance(e.msg, kind)]


def status(wid: str, finished: list[str]) -> WorkerStatus:
    return WorkerStatus(worker_id=wid, epoch=1, running=0, waiting=0, free_blocks=10, cached_blocks=0,
                        total_blocks=10, finished=finished)


def test_a_long_prompt_is_prefilled_on_p_and_awaited_on_d():
    core = core_with(worker("p", "prefill"), worker("d", "decode"))
    out = core.submit(submit("a", MIN + 1))
    [(d_addr, await_kv)] = messages(out, AwaitKV)
    [(p_addr, dispatch)] = messages(out, Dispatch)
    assert (d_addr, p_addr) == ("tcp://d:1#worker", "tcp://p:1#worker")
    assert dispatch.handoff_to == "tcp://d:2#worker" and await_kv.n == 2 and await_kv.detok_addr == DT
    assert [e.msg for e in out].index(await_kv) < [e.msg for e in out].index(dispatch)   # D awaits first
    assert "a" in core.workers["p"].inflight and "a" in core.workers["d"].inflight


def test_a_short_prompt_runs_on_d_alone():
    core = core_with(worker("p", "prefill"), worker("d", "decode"))
    out = core.submit(submit("a", MIN - 1))
    [(addr, dispatch)] = messages(out, Dispatch)
    assert addr == "tcp://d:1#worker" and dispatch.handoff_to == "" and not messages(out, AwaitKV)


def test_a_prompt_d_mostly_holds_runs_on_d_alone():
    """D caches all but fewer than MIN tokens of it: computing those there beats moving the KV."""
    p, d = worker("p", "prefill"), worker("d", "decode")
    request = submit("a", 20 * 16)
    held = MatchResponse(block_size=16, query_blocks=20, workers=[WorkerMatch("d", 17, 17, 17)])
    assert route([d], [p], request, cache_aware, held, MIN).label == "decode_cached"
    little = MatchResponse(block_size=16, query_blocks=20, workers=[WorkerMatch("d", 4, 4, 4)])
    chosen = route([d], [p], request, cache_aware, little, MIN)
    assert chosen.label == "pd" and chosen.prefill is p and chosen.worker is d


def test_mismatched_layouts_are_never_paired(caplog):
    other = {**LAYOUT, "kv_dtype": "bfloat16"}
    with caplog.at_level(logging.ERROR, logger="kvmesh.scheduler"):
        core = core_with(worker("d", "decode"), worker("p", "prefill", layout=other))
    assert "has a KV layout no decode worker shares" in caplog.text and "bfloat16" in caplog.text
    out = core.submit(submit("a", MIN + 100))
    [(addr, dispatch)] = messages(out, Dispatch)
    assert addr == "tcp://d:1#worker" and dispatch.handoff_to == "" and not messages(out, AwaitKV)
    # a worker without a layout (the null engine) is never paired either
    core = core_with(worker("d", "decode", layout=None), worker("p", "prefill", layout=None))
    assert not messages(core.submit(submit("b", MIN + 100)), AwaitKV)


def test_a_rolling_upgrade_pairs_old_weights_with_old_and_new_with_new(caplog):
    """Same name, same shapes, other weights: the prefill worker's KV would be wrong on the other."""
    old, new = {**LAYOUT, "weights_digest": "0" * 32}, {**LAYOUT, "weights_digest": "f" * 32}
    with caplog.at_level(logging.ERROR, logger="kvmesh.scheduler"):
        core = core_with(worker("d-old", "decode", layout=old), worker("p-new", "prefill", layout=new))
    assert "it loads other weights than they do" in caplog.text and "weights_digest: 'fff" in caplog.text
    [(addr, dispatch)] = messages(core.submit(submit("a", MIN + 100)), Dispatch)
    assert addr == "tcp://d-old:1#worker" and dispatch.handoff_to == ""        # computed on D itself
    core.set_workers(list(core.workers.values()) + [worker("d-new", "decode", layout=new, inflight=7),
                                                    worker("p-old", "prefill", layout=old, inflight=7)])
    for rid in ("b", "c", "e", "f"):
        out = core.submit(submit(rid, MIN + 100))
        [(d_addr, _)] = messages(out, AwaitKV)
        [(p_addr, _)] = messages(out, Dispatch)
        assert (p_addr.split(":")[1], d_addr.split(":")[1]) in (("//p-new", "//d-new"), ("//p-old", "//d-old"))


def test_workers_of_different_kv_transports_are_never_paired(caplog):
    with caplog.at_level(logging.ERROR, logger="kvmesh.scheduler"):
        core = core_with(worker("d", "decode"), worker("p", "prefill", transport="nixl"))
    assert "--kv-transport nixl, which no decode worker of its KV layout uses (theirs: zmq)" in caplog.text
    [(addr, dispatch)] = messages(core.submit(submit("a", MIN + 100)), Dispatch)
    assert addr == "tcp://d:1#worker" and dispatch.handoff_to == ""
    core = core_with(worker("d", "decode", transport="nixl"), worker("p", "prefill", transport="nixl"))
    [(addr, dispatch)] = messages(core.submit(submit("b", MIN + 100)), Dispatch)
    assert addr == "tcp://p:1#worker" and dispatch.handoff_to == "tcp://d:2#worker"


def test_mixed_workers_serve_beside_the_pools():
    core = core_with(worker("p", "prefill"), worker("d", "decode", inflight=6), worker("m", "mixed"))
    [(addr, dispatch)] = messages(core.submit(submit("a", MIN + 1)), Dispatch)
    assert addr == "tcp://m:1#worker" and dispatch.handoff_to == ""      # the idle mixed worker


def test_prefill_workers_run_whole_requests_without_decode_workers():
    core = core_with(worker("p", "prefill"))
    [(addr, dispatch)] = messages(core.submit(submit("a", MIN + 1)), Dispatch)
    assert addr == "tcp://p:1#worker" and dispatch.handoff_to == ""


def test_the_request_ends_when_d_reports_it_and_p_leaving_keeps_it():
    core = core_with(worker("p", "prefill"), worker("d", "decode"))
    core.submit(submit("a", MIN + 1))
    core.worker_status(status("p", ["a"]))            # hand-off done: P holds nothing of it
    assert "a" in core.requests and "a" not in core.workers["p"].inflight and "a" in core.workers["d"].inflight
    core.worker_status(status("d", ["a"]))
    assert "a" not in core.requests and not core.workers["d"].inflight


def test_d_leaving_first_leaves_the_request_with_p():
    """D had no free blocks for the KV: it lets go, P decodes the request itself; aborts and P's
    death reach P from then on, and P's report ends the request."""
    core = core_with(worker("p", "prefill"), worker("d", "decode"))
    core.submit(submit("a", MIN + 1))
    core.worker_status(status("d", ["a"]))
    assert "a" in core.requests and "a" in core.workers["p"].inflight and "a" not in core.workers["d"].inflight
    assert [e.dest for e in core.abort(Abort(request_id="a"))] == ["tcp://p:1#worker"]
    core.worker_status(status("p", ["a"]))
    assert "a" not in core.requests and not core.workers["p"].inflight
    core.submit(submit("b", MIN + 1))
    core.worker_status(status("d", ["b"]))
    out = core.set_workers([worker("d", "decode")])      # P dies while decoding b
    [(gw, failed)] = messages(out, RequestFailed)
    assert gw == GW and failed.code == "worker_failed" and "b" not in core.requests


def test_an_abort_reaches_both_workers_and_only_its_request():
    core = core_with(worker("p", "prefill"), worker("d", "decode"))
    core.submit(submit("a", MIN + 1))
    core.submit(submit("b", MIN + 1))
    out = core.abort(Abort(request_id="a"))
    assert sorted((e.dest, e.msg.request_id) for e in out) == [("tcp://d:1#worker", "a"), ("tcp://p:1#worker", "a")]
    core.worker_status(status("p", ["b"]))
    assert core.abort(Abort(request_id="b"))[0].dest == "tcp://d:1#worker"   # P is done with b: D only


def test_a_dead_decode_worker_fails_its_requests_and_frees_p():
    core = core_with(worker("p", "prefill"), worker("d", "decode"))
    core.submit(submit("a", MIN + 1))
    out = core.set_workers([worker("p", "prefill")])   # D's lease lapsed
    assert [(d, m.request_id) for d, m in messages(out, Abort)] == [("tcp://p:1#worker", "a"), (DT, "a")]
    [(gw, failed)] = messages(out, RequestFailed)
    assert gw == GW and failed.code == "worker_failed"
    assert "a" not in core.requests and not core.workers["p"].inflight


def test_a_dead_prefill_worker_s_request_is_re_run_on_its_decode_worker():
    """The client may hold the first token already: D recomputes the request with the seed the
    scheduler fixed at pairing (so the same tokens) and the detokenizer skips what was streamed."""
    core = core_with(worker("p", "prefill"), worker("d", "decode"))
    out = core.submit(submit("a", MIN + 1))
    [(_, first)] = messages(out, Dispatch)
    assert first.params.seed is not None          # fixed at pairing: any re-run draws the same tokens
    out = core.set_workers([worker("d", "decode")])   # P's lease lapsed
    [(addr, rerun)] = messages(out, Dispatch)
    assert addr == "tcp://d:1#worker" and rerun.resumes and rerun.handoff_to == ""
    assert rerun.params == first.params and not messages(out, RequestFailed) and not messages(out, Abort)
    assert core.requests["a"].prefill_id is None and "a" in core.workers["d"].inflight
    core.worker_status(status("d", ["a"]))
    assert "a" not in core.requests


def test_both_workers_of_a_pair_dead_fail_the_request():
    core = core_with(worker("p", "prefill"), worker("d", "decode"), worker("m", "mixed", inflight=8))
    core.submit(submit("a", MIN + 1))
    assert core.requests["a"].prefill_id == "p"
    out = core.set_workers([worker("m", "mixed", inflight=8)])
    [(gw, failed)] = messages(out, RequestFailed)
    assert gw == GW and failed.code == "worker_failed" and not messages(out, Dispatch)
    assert "a" not in core.requests


def test_unpaired_null_engines_are_explained_not_listed_as_empty_differences(caplog):
    """`kvmesh serve --null-model` with prefill and decode pools: the null engine publishes no KV
    layout, so the pools serve unpaired; the log says why instead of an empty list of differences."""
    with caplog.at_level(logging.INFO, logger="kvmesh.scheduler"):
        core_with(worker("d", "decode", layout=None), worker("p", "prefill", layout=None))
    assert "holds no KV to move (the null model)" in caplog.text
    assert "differs from" not in caplog.text
