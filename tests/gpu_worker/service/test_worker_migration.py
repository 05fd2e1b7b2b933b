"""WorkerCore taking a request that moved here mid-stream, and handing its own back when draining."""
from __future__ import annotations

from gpu_worker.service.core import WorkerCore
from gpu_worker.service.null_engine import NullEngine
from services.envelope import SCHEDULER
from services.protocol.messages import Dispatch, StepOutput, StreamOpen
from services.protocol.sampling import SamplingParams


def dispatch(rid, n=1, max_tokens=6, **resume):
    return Dispatch(request_id=rid, epoch=1, prompt_token_ids=[1, 2, 3], params=SamplingParams(n=n, max_tokens=max_tokens),
                    reply_addr="gw", detok_addr="d1", **resume)


def tokens(core, rid, steps=20):
    got: dict[int, list[int]] = {}
    for _ in range(steps):
        for e in core.run([]):
            if isinstance(e.msg, StepOutput):
                for s in e.msg.seqs:
                    got.setdefault(s.index, []).extend(s.token_ids)
    return got


def test_a_moved_request_streams_only_what_follows_its_tokens():
    whole = WorkerCore(NullEngine(vocab_size=1000), "w1", 1)
    full = {}
    for e in whole.run([dispatch("a", n=2)]):
        if isinstance(e.msg, StepOutput):
            for s in e.msg.seqs:
                full.setdefault(s.index, []).extend(s.token_ids)
    for i, more in tokens(whole, "a").items():
        full[i] += more
    moved = WorkerCore(NullEngine(vocab_size=1000, num_blocks=64), "w2", 1)
    out = moved.run([dispatch("a", n=2, resumes=True, resume_output=[[0] * 4, [0] * 6], resume_ended=[1])])
    [open_] = [e.msg for e in out if isinstance(e.msg, StreamOpen)]
    assert open_.resumes and open_.num_prompt_tokens == 3      # usage counts the prompt, not what it resumed from
    first = [s for e in out if isinstance(e.msg, StepOutput) for s in e.msg.seqs]
    rest = tokens(moved, "a")
    assert [s.index for s in first] == [0] and 1 not in rest   # the ended sample draws nothing
    assert first[0].token_ids + rest.get(0, []) == full[0][4:]  # positions 4 and 5: the null model's tokens there
    assert moved.engine.stats().num_free_blocks == 64 and not moved.requests


def test_hand_back_frees_everything_silently_and_reports_the_requests():
    core = WorkerCore(NullEngine(vocab_size=1000, num_blocks=64), "w", 1)
    core.run([dispatch("a", max_tokens=100), dispatch("b", max_tokens=100)])
    assert core.engine.stats().num_free_blocks < 64
    status = core.hand_back()
    assert sorted(status.handed_back) == ["a", "b"] and status.finished == []
    assert not core.requests and not core.has_work() and core.engine.stats().num_free_blocks == 64
    assert [e for e in core.run([]) if e.dest != SCHEDULER] == []      # nothing to the detokenizer
    # every heartbeat names them again (it travels on another socket and may arrive first)
    beat = core.status(with_active=True)
    assert beat.active == [] and sorted(beat.handed_back) == ["a", "b"]
    assert core.status().handed_back == []                            # a step's status does not
    core.rejoin(2)                                                    # a new epoch hands back nothing
    assert core.status(with_active=True).handed_back == []
