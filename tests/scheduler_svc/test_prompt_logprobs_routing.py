"""Requests that ask for prompt logprobs (prompt_logprobs, or completions' echo with logprobs) run
only on workers whose engines make them (their registry records' `prompt_logprobs`): not on a
tensor-parallel or mtp-speculation worker of a mixed fleet, which would answer a 400; with none in
the fleet, a 400 naming prompt_logprobs."""
from __future__ import annotations

import msgspec

from scheduler_svc.core import Limits, SchedulerCore
from scheduler_svc.main import view_of
from scheduler_svc.routing import WorkerView
from services.protocol.messages import Dispatch, Rejected, RequestFailed, Submit, WorkerStatus
from services.registry import ServiceRecord
from tests.scheduler_svc.test_scheduler_core import GW, submit


def asking(rid: str) -> Submit:
    s = submit(rid)
    return msgspec.structs.replace(s, params=msgspec.structs.replace(s.params, prompt_logprobs=1))


def worker(wid: str, *, can: bool, seqs: int = 2) -> WorkerView:
    return WorkerView(id=wid, epoch=1, addr=f"tcp://{wid}:1", max_num_seqs=seqs, max_model_len=100,
                      prompt_logprobs=can)


def dispatched_to(out) -> list[str]:
    return [e.dest for e in out if isinstance(e.msg, Dispatch)]


def test_prompt_logprobs_go_only_to_workers_that_make_them():
    core = SchedulerCore()
    # "a-tp" sorts first and is as idle: without the capability it would win every tie
    core.set_workers([worker("a-tp", can=False), worker("b", can=True)])
    for i in range(2):
        assert dispatched_to(core.submit(asking(f"r{i}"))) == ["tcp://b:1"]
    assert dispatched_to(core.submit(submit("plain"))) == ["tcp://a-tp:1"]   # others go anywhere


def test_one_that_waits_for_a_busy_capable_worker_does_not_hold_up_the_queue():
    core = SchedulerCore(Limits(worker_capacity_factor=1.0))
    core.set_workers([worker("a-tp", can=False, seqs=2), worker("b", can=True, seqs=1)])
    assert dispatched_to(core.submit(asking("r0"))) == ["tcp://b:1"]
    assert dispatched_to(core.submit(asking("r1"))) == []                    # b is full: queued
    assert dispatched_to(core.submit(submit("plain"))) == ["tcp://a-tp:1"]   # behind it, runs at once
    out = core.worker_status(WorkerStatus(worker_id="b", epoch=1, running=0, waiting=0, free_blocks=10,
                                          cached_blocks=0, total_blocks=10, finished=["r0"]))
    assert dispatched_to(out) == ["tcp://b:1"] and core.queue_depth == 0


def test_with_no_worker_that_makes_them_a_400_names_prompt_logprobs():
    core = SchedulerCore()
    core.set_workers([worker("tp", can=False)])
    [env] = core.submit(asking("r"))
    assert isinstance(env.msg, Rejected) and env.dest == GW and env.msg.status == 400 and env.msg.message.startswith("invalid prompt_logprobs: ")
    assert not core.requests and not core.tenant_inflight


def test_a_queued_one_whose_capable_workers_left_gets_a_400():
    core = SchedulerCore(Limits(worker_capacity_factor=1.0))
    core.set_workers([worker("tp", can=False), worker("b", can=True, seqs=1)])
    core.submit(asking("r0"))
    core.submit(asking("r1"))                                               # queued behind r0 on b
    out = core.set_workers([worker("tp", can=False)])                       # b is gone
    failed = [e.msg for e in out if isinstance(e.msg, RequestFailed) and e.msg.request_id == "r1"]
    assert len(failed) == 1 and failed[0].status == 400 and "prompt_logprobs" in failed[0].message
    assert "r1" not in core.requests and core.queue_depth == 0


def test_the_worker_record_carries_the_capability():
    def record(info):
        return ServiceRecord(kind="worker", id="w", epoch=1, addrs={"zmq": "tcp://w:1"}, info=info, load={})
    assert view_of(record({"prompt_logprobs": False})).prompt_logprobs is False
    assert view_of(record({"prompt_logprobs": True})).prompt_logprobs is True
    assert view_of(record({})).prompt_logprobs is True     # a record without it: as before, the worker judges
