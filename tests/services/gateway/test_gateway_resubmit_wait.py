"""GatewayCore's measure of what a re-send costs the client (kvmesh_gateway_resubmit_wait_seconds):
a request sent again to a restarted scheduler before its first token is timed from its Submit to
that first token, on the time the core is given; with local text, the DetokCore leaves that wait to
the gateway, so no wait is in both histograms."""
from __future__ import annotations

import logging

from prometheus_client import REGISTRY

from services.gateway.core import GatewayCore
from services.protocol.messages import (
    Admitted, Migrate, Moved, RequestFailed, SeqTokens, StepOutput, StreamOpen, Submit, TextBatch, TextDelta)
from services.protocol.sampling import SamplingParams
from services.text.streams import DetokCore

SCHED, RESTARTED = "tcp://sched#scheduler|s-1#1", "tcp://sched#scheduler|s-2#1"


class ToyTok:
    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


def core_of(detok: DetokCore | None = None) -> GatewayCore:
    return GatewayCore(15.0, 600.0, detok)


def submit(core: GatewayCore, rids: tuple[str, ...], now: float, detok: str = "tcp://tok#tokenizer"):
    submits = [Submit(request_id=rid, tenant="t", prompt_token_ids=[1, 2], params=SamplingParams(),
                      reply_addr="tcp://gw#gateway", detok_addr=detok) for rid in rids]
    return core.submit(submits, 1, SCHED, now)


def delta(rid: str, text: str, finish: str | None = None, tokens: int = 1) -> TextDelta:
    return TextDelta(rid, 0, text, tokens, finish)


def hist(name: str) -> tuple[float, float]:
    """(count, sum) of a histogram in this process."""
    get = REGISTRY.get_sample_value
    return get(name + "_count") or 0.0, get(name + "_sum") or 0.0


def waits() -> tuple[float, float]:
    return hist("kvmesh_gateway_resubmit_wait_seconds")


def test_a_request_sent_again_before_its_first_token_waits_from_its_submit(caplog):
    core = core_of()
    count0, sum0 = waits()
    two = submit(core, rids=("a", "b"), now=10.0)          # one prompt streams before the restart, one not
    other = submit(core, rids=("c",), now=11.0)            # finished before it: not sent again
    failed = submit(core, rids=("f",), now=11.0)           # sent again, then failed: nothing to time
    core.step([Admitted(request_id=r) for r in ("a", "b", "c", "f")], 10.5)
    core.step([TextBatch(deltas=[delta("a", "x"), delta("c", "y", finish="stop")])], 12.0)
    core.redrive(RESTARTED)
    core.redrive("tcp://sched#scheduler|s-3#1")            # restarted again before it: one wait
    core.step([RequestFailed(request_id="f", status=503, code="worker_failed", message="gone")], 13.0)
    with caplog.at_level(logging.INFO, logger="kvmesh.gateway"):
        core.step([TextBatch(deltas=[delta("a", "x"), delta("b", "", tokens=0)])], 13.0)   # no token yet
        assert waits() == (count0, sum0)
        core.step([TextBatch(deltas=[delta("b", "z")])], 14.5)
        core.step([TextBatch(deltas=[delta("b", "z", finish="length"), delta("a", "x", finish="length")])], 15.0)
    count, total = waits()
    assert count == count0 + 1 and abs(total - sum0 - 4.5) < 1e-9
    assert "request b, sent again before its first token, got it 4500.000 ms after its submit" in caplog.text
    assert caplog.text.count("sent again before its first token") == 1
    assert (two.resent_early, other.resent_early, failed.started) == (set(), set(), set())


def test_an_end_without_tokens_is_the_first_answer_too():
    core = core_of()
    count0, sum0 = waits()
    submit(core, rids=("e",), now=1.0)
    core.redrive(RESTARTED)
    core.step([TextBatch(deltas=[delta("e", "", finish="length", tokens=0)])], 1.25)
    count, total = waits()
    assert count == count0 + 1 and abs(total - sum0 - 0.25) < 1e-9


