"""SchedulerCore moving a request mid-stream: its worker died or handed it back while draining."""
from __future__ import annotations

from scheduler_svc.core import Limits, SchedulerCore
from scheduler_svc.routing import WorkerView
from services.protocol.messages import (
    Abort, Dispatch, Migrate, Moved, RequestFailed, Resume, Submit, WorkerStatus)
from services.protocol.sampling import SamplingParams

GW, DT, ME = "tcp://gw:1", "tcp://detok:1", "tcp://sched:1"


def submit(rid: str, n: int = 1, prompt_len: int = 4) -> Submit:
    return Submit(request_id=rid, tenant="t", prompt_token_ids=list(range(prompt_len)),
                  params=SamplingParams(max_tokens=8, n=n, seed=7, temperature=0.8), reply_addr=GW, detok_addr=DT)


def worker(wid: str, *, draining: bool = False, role: str = "mixed", epoch: int = 1) -> WorkerView:
    return WorkerView(id=wid, epoch=epoch, addr=f"tcp://{wid}:1", role=role, max_num_seqs=4, max_model_len=100,
                      draining=draining)


def core_with(*workers: WorkerView, max_migrations: int = 3, migration_wait_s: float = 60.0,
              clock=None) -> SchedulerCore:
    core = SchedulerCore(Limits(max_migrations=max_migrations, migration_wait_s=migration_wait_s),
                         **({"clock": clock} if clock else {}))
    core.inbox_addr = ME
    core.set_workers(list(workers))
    return core


def messages(out, kind):
    return [(e.dest, e.msg) for e in out if isinstance(e.msg, kind)]


def status(wid: str, *, finished=(), handed_back=(), active=None) -> WorkerStatus:
    return WorkerStatus(worker_id=wid, epoch=1, running=0, waiting=0, free_blocks=10, cached_blocks=0,
                        total_blocks=10, finished=list(finished), handed_back=list(handed_back), active=active)


def test_a_dead_workers_request_moves_on_from_the_tokens_its_detokenizer_has():
    core = core_with(worker("w1"), worker("w2"))
    [(first_addr, first)] = messages(core.submit(submit("a", n=2)), Dispatch)
    dead = first_addr.split("//")[1].split(":")[0]
    live = "w2" if dead == "w1" else "w1"
    out = core.set_workers([worker(live)])
    # nothing fails: the detokenizer is asked where the stream stands, naming the worker left
    assert not messages(out, RequestFailed) and not messages(out, Dispatch)
    [(addr, mig)] = messages(out, Migrate)
    assert (addr, mig.worker_id, mig.reply_addr) == (DT, dead, ME)
    out = core.resumed(Resume(request_id="a", output_token_ids=[[5, 6, 7], [8]], ended=[1]))
    [(addr, moved)] = messages(out, Dispatch)
    assert addr == f"tcp://{live}:1" and moved.resumes and moved.handoff_to == ""
    assert moved.prompt_token_ids == first.prompt_token_ids and moved.params == first.params   # same seed
    assert moved.resume_output == [[5, 6, 7], [8]] and moved.resume_ended == [1]
    assert core.requests["a"].worker_id == live and core.requests["a"].migrations == 1
    core.worker_status(status(live, finished=["a"]))
    assert not core.requests and core.num_inflight == 0 and not core.tenant_inflight


def test_a_request_moved_max_migrations_times_or_with_no_worker_left_fails():
    core = core_with(worker("w1"), worker("w2"), max_migrations=1)
    core.submit(submit("a"))
    on = core.requests["a"].worker_id
    other = "w2" if on == "w1" else "w1"
    core.set_workers([worker(other)])
    core.resumed(Resume(request_id="a", output_token_ids=[[1]]))
    assert core.requests["a"].worker_id == other
    out = core.set_workers([worker(on, epoch=2)])        # its second worker died too: the limit is 1
    [(gw, failed)] = messages(out, RequestFailed)
    assert gw == GW and failed.code == "worker_failed" and [d for d, _ in messages(out, Abort)] == [DT]
    assert not core.requests and not core.tenant_inflight
    # no worker left when the Resume comes back, and no wait for one (--migration-wait-s 0): it fails then
    core = core_with(worker("w1"), migration_wait_s=0)
    core.submit(submit("b"))
    assert messages(core.set_workers([]), Migrate)
    out = core.resumed(Resume(request_id="b", output_token_ids=[[1, 2]]))
    assert [type(m).__name__ for _, m in messages(out, (RequestFailed, Abort))] == ["RequestFailed", "Abort"]
    assert not core.requests


