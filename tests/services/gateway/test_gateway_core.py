"""GatewayCore in-process (services/gateway/core.py): messages in, deliveries and sends out, time
given as an argument. No sockets, no event loop. The local text path runs the real DetokCore over
a toy tokenizer (one character per id)."""
from __future__ import annotations

from services.gateway.core import JOB_ADMITTED, SCHEDULER, GatewayCore, Phase
from services.gateway.schemas import ApiError
from services.protocol.messages import (
    Abort, Admitted, Rejected, RequestFailed, SeqTokens, StepOutput, StreamOpen, Submit, TextBatch, TextDelta)
from services.protocol.sampling import SamplingParams
from services.text.streams import DetokCore

ADMIT_S, PROGRESS_S = 15.0, 600.0
VOCAB = {i: ch for i, ch in enumerate("abcdefghijklmnopqrstuvwxyz .!")}
WORKER = "tcp://127.0.0.1:7001#worker"
SELF = "tcp://127.0.0.1:7000#gateway"


class ToyTok:
    vocab_size = len(VOCAB)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(VOCAB[i] for i in ids)


def ids(text: str) -> list[int]:
    inv = {c: i for i, c in VOCAB.items()}
    return [inv[c] for c in text]


def core_of(local_text: bool = False) -> GatewayCore:
    return GatewayCore(ADMIT_S, PROGRESS_S, DetokCore(ToyTok()) if local_text else None)


SCHED = "tcp://sched#scheduler|s-1#1"


def submit(core: GatewayCore, rids=("r1",), n=1, now=0.0, detok="tcp://tok#tokenizer"):
    submits = [Submit(request_id=rid, tenant="t", prompt_token_ids=[1, 2], params=SamplingParams(n=n),
                      reply_addr=SELF, detok_addr=detok) for rid in rids]
    return core.submit(submits, n, SCHED, now)


def items(out, job_id=None):
    return [d.item for d in out.deliver if job_id is None or d.job_id == job_id]


def delta(rid, text, index=0, finish=None, tokens=1):
    return TextDelta(rid, index, text, tokens, finish)


def error_of(out) -> ApiError:
    [err] = [i for i in items(out) if isinstance(i, ApiError)]
    return err


def aborts(out):
    return [(e.dest, e.msg.request_id, e.msg.index, e.msg.reason) for e in out.send if isinstance(e.msg, Abort)]


def test_a_request_streams_then_finishes_and_later_text_is_dropped():
    core = core_of()
    job = submit(core)
    assert items(core.step([Admitted(request_id="r1")], 1.0)) == [JOB_ADMITTED]
    assert job.phase is Phase.ADMITTED
    out = core.step([TextBatch(deltas=[delta("r1", "he")])], 2.0)
    assert items(out) == [(0, delta("r1", "he"))] and job.phase is Phase.STREAMING
    assert out.first_text == [job]          # the shell ends the job's upstream stage
    out = core.step([TextBatch(deltas=[delta("r1", "llo", finish="length")])], 3.0)
    assert out.first_text == []
    assert job.phase is Phase.FINISHED
    late = core.step([TextBatch(deltas=[delta("r1", "x")]), RequestFailed(request_id="r1", status=500, code="c",
                                                                           message="m")], 4.0)
    assert late.deliver == [] and late.send == [] and core.late_messages == 2
    assert core.close(job.id, 5.0).send == [] and not core.jobs   # finished: nothing to abort


def test_admission_times_out_with_a_retryable_503_and_aborts_the_request():
    core = core_of()
    job = submit(core, now=10.0)
    assert core.expire(10.0 + ADMIT_S - 0.01).deliver == []
    out = core.expire(10.0 + ADMIT_S)
    err = error_of(out)
    assert (err.status, err.code, err.retry_after) == (503, "scheduler_unavailable", 1)
    assert job.phase is Phase.REJECTED and aborts(out) == [(SCHEDULER, "r1", None, "timeout")]
    assert core.step([Admitted(request_id="r1")], 11.0).deliver == []   # too late: dropped


def test_no_progress_times_out_with_a_504_after_admission():
    core = core_of()
    job = submit(core)
    core.step([Admitted(request_id="r1")], 1.0)
    core.step([TextBatch(deltas=[delta("r1", "a")])], 100.0)
    assert core.expire(100.0 + PROGRESS_S - 1).deliver == []       # text moved the deadline
    err = error_of(core.expire(100.0 + PROGRESS_S))
    assert (err.status, err.code) == (504, "timeout") and job.phase is Phase.FAILED


def test_a_rejection_is_a_plain_error_with_its_status_and_the_other_prompts_are_aborted():
    core = core_of()
    job = submit(core, rids=("a", "b"))
    out = core.step([Admitted(request_id="a"), Rejected(request_id="b", status=429, code="queue_full",
                                                        message="busy", retry_after_s=2)], 1.0)
    err = error_of(out)
    assert (err.status, err.type, err.code, err.retry_after) == (429, "rate_limit_error", "queue_full", 2)
    assert JOB_ADMITTED not in items(out) and job.phase is Phase.REJECTED
    assert [a[1] for a in aborts(out)] == ["a"]


