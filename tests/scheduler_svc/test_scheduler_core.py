"""SchedulerCore without sockets: admission, priorities, routing, cancellation, failover."""
from __future__ import annotations

from scheduler_svc.core import Limits, SchedulerCore
from scheduler_svc.prefix_hints import PrefixHints
from scheduler_svc.routing import WorkerView
from services.protocol.kv_events import MatchResponse, WorkerMatch
from services.protocol.messages import (
    Abort, Admitted, Dispatch, Rejected, RequestFailed, Submit, WorkerStatus)
from services.protocol.sampling import SamplingParams

GW, DT = "tcp://gw:1", "tcp://detok:1"


def submit(rid: str, *, tenant: str = "t", priority: int = 0, prompt_len: int = 4, max_tokens: int = 8,
           first: int = 0) -> Submit:
    return Submit(request_id=rid, tenant=tenant, prompt_token_ids=list(range(first, first + prompt_len)),
                  params=SamplingParams(max_tokens=max_tokens), priority=priority, reply_addr=GW, detok_addr=DT)


def worker(wid: str, *, seqs: int = 2, epoch: int = 1, max_len: int = 100, role: str = "mixed") -> WorkerView:
    return WorkerView(id=wid, epoch=epoch, addr=f"tcp://{wid}:1", role=role, max_num_seqs=seqs, max_model_len=max_len)


def kinds(out):
    return [(e.dest, type(e.msg).__name__) for e in out]


def test_no_worker_is_503_with_retry_after():
    core = SchedulerCore()
    [env] = core.submit(submit("a"))
    assert isinstance(env.msg, Rejected) and env.msg.status == 503 and env.msg.retry_after_s >= 1


def test_admit_dispatch_and_finish():
    core = SchedulerCore()
    core.set_workers([worker("w1")])
    out = core.submit(submit("a"))
    assert kinds(out) == [("tcp://w1:1", "Dispatch"), (GW, "Admitted")]
    assert core.num_inflight == 1
    core.worker_status(WorkerStatus(worker_id="w1", epoch=1, running=0, waiting=0, free_blocks=10,
                                    cached_blocks=0, total_blocks=10, finished=["a"]))
    assert core.num_inflight == 0 and not core.requests and not core.tenant_inflight


def test_received_at_is_the_shells_read_time_or_now():
    """The dispatch stage starts when the shell read the Submit (before any prefix match it
    awaited); without one, when submit() ran (the core's clock)."""
    now = [100.0]
    core = SchedulerCore(Limits(worker_capacity_factor=1.0), clock=lambda: now[0])
    core.set_workers([worker("w1", seqs=1)])
    core.submit(submit("a"), received_at=99.5)
    now[0] = 101.0
    core.submit(submit("b"))                         # queued: no room
    assert core.requests["a"].received_at == 99.5 and core.requests["b"].received_at == 101.0
    now[0] = 102.0
    core.worker_status(WorkerStatus(worker_id="w1", epoch=1, running=0, waiting=0, free_blocks=1,
                                    cached_blocks=0, total_blocks=1, finished=["a"]))
    req = core.requests["b"]
    assert (req.received_at, req.dispatched_at) == (101.0, 102.0)   # its wait for room is in the stage


def test_context_length_is_400():
    core = SchedulerCore()
    core.set_workers([worker("w1", max_len=10)])
    [env] = core.submit(submit("a", prompt_len=8, max_tokens=5))
    assert env.msg.status == 400 and env.msg.code == "context_length_exceeded"


def test_queue_limits_429_and_priorities():
    core = SchedulerCore(Limits(max_queue=2, worker_capacity_factor=1.0))
    core.set_workers([worker("w1", seqs=1)])
    core.submit(submit("run"))                       # takes the only slot
    assert kinds(core.submit(submit("low", priority=5))) == [(GW, "Admitted")]
    assert kinds(core.submit(submit("high", priority=-1))) == [(GW, "Admitted")]
    [rej] = core.submit(submit("over"))
    assert rej.msg.status == 429 and rej.msg.code == "server_overloaded"
    out = core.worker_status(WorkerStatus(worker_id="w1", epoch=1, running=0, waiting=0, free_blocks=1,
                                          cached_blocks=0, total_blocks=1, finished=["run"]))
    assert [e.msg.request_id for e in out if isinstance(e.msg, Dispatch)] == ["high"]


def test_tenant_limit():
    core = SchedulerCore(Limits(max_tenant_inflight=2))
    core.set_workers([worker("w1")])
    core.submit(submit("a", tenant="k0"))
    core.submit(submit("b", tenant="k0"))
    [rej] = core.submit(submit("c", tenant="k0"))
    assert rej.msg.status == 429 and rej.msg.code == "rate_limit_exceeded"
    assert any(isinstance(e.msg, Admitted) for e in core.submit(submit("d", tenant="k1")))


