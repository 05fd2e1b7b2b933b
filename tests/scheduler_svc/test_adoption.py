"""SchedulerCore after a restart: its gateways send their live requests again (Submit.resubmitted).
One a worker lists as held is adopted there (so it can move when that worker dies); one no worker
holds moves from its stream's tokens once every worker has said what it holds."""
from __future__ import annotations

import msgspec

from scheduler_svc.core import Limits, SchedulerCore
from scheduler_svc.routing import WorkerView
from services.protocol.messages import (
    Abort, Admitted, Dispatch, Migrate, RequestFailed, Resume, Submit, WorkerStatus)
from services.protocol.sampling import SamplingParams

GW, DT, ME = "tcp://gw:1", "tcp://detok:1", "tcp://sched:1"


def resubmit(rid: str) -> Submit:
    return Submit(request_id=rid, tenant="t", prompt_token_ids=[1, 2, 3, 4], reply_addr=GW, detok_addr=DT,
                  params=SamplingParams(max_tokens=8, seed=7, temperature=0.8), resubmitted=True)


def worker(wid: str) -> WorkerView:
    return WorkerView(id=wid, epoch=1, addr=f"tcp://{wid}:1", max_num_seqs=4, max_model_len=100)


def heartbeat(wid: str, *active: str, finished=()) -> WorkerStatus:
    return WorkerStatus(worker_id=wid, epoch=1, running=len(active), waiting=0, free_blocks=10, cached_blocks=0,
                        total_blocks=10, finished=list(finished), active=list(active))


def kinds(out) -> list[tuple[str, str]]:
    return sorted((e.dest, type(e.msg).__name__) for e in out)


def fresh_core(*wids: str) -> SchedulerCore:
    core = SchedulerCore(Limits())
    core.inbox_addr = ME
    core.set_workers([worker(w) for w in wids])
    return core


def test_a_held_request_is_adopted_and_moves_when_its_worker_dies():
    core = fresh_core("w1", "w2")
    core.worker_status(heartbeat("w1", "held"))
    assert set(core.workers["w1"].inherited) == {"held"}
    assert kinds(core.submit(resubmit("held"))) == [(GW, "Admitted")]          # no second run
    assert core.requests["held"].worker_id == "w1" and core.workers["w1"].inflight == {"held"}
    assert not core.workers["w1"].inherited and core.num_inherited == 0
    assert kinds(core.submit(resubmit("held"))) == [(GW, "Admitted")]          # sent twice: still one
    out = core.set_workers([worker("w2")])                                      # w1 dies: it moves
    [mig] = [e.msg for e in out if isinstance(e.msg, Migrate)]
    assert (mig.worker_id, mig.reply_addr) == ("w1", ME)
    [dispatch] = [e for e in core.resumed(Resume(request_id="held", output_token_ids=[[5, 6]]))
                  if isinstance(e.msg, Dispatch)]
    assert dispatch.dest == "tcp://w2:1" and dispatch.msg.resume_output == [[5, 6]]


def test_a_request_no_worker_holds_waits_for_every_report_then_moves_from_its_tokens():
    core = fresh_core("w1", "w2")
    core.worker_status(heartbeat("w1"))
    assert core.submit(resubmit("lost")) == []                # w2 may hold it: not heard from yet
    out = core.worker_status(heartbeat("w2"))                 # nobody holds it: its worker died
    assert kinds(out) == [(DT, "Migrate"), (GW, "Admitted")]
    [mig] = [e.msg for e in out if isinstance(e.msg, Migrate)]
    assert mig.worker_id == "" and mig.reply_addr == ME       # the detokenizer drops whoever streamed it
    [dispatch] = [e.msg for e in core.resumed(Resume(request_id="lost", output_token_ids=[[9]]))
                  if isinstance(e.msg, Dispatch)]
    assert dispatch.resumes and dispatch.resume_output == [[9]]
    assert core.requests["lost"].migrations == 1


def test_a_request_that_never_reached_a_worker_runs_from_its_start():
    core = fresh_core("w1")
    core.worker_status(heartbeat("w1"))
    out = core.submit(resubmit("queued"))
    assert kinds(out) == [(DT, "Migrate"), (GW, "Admitted")]
    out = core.resumed(Resume(request_id="queued", output_token_ids=[], known=False))
    [dispatch] = [e.msg for e in out if isinstance(e.msg, Dispatch)]
    assert dispatch.resume_output == [] and dispatch.prompt_token_ids == [1, 2, 3, 4]
    assert kinds(out) == [("tcp://w1:1", "Dispatch")]   # no Moved: its gateway, which re-sent it, times it
    core.worker_status(heartbeat("w1", finished=["queued"]))
    assert not core.requests and not core.tenant_inflight


def test_a_silent_worker_holds_resubmissions_only_until_its_record_goes():
    core = fresh_core("w1", "silent")
    core.worker_status(heartbeat("w1"))
    assert core.submit(resubmit("a")) == [] and core.submit(resubmit("b")) == []
    out = core.abort(Abort(request_id="b", reason="client"))   # its client left meanwhile
    assert [(e.dest, type(e.msg)) for e in out] == [(GW, RequestFailed)]
    out = core.set_workers([worker("w1")])                     # the silent one's lease lapsed
    assert kinds(out) == [(DT, "Migrate"), (GW, "Admitted")] and set(core.requests) == {"a"}


def test_an_ended_stream_is_forgotten_and_a_plain_submit_is_untouched():
    core = fresh_core("w1")
    core.worker_status(heartbeat("w1"))
    core.submit(resubmit("over"))
    assert core.resumed(Resume(request_id="over", output_token_ids=[[1]], ended=[0])) == []
    assert not core.requests
    plain = msgspec.structs.replace(resubmit("new"), resubmitted=False)
    assert [type(e.msg) for e in core.submit(plain)] == [Dispatch, Admitted]