def test_a_failure_mid_stream_ends_the_stream_after_the_text_already_delivered():
    core = core_of()
    job = submit(core, rids=("a", "b"))
    core.step([Admitted(request_id="a"), Admitted(request_id="b")], 1.0)
    out = core.step([TextBatch(deltas=[delta("a", "x")]),
                     RequestFailed(request_id="a", status=400, code="invalid_request",
                                   message="invalid logit_bias: past the vocabulary")], 2.0)
    assert items(out)[0] == (0, delta("a", "x"))
    err = items(out)[1]
    assert (err.status, err.param, err.retry_after) == (400, "logit_bias", 0) and job.phase is Phase.FAILED
    assert aborts(out) == [(SCHEDULER, "b", None, "client")]   # the failed one ended upstream already


def test_a_client_that_leaves_aborts_what_did_not_finish():
    core = core_of()
    job = submit(core, rids=("a", "b"))
    core.step([Admitted(request_id="a"), Admitted(request_id="b")], 1.0)
    core.step([TextBatch(deltas=[delta("a", "done", finish="stop")])], 2.0)
    out = core.close(job.id, 3.0)
    assert job.phase is Phase.ABORTED and aborts(out) == [(SCHEDULER, "b", None, "client")]
    assert not core.jobs and not core.job_of


def test_n_samples_fan_in_and_the_job_ends_when_every_sample_has():
    core = core_of()
    job = submit(core, rids=("a", "b"), n=2)
    core.step([Admitted(request_id="a"), Admitted(request_id="b")], 1.0)
    out = core.step([TextBatch(deltas=[delta("a", "x", 0), delta("a", "y", 1, "length"), delta("b", "z", 1)])], 2.0)
    assert [(i, d.index, d.text) for i, d in items(out)] == [(0, 0, "x"), (0, 1, "y"), (1, 1, "z")]
    core.step([TextBatch(deltas=[delta("a", "", 0, "stop", 0), delta("b", "", 0, "stop", 0)])], 3.0)
    assert job.phase is Phase.STREAMING and job.unfinished == {("b", 1)}
    core.step([TextBatch(deltas=[delta("b", "", 1, "length", 0)])], 4.0)
    assert job.phase is Phase.FINISHED


def test_text_that_overtakes_its_admission_admits_the_job_first():
    core = core_of()
    job = submit(core)
    out = core.step([TextBatch(deltas=[delta("r1", "hi")])], 1.0)
    assert items(out) == [JOB_ADMITTED, (0, delta("r1", "hi"))] and job.phase is Phase.STREAMING
    assert core.step([Admitted(request_id="r1")], 2.0).deliver == []


def test_a_workers_failure_reaches_the_client_through_either_text_path():
    remote = core_of()
    submit(remote)
    remote.step([Admitted(request_id="r1"), TextBatch(deltas=[delta("r1", "a")])], 1.0)
    err = error_of(remote.step([RequestFailed(request_id="r1", status=503, code="worker_failed",
                                              message="the worker stopped")], 2.0))
    assert (err.status, err.code, err.retry_after) == (503, "worker_failed", 1)
    busy = core_of()                 # a worker's per-key compile cap: the client may retry
    submit(busy)
    busy.step([Admitted(request_id="r1")], 1.0)
    err = error_of(busy.step([RequestFailed(request_id="r1", status=429, code="rate_limit_exceeded",
                                            message="too many output constraints")], 2.0))
    assert (err.status, err.code, err.retry_after) == (429, "rate_limit_exceeded", 1)
    local = core_of(local_text=True)
    submit(local, detok=SELF)
    p = SamplingParams(max_tokens=8)
    local.step([Admitted(request_id="r1"), StreamOpen(request_id="r1", params=p, reply_addr=SELF,
                                                      num_prompt_tokens=2, worker_addr=WORKER)], 1.0)
    err = error_of(local.step([Abort(request_id="r1", reason="worker_failed")], 2.0))   # from the scheduler
    assert (err.status, err.code) == (503, "worker_failed") and not local.detok.streams


def test_steps_of_an_older_worker_epoch_are_dropped():
    core = core_of(local_text=True)
    job = submit(core, detok=SELF)
    p = SamplingParams(max_tokens=8)
    core.step([Admitted(request_id="r1"), StreamOpen(request_id="r1", params=p, reply_addr=SELF,
                                                     num_prompt_tokens=2)], 1.0)
    new = core.step([StepOutput(worker_id="w", epoch=2, step=1, seqs=[SeqTokens("r1", 0, ids("ab"))])], 2.0)
    old = core.step([StepOutput(worker_id="w", epoch=1, step=9, seqs=[SeqTokens("r1", 0, ids("zz"))])], 3.0)
    assert [d.text for _, d in items(new)] == ["ab"] and old.deliver == []
    assert core.detok.dropped_tokens["stale_epoch"] == 2 and job.phase is Phase.STREAMING


