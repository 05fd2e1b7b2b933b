"""Runs in the scheduler core: a request sent back to a worker that held an earlier run of it (the
other half of a hand-off that moved; an adoption after a restart) is told apart from that run by
the run number every Dispatch carries and every report echoes; a prefill worker that keeps a failed
hand-off (its decode worker silent, perhaps dead) holds the request alone, and whichever comes first,
its report or the decode worker's lease lapsing, the request runs once and its stream stays one."""
from __future__ import annotations

from scheduler_svc.core import Limits, SchedulerCore
from scheduler_svc.routing import WorkerView, cache_aware
from services.protocol.messages import Abort, AwaitKV, Dispatch, Migrate, Resume, Submit, WorkerStatus
from services.protocol.sampling import SamplingParams

GW, DT = "tcp://gw:1", "tcp://detok:1"
LAYOUT = {"model_id": "m", "block_size": 16, "kv_dtype": "float32", "num_layers": 2, "num_kv_heads": 2,
          "head_dim": 16, "tp_size": 1}
MIN = 64


def submit(rid: str, resubmitted: bool = False) -> Submit:
    return Submit(request_id=rid, tenant="t", prompt_token_ids=list(range(MIN + 1)),
                  params=SamplingParams(max_tokens=8, seed=3), reply_addr=GW, detok_addr=DT,
                  resubmitted=resubmitted)


def worker(wid: str, role: str) -> WorkerView:
    return WorkerView(id=wid, epoch=1, addr=f"tcp://{wid}:1#worker", role=role, max_num_seqs=8, max_model_len=4096,
                      kv_addr=f"tcp://{wid}:2#worker" if role == "decode" else "", kv_layout=LAYOUT)


def status(wid: str, finished: dict[str, int] | None = None, kept: dict[str, int] | None = None,
           active: dict[str, int] | None = None) -> WorkerStatus:
    finished, kept = finished or {}, kept or {}
    return WorkerStatus(worker_id=wid, epoch=1, running=0, waiting=0, free_blocks=10, cached_blocks=0,
                        total_blocks=10, finished=list(finished), finished_runs=list(finished.values()),
                        kept=list(kept), kept_runs=list(kept.values()),
                        active=None if active is None else list(active),
                        active_runs=None if active is None else list(active.values()))


def of(out, kind) -> list:
    return [(e.dest, e.msg) for e in out if isinstance(e.msg, kind)]


def paired() -> tuple[SchedulerCore, int]:
    """A core with prefill worker p and decode worker d, and request "a" in hand-off from p to d."""
    core = SchedulerCore(Limits(pd_min_prefill_tokens=MIN), scorer=cache_aware)
    core.inbox_addr = "tcp://sched:1"
    core.set_workers([worker("p", "prefill"), worker("d", "decode")])
    out = core.submit(submit("a"))
    [(_, await_kv)] = of(out, AwaitKV)
    [(_, dispatch)] = of(out, Dispatch)
    assert dispatch.run == await_kv.run == core.requests["a"].run    # both halves: one run
    return core, dispatch.run


def test_a_late_report_of_an_aborted_half_does_not_forget_the_run_sent_back_to_that_worker():
    core, first = paired()
    out = core.set_workers([worker("p", "prefill")])                # d died: a moves, p drops its half
    assert of(out, Abort) == [("tcp://p:1#worker", Abort(request_id="a", reason="moved"))]
    out = core.resumed(Resume(request_id="a", output_token_ids=[[5]]))
    [(addr, again)] = of(out, Dispatch)                             # p is the one worker left
    assert addr == "tcp://p:1#worker" and again.run != first and again.resume_output == [[5]]
    core.worker_status(status("p", finished={"a": first}))          # p's report of the aborted half
    assert core.requests["a"].worker_id == "p" and "a" in core.workers["p"].inflight
    core.worker_status(status("p", finished={"a": again.run}))
    assert "a" not in core.requests and not core.workers["p"].inflight