def test_least_loaded_routing_and_scorer_hook():
    core = SchedulerCore()
    core.set_workers([worker("w1", seqs=4), worker("w2", seqs=4)])
    dests = [e.dest for rid in "abcd" for e in core.submit(submit(rid)) if isinstance(e.msg, Dispatch)]
    assert sorted(dests) == ["tcp://w1:1"] * 2 + ["tcp://w2:1"] * 2

    # a cache-aware scorer plugs in; the prefix index's answer reaches it as the hint
    by_hint = SchedulerCore(scorer=lambda w, r, hint=None: 0.0 if hint.blocks_for(w.id) else 1.0,
                            prefix_hints=PrefixHints())
    by_hint.set_workers([worker("w1", seqs=4), worker("w2", seqs=4)])
    dests = []
    for rid, holder in (("a", "w2"), ("b", "w2"), ("c", "w1")):
        by_hint.submit(submit(rid))
        answer = MatchResponse(block_size=16, query_blocks=1, workers=[WorkerMatch(holder, 1, 1, 1)])
        dests += [e.dest for e in by_hint.prefix_matched(rid, answer) if isinstance(e.msg, Dispatch)]
    assert dests == ["tcp://w2:1", "tcp://w2:1", "tcp://w1:1"]


def test_abort_queued_and_running():
    core = SchedulerCore(Limits(worker_capacity_factor=1.0))
    core.set_workers([worker("w1", seqs=1)])
    core.submit(submit("run"))
    core.submit(submit("queued"))
    [failed] = core.abort(Abort(request_id="queued", reason="shutdown"))   # its gateway ends the stream
    assert failed.dest == submit("queued").reply_addr and isinstance(failed.msg, RequestFailed)
    assert (failed.msg.request_id, failed.msg.status, failed.msg.code) == ("queued", 503, "shutdown")
    assert core.queue_depth == 0
    [fwd] = core.abort(Abort(request_id="run", index=1, reason="stop"))
    assert fwd.dest == "tcp://w1:1" and fwd.msg.index == 1
    assert core.abort(Abort(request_id="unknown")) == []
    # the stale heap entry of "queued" is skipped when a slot frees up
    core.submit(submit("next"))
    out = core.worker_status(WorkerStatus(worker_id="w1", epoch=1, running=0, waiting=0, free_blocks=1,
                                          cached_blocks=0, total_blocks=1, finished=["run"]))
    assert [e.msg.request_id for e in out if isinstance(e.msg, Dispatch)] == ["next"]


def test_dead_or_restarted_worker_fails_its_requests_that_may_not_move():
    core = SchedulerCore(Limits(max_migrations=0))
    core.set_workers([worker("w1"), worker("w2")])
    core.submit(submit("a"))
    core.submit(submit("b"))
    on_w1 = [rid for rid, r in core.requests.items() if r.worker_id == "w1"]
    out = core.set_workers([worker("w2")])
    failed = [e.msg.request_id for e in out if isinstance(e.msg, RequestFailed)]
    assert failed == on_w1 and all(e.msg.status == 503 for e in out if isinstance(e.msg, RequestFailed))
    assert [e.dest for e in out if isinstance(e.msg, Abort)] == [DT] * len(on_w1)
    # a new epoch of w2 means its old incarnation's requests are gone too
    out = core.set_workers([worker("w2", epoch=2)])
    assert {e.msg.request_id for e in out if isinstance(e.msg, RequestFailed)} == set("ab") - set(on_w1)
    assert not core.requests and core.worker_failures == 2
    # a status of the old epoch is ignored
    assert core.worker_status(WorkerStatus(worker_id="w2", epoch=1, running=9, waiting=0, free_blocks=0,
                                           cached_blocks=0, total_blocks=1)) == []
    assert core.workers["w2"].running == 0


def test_a_stale_epochs_status_is_refused_and_dispatches_name_the_epoch():
    """A worker paused past its lease rejoins with a new epoch; whatever its old incarnation still
    reports (finished lists, heartbeats listing what it held, load) must not touch the new one's
    requests, and each Dispatch names the incarnation it is meant for."""
    now = [0.0]
    core = SchedulerCore(Limits(max_migrations=0), clock=lambda: now[0])
    core.set_workers([worker("w1", epoch=1)])
    core.submit(submit("old"))
    out = core.set_workers([worker("w1", epoch=2)])          # rejoined: "old" fails
    assert [e.msg.request_id for e in out if isinstance(e.msg, RequestFailed)] == ["old"]
    [d] = [e.msg for e in core.submit(submit("new")) if isinstance(e.msg, Dispatch)]
    assert d.epoch == 2
    now[0] = SchedulerCore.RECONCILE_AFTER_S + 1
    stale = WorkerStatus(worker_id="w1", epoch=1, running=7, waiting=3, free_blocks=0, cached_blocks=0,
                         total_blocks=10, finished=["new"], active=[])
    assert core.worker_status(stale) == []
    assert "new" in core.requests and core.workers["w1"].inflight == {"new"}
    assert (core.workers["w1"].running, core.workers["w1"].waiting) == (0, 0)
    current = WorkerStatus(worker_id="w1", epoch=2, running=1, waiting=0, free_blocks=9, cached_blocks=0,
                           total_blocks=10, finished=["new"])
    core.worker_status(current)
    assert not core.requests and core.workers["w1"].running == 1