def test_a_stop_string_is_told_to_the_worker_and_the_scheduler_and_spares_other_requests():
    core = core_of(local_text=True)
    stopped, other = submit(core, rids=("s",), detok=SELF), submit(core, rids=("o",), detok=SELF)
    core.step([Admitted(request_id="s"), Admitted(request_id="o"),
               StreamOpen(request_id="s", params=SamplingParams(max_tokens=50, stop=["lo"]), reply_addr=SELF,
                          num_prompt_tokens=2, worker_addr=WORKER),
               StreamOpen(request_id="o", params=SamplingParams(max_tokens=50), reply_addr=SELF,
                          num_prompt_tokens=2, worker_addr=WORKER)], 1.0)
    out = core.step([StepOutput(worker_id="w", epoch=1, step=1, seqs=[SeqTokens("s", 0, ids("hello")),
                                                                      SeqTokens("o", 0, ids("hello"))])], 2.0)
    assert sorted(aborts(out)) == [(SCHEDULER, "s", 0, "stop"), (WORKER, "s", 0, "stop")]
    texts = {d.request_id: (d.text, d.finish_reason, d.stop_reason) for _, d in items(out)}
    assert texts == {"s": ("hel", "stop", "lo"), "o": ("hello", None, None)}
    assert stopped.phase is Phase.FINISHED and other.phase is Phase.STREAMING
    # the worker's own Abort for the stopped sample, and its last tokens, are late: nothing happens
    late = core.step([StepOutput(worker_id="w", epoch=1, step=2, seqs=[SeqTokens("s", 0, ids("x"))]),
                      Abort(request_id="s", reason="stop")], 3.0)
    assert late.deliver == [] and late.send == []


def test_a_request_whose_detokenizer_vanished_fails_at_once():
    core = core_of()
    streaming = submit(core, rids=("s",))
    core.step([Admitted(request_id="s"), TextBatch(deltas=[delta("s", "a")])], 1.0)
    assert core.orphans({"tcp://tok#tokenizer"}).deliver == []
    out = core.orphans(set())
    assert [(d.job_id, d.item.code) for d in out.deliver] == [(streaming.id, "tokenizer_failed")]
    assert aborts(out) == [(SCHEDULER, "s", None, "client")]


def resubmits(out) -> list[str]:
    return sorted(e.msg.request_id for e in out.send if isinstance(e.msg, Submit) and e.msg.resubmitted)


def test_live_requests_go_to_a_new_scheduler_again_a_bounded_number_of_times():
    """Queued, admitted and streaming jobs wait while no scheduler is registered and are sent to the
    next one (only their unfinished requests); a finished one is not; after MAX_SUBMITS sends a
    job fails with scheduler_failed."""
    core = core_of()
    queued, admitted = submit(core, rids=("q",)), submit(core, rids=("a",))
    streaming, done = submit(core, rids=("s1", "s2")), submit(core, rids=("d",))
    core.step([Admitted(request_id=r) for r in ("a", "s1", "s2", "d")], 1.0)
    core.step([TextBatch(deltas=[delta("s1", "x", finish="length"), delta("s2", "y"), delta("d", "z", finish="stop")])],
              2.0)
    assert core.redrive(SCHED).send == [] and core.redrive("").send == []   # same scheduler; none registered
    out = core.redrive("tcp://sched#scheduler|s-2#1")   # restarted on the same address
    assert resubmits(out) == ["a", "q", "s2"] and out.deliver == []
    assert core.redrive("tcp://sched#scheduler|s-2#1").send == []           # sent once per scheduler
    assert resubmits(core.redrive("tcp://other#scheduler|s-3#1")) == ["a", "q", "s2"]
    out = core.redrive("tcp://sched#scheduler|s-4#1")                        # a third restart: no more
    assert sorted((d.job_id, d.item.code) for d in out.deliver) == sorted(
        (j.id, "scheduler_failed") for j in (queued, admitted, streaming))
    assert queued.phase is Phase.REJECTED and streaming.phase is Phase.FAILED and done.phase is Phase.FINISHED


def test_a_stopping_gateway_fails_every_live_request_with_a_503():
    core = core_of()
    a, b = submit(core, rids=("a",)), submit(core, rids=("b",), n=2)
    core.step([Admitted(request_id="b")], 1.0)
    out = core.fail_all("shutdown")
    assert sorted((d.job_id, d.item.status, d.item.code) for d in out.deliver) == [
        (a.id, 503, "shutdown"), (b.id, 503, "shutdown")]
    assert sorted(x[1] for x in aborts(out)) == ["a", "b"]
