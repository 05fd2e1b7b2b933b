"""WorkerCore without sockets, over the null engine: dispatch, one message per step, aborts."""
from __future__ import annotations

from gpu_worker.service.core import WorkerCore
from gpu_worker.service.null_engine import NullEngine
from services.envelope import SCHEDULER
from services.protocol.messages import Abort, Dispatch, RequestFailed, StepOutput, StreamOpen, WorkerStatus
from services.protocol.sampling import SamplingParams


def dispatch(rid, n=1, max_tokens=3, detok="d1", prompt=(1, 2, 3)):
    return Dispatch(request_id=rid, epoch=1, prompt_token_ids=list(prompt),
                    params=SamplingParams(n=n, max_tokens=max_tokens),
                    reply_addr="gw", detok_addr=detok)


def test_one_step_message_per_detokenizer_and_finish_status():
    core = WorkerCore(NullEngine(vocab_size=1000, num_blocks=64), "w", 1)
    out = core.run([dispatch("a", n=2), dispatch("b", detok="d2")])
    opens = [e for e in out if isinstance(e.msg, StreamOpen)]
    steps = [e for e in out if isinstance(e.msg, StepOutput)]
    assert [e.dest for e in opens] == ["d1", "d2"]
    assert sorted(e.dest for e in steps) == ["d1", "d2"]
    assert len(next(e for e in steps if e.dest == "d1").msg.seqs) == 2   # both samples of "a" in one message
    assert out.index(opens[0]) < out.index(steps[0])
    core.run([])
    out = core.run([])
    status = [e for e in out if e.dest == SCHEDULER]
    assert len(status) == 1 and sorted(status[0].msg.finished) == ["a", "b"]
    assert not core.requests and core.engine.stats().num_free_blocks == 64


def test_abort_frees_and_tells_the_detokenizer():
    core = WorkerCore(NullEngine(vocab_size=1000, num_blocks=64), "w", 1)
    core.run([dispatch("a", max_tokens=100)])
    assert core.engine.stats().num_free_blocks < 64
    out = core.run([Abort(request_id="a")])
    assert [(e.dest, type(e.msg).__name__) for e in out] == [("d1", "Abort"), (SCHEDULER, "WorkerStatus")]
    assert core.engine.stats().num_free_blocks == 64 and not core.has_work()


def test_an_abort_for_a_moved_request_frees_it_without_ending_its_stream():
    """The other half of a hand-off whose partner died: the stream goes on at another worker, so
    the detokenizer must not hear an Abort (it would end the client's stream)."""
    core = WorkerCore(NullEngine(vocab_size=1000, num_blocks=64), "w", 1)
    core.run([dispatch("a", max_tokens=100)])
    out = core.run([Abort(request_id="a", reason="moved")])
    assert [(e.dest, type(e.msg).__name__) for e in out] == [(SCHEDULER, "WorkerStatus")]
    assert out[0].msg.finished == ["a"] and core.engine.stats().num_free_blocks == 64 and not core.has_work()


def test_abort_one_sample_keeps_the_other():
    core = WorkerCore(NullEngine(vocab_size=1000), "w", 1)
    core.run([dispatch("a", n=2, max_tokens=5)])
    out = core.run([Abort(request_id="a", index=0, reason="stop")])
    [step] = [e.msg for e in out if isinstance(e.msg, StepOutput)]
    assert [s.index for s in step.seqs] == [1]
    assert "a" in core.requests


def test_invalid_request_answers_the_gateway():
    core = WorkerCore(NullEngine(vocab_size=1000), "w", 1)
    out = core.run([dispatch("a", prompt=[])])
    assert isinstance(out[0].msg, RequestFailed) and out[0].dest == "gw" and out[0].msg.status == 400
    assert isinstance(out[-1].msg, WorkerStatus) and out[-1].msg.finished == ["a"]


def test_engine_failure_fails_requests_instead_of_hanging():
    class Broken(NullEngine):
        def step(self):
            raise RuntimeError("boom")
    core = WorkerCore(Broken(vocab_size=1000), "w", 1)
    out = core.run([dispatch("a")])
    assert any(isinstance(e.msg, RequestFailed) and e.msg.status == 500 for e in out)
    assert not core.requests


def test_pending_prompt_tokens_count_prompts_until_their_first_token():
    """The prefill pool's autoscaling signal: prompt tokens that still wait for a first token."""
    core = WorkerCore(NullEngine(vocab_size=1000, max_num_seqs=1), "w", 1)
    assert core.load()["pending_prompt_tokens"] == 0
    core.run([dispatch("a", max_tokens=2, prompt=range(1, 6)), dispatch("b", max_tokens=2, prompt=range(1, 8)),
              dispatch("c", max_tokens=2, prompt=range(1, 4))])
    assert core.load()["pending_prompt_tokens"] == 7 + 3      # "a" has its first token; one slot only
    core.run([Abort(request_id="c")])                         # "a" finishes in this step
    assert core.load()["pending_prompt_tokens"] == 7
    core.run([])                                               # "b" takes the slot: its first token
    assert core.load()["pending_prompt_tokens"] == 0


def test_the_heartbeat_publishes_the_pending_prompt_tokens_gauge():
    from prometheus_client import REGISTRY

    from gpu_worker.service.main import WorkerService
    core = WorkerCore(NullEngine(vocab_size=1000, max_num_seqs=1), "w", 1)
    core.run([dispatch("a", prompt=range(1, 6)), dispatch("b", prompt=range(1, 10))])
    WorkerService._publish_metrics(None, core.load())   # what each heartbeat does with the load
    assert REGISTRY.get_sample_value("kvmesh_worker_pending_prompt_tokens") == 9
