"""A scheduler restart in the middle of a prefill -> decode hand-off: the request is held by both
its prefill worker P and its decode worker D, and the new SchedulerCore adopts it onto both. Then
P or D dies: the request goes on exactly once (one re-run or one move, drawing what P drew) and the
core holds nothing of it once it ends."""
from __future__ import annotations

from scheduler_svc.core import Limits, SchedulerCore
from scheduler_svc.routing import WorkerView
from services.protocol.messages import (
    Abort, Admitted, AwaitKV, Dispatch, Migrate, RequestFailed, Resume, Submit, WorkerStatus)
from services.protocol.sampling import SamplingParams

GW, DT, ME = "tcp://gw:1", "tcp://detok:1", "tcp://sched:1"
LAYOUT = {"model_id": "m", "block_size": 16, "kv_dtype": "float32", "num_layers": 2, "num_kv_heads": 2,
          "head_dim": 16, "tp_size": 1}
RID = "r-0123456789abcdef0123456789abcdef"


def submit(resubmitted: bool = False) -> Submit:
    """Sampled without a seed: only the seed fixed at pairing makes a re-run draw what P drew."""
    return Submit(request_id=RID, tenant="t", prompt_token_ids=list(range(40)), reply_addr=GW, detok_addr=DT,
                  params=SamplingParams(max_tokens=8, temperature=0.8), resubmitted=resubmitted)


def worker(wid: str, role: str) -> WorkerView:
    return WorkerView(id=wid, epoch=1, addr=f"tcp://{wid}:1", role=role, max_num_seqs=4, max_model_len=4096,
                      kv_addr=f"tcp://{wid}:2" if role == "decode" else "", kv_layout=LAYOUT)


def new_core(*views: WorkerView) -> SchedulerCore:
    core = SchedulerCore(Limits(pd_min_prefill_tokens=8))
    core.inbox_addr = ME
    core.set_workers(list(views))
    return core


def heartbeat(wid: str, *active: str, finished=()) -> WorkerStatus:
    return WorkerStatus(worker_id=wid, epoch=1, running=len(active), waiting=0, free_blocks=10, cached_blocks=0,
                        total_blocks=10, finished=list(finished), active=list(active))


def messages(out, kind):
    return [(e.dest, e.msg) for e in out if isinstance(e.msg, kind)]


def first_seed() -> int:
    """The seed the scheduler that stopped fixed when it paired the request (P samples with it)."""
    before = new_core(worker("p", "prefill"), worker("d", "decode"))
    out = before.submit(submit())
    assert messages(out, AwaitKV)[0][0] == "tcp://d:1"
    [(addr, dispatch)] = messages(out, Dispatch)
    assert addr == "tcp://p:1" and dispatch.handoff_to == "tcp://d:2" and dispatch.params.seed is not None
    return dispatch.params.seed


def adopted_on_both() -> SchedulerCore:
    """A fresh scheduler; P lists the request (prefilling or sending), the gateway sends it again,
    then D lists it (awaiting its KV, or decoding it already): adopted onto both."""
    core = new_core(worker("p", "prefill"), worker("d", "decode"), worker("d2", "decode"))
    core.worker_status(heartbeat("p", RID))
    core.worker_status(heartbeat("d2"))
    assert core.submit(submit(resubmitted=True)) == []    # D not heard from: it may hold the other half
    out = core.worker_status(heartbeat("d", RID))
    assert [(e.dest, type(e.msg)) for e in out] == [(GW, Admitted)]   # adopted: nothing runs twice
    req = core.requests[RID]
    assert (req.prefill_id, req.worker_id) == ("p", "d") and core.num_inherited == 0
    assert RID in core.workers["p"].inflight and RID in core.workers["d"].inflight
    return core


def assert_nothing_left(core: SchedulerCore) -> None:
    assert not core.requests and not core.tenant_inflight and core.queue_depth == 0 and core.num_inflight == 0
    assert not any(w.inflight or w.inherited for w in core.workers.values()) and not core._unplaced


def test_p_dying_after_adoption_re_runs_the_request_once_on_d_with_p_s_seed():
    seed = first_seed()
    core = adopted_on_both()
    out = core.set_workers([worker("d", "decode"), worker("d2", "decode")])    # P's lease lapsed
    [(addr, rerun)] = messages(out, Dispatch)
    assert addr == "tcp://d:1" and rerun.resumes and rerun.handoff_to == ""
    assert rerun.params.seed == seed          # the client's first token came from P: D draws it again
    assert not messages(out, Migrate) and not messages(out, RequestFailed) and not messages(out, Abort)
    core.worker_status(heartbeat("d", finished=[RID]))
    assert_nothing_left(core)


def test_d_dying_after_adoption_frees_p_quietly_and_moves_the_stream_once():
    core = adopted_on_both()
    out = core.set_workers([worker("p", "prefill"), worker("d2", "decode")])   # D's lease lapsed
    # P frees its half without ending the client's stream; the detokenizer says where it stands
    assert [(dest, m.reason) for dest, m in messages(out, Abort)] == [("tcp://p:1", "moved")]
    [(addr, mig)] = messages(out, Migrate)
    assert (addr, mig.worker_id) == (DT, "d") and not messages(out, RequestFailed) and not messages(out, Dispatch)
    out = core.resumed(Resume(request_id=RID, output_token_ids=[[5, 6]]))
    [(addr, moved)] = messages(out, Dispatch)
    assert addr == "tcp://d2:1" and moved.resume_output == [[5, 6]] and not messages(out, AwaitKV)
    core.worker_status(heartbeat("p", finished=[RID]))      # P's report of the abort: d2 keeps it
    assert core.requests[RID].worker_id == "d2" and core.requests[RID].migrations == 1
    core.worker_status(heartbeat("d2", finished=[RID]))
    assert_nothing_left(core)


def test_a_hand_off_that_ends_after_adoption_leaves_the_request_on_d_alone():
    core = adopted_on_both()
    core.worker_status(heartbeat("p", finished=[RID]))       # the KV reached D: P's part is over
    assert core.requests[RID].prefill_id is None and not core.workers["p"].inflight
    out = core.set_workers([worker("p", "prefill"), worker("d2", "decode")])   # then D dies
    assert not messages(out, Abort) and [m.worker_id for _, m in messages(out, Migrate)] == ["d"]
    [(addr, _)] = messages(core.resumed(Resume(request_id=RID, output_token_ids=[[5, 6, 7]])), Dispatch)
    assert addr == "tcp://d2:1"
    core.worker_status(heartbeat("d2", finished=[RID]))
    assert_nothing_left(core)


def test_a_request_on_d_alone_whose_prefill_worker_had_not_reported_is_adopted_onto_both():
    """The other order: D reports first. Adopted onto D alone, P's death would leave D awaiting KV
    that never comes; so the core waits for P's report."""
    core = new_core(worker("p", "prefill"), worker("d", "decode"))
    core.worker_status(heartbeat("d", RID))
    assert core.submit(submit(resubmitted=True)) == []
    core.worker_status(heartbeat("p", RID))
    assert (core.requests[RID].prefill_id, core.requests[RID].worker_id) == ("p", "d")
    out = core.abort(Abort(request_id=RID))                   # the client leaves: both halves hear it
    assert sorted(e.dest for e in out) == ["tcp://d:1", "tcp://p:1"]
    core.worker_status(heartbeat("p", finished=[RID]))
    core.worker_status(heartbeat("d", finished=[RID]))
    assert_nothing_left(core)