def test_local_text_times_a_resent_stream_once_at_the_gateway():
    """The scheduler dies with the request dispatched but no token streamed; its worker dies too:
    the restarted scheduler's Migrate (naming no worker) finds the stream at the gateway's
    DetokCore with nothing passed on, which leaves the wait to the gateway."""
    now = [100.0]
    core = core_of(DetokCore(ToyTok(), lambda: now[0]))
    stalls0, waits0 = hist("kvmesh_detok_migration_stall_seconds"), waits()
    job = submit(core, rids=("r",), now=100.0, detok="")
    core.step([Admitted(request_id="r"), StreamOpen(request_id="r", params=SamplingParams(), reply_addr="",
                                                    num_prompt_tokens=2, worker_id="w1", worker_epoch=1)], 100.1)
    now[0] = 102.0
    core.redrive(RESTARTED)
    out = core.step([Migrate(request_id="r", worker_id="", reply_addr=SCHED)], now[0])
    assert [e.dest for e in out.send] == [SCHED]           # the Resume, to the scheduler that asked
    now[0] = 103.0
    core.step([StepOutput(worker_id="w2", epoch=1, step=0, seqs=[SeqTokens("r", 0, [0], finish_reason="length")])],
              now[0])
    assert core.detok.migrations["resent"] == 1
    assert hist("kvmesh_detok_migration_stall_seconds") == stalls0
    count, total = waits()
    assert count == waits0[0] + 1 and abs(total - waits0[1] - 3.0) < 1e-9
    assert job.phase.value == "finished"



def test_a_request_moved_before_its_stream_opened_waits_from_its_submit(caplog):
    """The scheduler moved it off a stopped worker that had not opened its stream (its detokenizer
    held nothing: not_held) and said so (Moved): its wait is timed from the Submit; a Moved after
    its first tokens (it had streamed) times nothing, and one for a request already over is late."""
    core = core_of()
    count0, sum0 = waits()
    moved = submit(core, rids=("m",), now=20.0)
    streamed = submit(core, rids=("s",), now=20.0)
    submit(core, rids=("o",), now=20.0)
    core.step([Admitted(request_id=r) for r in ("m", "s", "o")], 20.1)
    core.step([TextBatch(deltas=[delta("s", "x"), delta("o", "y", finish="stop")])], 20.5)
    late0 = core.late_messages
    core.step([Moved(request_id="m"), Moved(request_id="s"), Moved(request_id="o")], 21.0)
    assert core.late_messages == late0 + 1                  # "o" had ended: its gateway dropped it
    with caplog.at_level(logging.INFO, logger="kvmesh.gateway"):
        core.step([TextBatch(deltas=[delta("m", "", tokens=0)])], 21.5)      # no token yet
        core.step([TextBatch(deltas=[delta("m", "z"), delta("s", "x")])], 22.25)
        core.step([TextBatch(deltas=[delta("m", "z")])], 23.0)
    count, total = waits()
    assert count == count0 + 1 and abs(total - sum0 - 2.25) < 1e-9
    assert caplog.text.count("before its first token") == 1
    assert "request m, moved off its worker before its first token, got it 2250.000 ms after its submit" in caplog.text
    assert (moved.moved_early, streamed.moved_early) == (set(), set())


def test_a_request_moved_and_sent_again_before_its_first_token_is_one_wait(caplog):
    core = core_of()
    count0, sum0 = waits()
    job = submit(core, rids=("b",), now=30.0)
    core.step([Admitted(request_id="b"), Moved(request_id="b")], 30.5)
    core.redrive(RESTARTED)                                 # the scheduler restarted while it moved
    with caplog.at_level(logging.INFO, logger="kvmesh.gateway"):
        core.step([TextBatch(deltas=[delta("b", "z")])], 31.5)
    count, total = waits()
    assert count == count0 + 1 and abs(total - sum0 - 1.5) < 1e-9
    assert caplog.text.count("before its first token") == 1 and "request b, sent again" in caplog.text
    assert (job.moved_early, job.resent_early) == (set(), set())