def test_draining_worker_gets_no_new_work():
    core = SchedulerCore()
    w = worker("w1")
    w.draining = True
    core.set_workers([w])
    [env] = core.submit(submit("a"))
    assert env.msg.status == 503


def test_lost_finished_reports_are_reconciled_from_heartbeats():
    now = [0.0]
    core = SchedulerCore(clock=lambda: now[0])
    core.set_workers([worker("w1")])
    core.submit(submit("a"))
    core.submit(submit("b"))
    beat = dict(worker_id="w1", epoch=1, running=1, waiting=0, free_blocks=1, cached_blocks=0, total_blocks=1)
    core.worker_status(WorkerStatus(**beat, active=["b"]))          # too soon: "a" may still be in flight
    assert set(core.requests) == {"a", "b"}
    now[0] = 10.0
    core.worker_status(WorkerStatus(**beat, active=["b"]))
    assert set(core.requests) == {"b"} and core.workers["w1"].inflight == {"b"}


def test_a_restarted_scheduler_counts_the_requests_workers_already_hold():
    """A new scheduler learns from each worker's heartbeat the requests an earlier one dispatched:
    they fill the worker's slots (no over-dispatch) until the worker reports them ended."""
    core = SchedulerCore(Limits(worker_capacity_factor=1.0))
    core.set_workers([worker("w1", seqs=2), worker("w2", seqs=2)])

    def status(wid: str, active: list[str] | None = None, finished: tuple[str, ...] = ()) -> WorkerStatus:
        return WorkerStatus(worker_id=wid, epoch=1, running=len(active or ()), waiting=0, free_blocks=10,
                            cached_blocks=0, total_blocks=10, finished=list(finished), active=active)

    core.worker_status(status("w1", ["old-1", "old-2"]))    # full with an earlier scheduler's work
    core.worker_status(status("w2", ["old-3"]))
    assert (core.workers["w1"].holding, core.workers["w2"].holding) == (2, 1)
    assert kinds(core.submit(submit("a"))) == [("tcp://w2:1", "Dispatch"), (GW, "Admitted")]
    assert kinds(core.submit(submit("b"))) == [(GW, "Admitted")]          # queued: no slot anywhere
    assert core.num_inherited == 3
    out = core.worker_status(status("w1", finished=("old-1",)))          # a step's report ends one
    assert kinds(out) == [("tcp://w1:1", "Dispatch")] and core.requests["b"].worker_id == "w1"
    core.worker_status(status("w2", ["a"]))                              # old-3 ended, its report lost
    assert not core.workers["w2"].inherited and core.num_inherited == 1


def test_cache_aware_scorer_prefers_the_prefix_holder_over_a_lighter_load():
    from scheduler_svc.routing import cache_aware

    core = SchedulerCore(scorer=cache_aware, prefix_hints=PrefixHints())
    core.set_workers([worker("w1", seqs=8), worker("w2", seqs=8)])
    core.submit(submit("busy"))
    core.prefix_matched("busy", None)                              # w1 (tie-break) gets one request
    match = MatchResponse(block_size=4, query_blocks=4, workers=[WorkerMatch("w1", 4, 4, 4)])
    core.submit(submit("p", prompt_len=16))
    out = core.prefix_matched("p", match)
    assert [e.dest for e in out if isinstance(e.msg, Dispatch)] == ["tcp://w1:1"]
    core.submit(submit("q", prompt_len=16, first=100))            # no match: least-loaded
    out = core.prefix_matched("q", None)
    assert [e.dest for e in out if isinstance(e.msg, Dispatch)] == ["tcp://w2:1"]


def test_split_salt_inverts_cache_salt_for():
    from services.protocol.kv_events import cache_salt_for, split_salt

    for tenant, salt in (("key0", ""), ("key1", "abc"), ("", "x:y"), ("k:2", "3:z")):
        assert split_salt(cache_salt_for(tenant, salt)) == (tenant, salt)
    assert split_salt("") == ("", "")