def test_a_moved_request_with_no_worker_left_waits_for_one_to_join_then_fails_past_the_wait():
    now = [0.0]
    core = core_with(worker("w1"), migration_wait_s=30, clock=lambda: now[0])
    core.submit(submit("a"))
    core.submit(submit("b"))
    assert len(messages(core.set_workers([]), Migrate)) == 2           # the last worker died
    for rid in ("a", "b"):
        out = core.resumed(Resume(request_id=rid, output_token_ids=[[1, 2]]))
        assert not messages(out, RequestFailed) and not messages(out, Dispatch)
    assert core.queue_depth == 2
    now[0] = 31.0                                                      # past the wait, as the worker comes back:
    core.abort(Abort(request_id="b"))                                  # (b's client left meanwhile)
    out = core.set_workers([worker("w1", epoch=2)])                    # it takes them first
    [(addr, moved)] = messages(out, Dispatch)
    assert addr == "tcp://w1:1" and moved.request_id == "a" and moved.resume_output == [[1, 2]]
    assert core.queue_depth == 0 and not messages(out, RequestFailed)
    core.worker_status(WorkerStatus(worker_id="w1", epoch=2, running=0, waiting=0, free_blocks=10, cached_blocks=0,
                                    total_blocks=10, finished=["a"], finished_runs=[moved.run]))
    assert not core.requests
    # the next one waits in vain: past the wait, its client gets the error
    core.submit(submit("c"))
    assert messages(core.set_workers([]), Migrate)
    core.resumed(Resume(request_id="c", output_token_ids=[[3]]))
    now[0] = 60.0
    assert not messages(core.set_workers([]), RequestFailed)
    now[0] = 62.0
    out = core.set_workers([])
    [(gw, failed)] = messages(out, RequestFailed)
    assert gw == GW and failed.code == "worker_failed" and [d for d, _ in messages(out, Abort)] == [DT]
    assert not core.requests and core.queue_depth == 0 and not core.tenant_inflight
    assert not messages(core.set_workers([worker("w1", epoch=3)]), Dispatch)    # nothing left to send


def test_max_migrations_0_fails_at_once_as_before():
    core = core_with(worker("w1"), max_migrations=0)
    core.submit(submit("a"))
    out = core.set_workers([])
    assert not messages(out, Migrate) and messages(out, RequestFailed) and not core.requests


def test_a_drained_request_moves_and_the_draining_worker_gets_nothing_new():
    core = core_with(worker("w1"), worker("w2"))
    core.submit(submit("a"))
    on = core.requests["a"].worker_id
    other = "w2" if on == "w1" else "w1"
    core.set_workers([worker(on, draining=True), worker(other)])
    out = core.worker_status(status(on, handed_back=["a"]))
    [(_, mig)] = messages(out, Migrate)
    assert mig.worker_id == on and "a" not in core.workers[on].inflight
    [(addr, _)] = messages(core.resumed(Resume(request_id="a", output_token_ids=[[3, 4]])), Dispatch)
    assert addr == f"tcp://{other}:1"


def test_a_hand_back_marks_its_worker_draining_before_its_record_says_so():
    """The drain window can close before the scheduler reads the worker's `draining` record: the
    moved request must not go back to the worker that handed it back (it would hand it back again,
    each time one more migration, until the request fails), and a record read before the drain
    began does not clear it."""
    core = core_with(worker("w1"), worker("w2"))
    core.submit(submit("a"))
    on = core.requests["a"].worker_id
    other = "w2" if on == "w1" else "w1"
    core.worker_status(status(other))        # both idle again: least loaded would pick either
    out = core.worker_status(status(on, handed_back=["a"]))
    assert messages(out, Migrate) and core.workers[on].draining
    core.set_workers([worker(on), worker(other)])                     # a stale record: not draining
    assert core.workers[on].draining
    [(addr, _)] = messages(core.resumed(Resume(request_id="a", output_token_ids=[[3, 4]])), Dispatch)
    assert addr == f"tcp://{other}:1"