def test_a_kept_hand_off_leaves_the_request_to_p_and_the_decode_worker_s_death_changes_nothing():
    core, run = paired()
    out = core.worker_status(status("p", kept={"a": run}))
    assert of(out, Abort) == [("tcp://d:1#worker", Abort(request_id="a", reason="moved"))]   # d drops its half
    # d may have admitted it after all (its Ack late): the detokenizer leaves d, no move, no Resume
    [(_, leave)] = of(out, Migrate)
    assert (leave.worker_id, leave.worker_epoch, leave.resume) == ("d", 1, False)
    req = core.requests["a"]
    assert (req.worker_id, req.prefill_id) == ("p", None) and not core.workers["d"].inflight
    out = core.set_workers([worker("p", "prefill")])                # d's lease lapses afterwards
    assert not of(out, Migrate) and not of(out, Abort) and core.requests["a"].worker_id == "p"
    assert core.worker_status(status("p", kept={"a": run})) == []   # said twice: nothing more
    core.worker_status(status("p", finished={"a": run}))
    assert "a" not in core.requests and not core.workers["p"].inflight


def test_when_the_decode_worker_s_death_comes_first_the_move_stands_and_p_is_left_too():
    """p kept the request and streams on until the Abort "moved" reaches it: the Migrate names p
    too, so the detokenizer drops what p sends after it, and p's late report changes nothing."""
    core, run = paired()
    out = core.set_workers([worker("p", "prefill"), worker("m", "mixed")])   # d gone, m joins
    [(_, migrate)] = of(out, Migrate)
    assert (migrate.worker_id, migrate.also_worker_id, migrate.also_worker_epoch) == ("d", "p", 1)
    assert of(out, Abort) == [("tcp://p:1#worker", Abort(request_id="a", reason="moved"))]
    assert core.worker_status(status("p", kept={"a": run})) == []
    assert core.requests["a"].moving and core.requests["a"].worker_id is None
    out = core.resumed(Resume(request_id="a", output_token_ids=[[5, 6]]))
    [(addr, again)] = of(out, Dispatch)
    assert addr == "tcp://m:1#worker" and again.run != run
    core.worker_status(status("p", finished={"a": run}))
    assert core.requests["a"].worker_id == "m"


def test_a_request_adopted_after_a_restart_keeps_the_run_its_workers_report():
    core = SchedulerCore(Limits(pd_min_prefill_tokens=MIN), scorer=cache_aware)
    core.set_workers([worker("w", "mixed")])
    core.worker_status(status("w", active={"a": 41}))
    core.submit(submit("a", resubmitted=True))
    assert core.requests["a"].run == 41 and "a" in core.workers["w"].inflight
    core.worker_status(status("w", finished={"a": 40}, active={"a": 41}))   # another run's report
    assert "a" in core.requests
    core.worker_status(status("w", finished={"a": 41}))
    assert "a" not in core.requests


def test_reports_without_runs_count_as_before():
    """A worker that numbers no runs (an older one) sends none: its reports are taken as they come."""
    core, _ = paired()
    core.worker_status(WorkerStatus(worker_id="d", epoch=1, running=0, waiting=0, free_blocks=10,
                                    cached_blocks=0, total_blocks=10, finished=["a"]))
    assert core.requests["a"].worker_id == "p"          # d let go first: p decodes it (D had no room)


def test_a_kept_hand_off_that_ends_before_its_status_goes_out_is_forgotten_and_d_drops_its_half():
    """p keeps the hand-off and the request ends in its next step: one status lists it as kept and
    finished. Nothing of it stays on d (its slot, its awaited KV): d is told to drop its half."""
    core, run = paired()
    out = core.worker_status(status("p", finished={"a": run}, kept={"a": run}))
    assert of(out, Abort) == [("tcp://d:1#worker", Abort(request_id="a", reason="moved"))]
    assert "a" not in core.requests and not core.workers["p"].inflight and not core.workers["d"].inflight