def test_a_heartbeat_that_overtakes_the_hand_back_moves_the_request_once():
    """The heartbeat and the step's status travel on two sockets: a heartbeat that no longer lists
    a handed-back request in `active` names it in `handed_back`, so it moves instead of being
    forgotten, and the step's status that follows moves nothing twice."""
    clock = [0.0]
    core = core_with(worker("w1"), worker("w2"))
    core.clock = lambda: clock[0]
    core.submit(submit("a"))
    on = core.requests["a"].worker_id
    clock[0] = core.RECONCILE_AFTER_S + 1
    out = core.worker_status(status(on, active=[], handed_back=["a"]))
    [(_, mig)] = messages(out, Migrate)
    assert mig.worker_id == on and "a" in core.requests
    assert not messages(core.worker_status(status(on, handed_back=["a"])), Migrate)
    assert not messages(core.worker_status(status(on, active=[], handed_back=["a"])), Migrate)
    [(addr, _)] = messages(core.resumed(Resume(request_id="a", output_token_ids=[[3]])), Dispatch)
    assert addr != f"tcp://{on}:1"


def test_a_client_abort_while_moving_frees_the_request_and_its_stream():
    core = core_with(worker("w1"), worker("w2"))
    core.submit(submit("a"))
    core.set_workers([w for w in (worker("w1"), worker("w2")) if w.id != core.requests["a"].worker_id])
    out = core.abort(Abort(request_id="a"))
    assert sorted(d for d, _ in out) == sorted([GW, DT]) and not core.requests
    assert core.resumed(Resume(request_id="a", output_token_ids=[[1]])) == []   # late: nothing happens


def test_a_stream_the_detokenizer_does_not_hold_runs_from_its_start_and_an_ended_one_is_forgotten():
    core = core_with(worker("w1"), worker("w2"))
    core.submit(submit("a"))
    core.set_workers([w for w in (worker("w1"), worker("w2")) if w.id != core.requests["a"].worker_id])
    out = core.resumed(Resume(request_id="a", output_token_ids=[], known=False))
    [(_, rerun)] = messages(out, Dispatch)
    assert rerun.resumes and rerun.resume_output == []
    # its gateway is told, ahead of the Dispatch, so that it times the client's wait from the Submit
    assert [(e.dest, type(e.msg)) for e in out] == [(GW, Moved), (f"tcp://{core.requests['a'].worker_id}:1", Dispatch)]
    core = core_with(worker("w1"), worker("w2"))
    core.submit(submit("b", n=2))
    core.set_workers([w for w in (worker("w1"), worker("w2")) if w.id != core.requests["b"].worker_id])
    assert core.resumed(Resume(request_id="b", output_token_ids=[[1], [2]], ended=[0, 1])) == []
    assert not core.requests


def test_a_dead_decode_worker_frees_its_prefill_worker_and_moves_the_request():
    p = worker("p", role="prefill")
    p.kv_layout = {"x": 1}
    d = worker("d", role="decode")
    d.kv_layout, d.kv_addr = {"x": 1}, "tcp://d:2#worker"
    m = worker("m")
    core = SchedulerCore(Limits(pd_min_prefill_tokens=1))
    core.inbox_addr = ME
    core.set_workers([p, d])
    core.submit(submit("a", prompt_len=8))
    assert core.requests["a"].prefill_id == "p"
    out = core.set_workers([worker("p", role="prefill"), m])
    assert [(dest, type(msg).__name__) for dest, msg in messages(out, (Abort, Migrate))] == [
        ("tcp://p:1", "Abort"), (DT, "Migrate")]
    [(addr, moved)] = messages(core.resumed(Resume(request_id="a", output_token_ids=[[9]])), Dispatch)
    assert addr == "tcp://m:1" and moved.handoff_to == ""     # a moved stream runs whole


def test_a_stream_its_detokenizer_holds_is_timed_there_and_its_gateway_is_not_told():
    core = core_with(worker("w1"), worker("w2"))
    core.submit(submit("a"))
    core.set_workers([w for w in (worker("w1"), worker("w2")) if w.id != core.requests["a"].worker_id])
    out = core.resumed(Resume(request_id="a", output_token_ids=[[3, 4]]))
    assert messages(out, Dispatch) and not messages(out, Moved)
