"""DetokCore's measure of a moved stream's stall, on an injected clock: from the last tokens passed
on before the Migrate (or the Migrate itself) to the first tokens from the new worker."""
from __future__ import annotations

import logging

from prometheus_client import REGISTRY

from services.protocol.messages import Abort, Migrate, SeqTokens, StepOutput, StreamOpen, TextBatch
from services.protocol.sampling import SamplingParams
from services.text.streams import DetokCore

VOCAB = {i: ch for i, ch in enumerate("abcdefghijklmnopqrstuvwxyz")}


class ToyTok:
    vocab_size = len(VOCAB)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(VOCAB[i] for i in ids)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def stall_hist() -> tuple[float, float]:
    """(count, sum) of kvmesh_detok_migration_stall_seconds in this process."""
    get = REGISTRY.get_sample_value
    return (get("kvmesh_detok_migration_stall_seconds_count") or 0.0,
            get("kvmesh_detok_migration_stall_seconds_sum") or 0.0)


def outcomes() -> dict[str, float]:
    return {o: REGISTRY.get_sample_value("kvmesh_detok_migrations_total", {"outcome": o}) or 0.0
            for o in ("resumed", "aborted", "not_held", "resent")}


def core_with_stream(n: int = 1) -> tuple[DetokCore, Clock]:
    clock = Clock()
    core = DetokCore(ToyTok(), clock)
    core.open(StreamOpen(request_id="r", params=SamplingParams(n=n), reply_addr="gw", num_prompt_tokens=3))
    return core, clock


def tokens(core: DetokCore, worker: str, *seqs: SeqTokens, epoch: int = 1) -> list:
    out = core.step(StepOutput(worker_id=worker, epoch=epoch, step=0, seqs=list(seqs)))
    return [d for e in out if isinstance(e.msg, TextBatch) for d in e.msg.deltas]


def move(core: DetokCore, worker: str) -> None:
    """worker "": a restarted scheduler's Migrate for a request its gateway sent again."""
    core.migrate(Migrate(request_id="r", worker_id=worker, reply_addr="sched", worker_epoch=1 if worker else 0))


def test_stall_runs_from_the_last_tokens_before_the_move_to_the_new_workers_first(caplog):
    core, clock = core_with_stream()
    count0, sum0 = stall_hist()
    before = outcomes()
    tokens(core, "w1", SeqTokens("r", 0, [0, 1]))
    clock.t += 0.5
    tokens(core, "w1", SeqTokens("r", 0, [2]))             # t=100.5: the last tokens before the move
    clock.t += 2.0
    move(core, "w1")                                      # t=102.5
    clock.t += 0.25
    assert tokens(core, "w1", SeqTokens("r", 0, [3])) == []   # late, from the worker left: the wait goes on
    assert stall_hist() == (count0, sum0)
    clock.t += 0.75
    with caplog.at_level(logging.INFO, logger="kvmesh.detok"):
        [delta] = tokens(core, "w2", SeqTokens("r", 0, [3]))  # t=103.5
    assert delta.text == "d"
    count, total = stall_hist()
    assert count == count0 + 1 and abs(total - sum0 - 3.0) < 1e-9
    assert core.migrations == {"resumed": 1, "aborted": 0, "not_held": 0, "resent": 0}
    assert outcomes()["resumed"] == before["resumed"] + 1
    assert "request r resumed on its new worker after a stall of 3000.000 ms" in caplog.text
    clock.t += 1.0
    tokens(core, "w2", SeqTokens("r", 0, [4]))            # later tokens observe nothing more
    assert stall_hist()[0] == count0 + 1


def test_a_stream_moved_before_its_first_tokens_waits_from_the_migrate():
    core, clock = core_with_stream()
    count0, sum0 = stall_hist()
    clock.t += 5.0                                        # waiting in the old worker's queue: not the move's
    move(core, "w1")
    clock.t += 0.125
    tokens(core, "w2", SeqTokens("r", 0, [0]))
    count, total = stall_hist()
    assert count == count0 + 1 and abs(total - sum0 - 0.125) < 1e-9


def test_moved_twice_before_new_tokens_is_one_stall_from_before_the_first_move():
    core, clock = core_with_stream(n=2)
    count0, sum0 = stall_hist()
    tokens(core, "w1", SeqTokens("r", 0, [0]), SeqTokens("r", 1, [1]))
    clock.t += 1.0
    move(core, "w1")
    clock.t += 1.0
    move(core, "w2")                                      # w2 died before sending anything
    clock.t += 1.0
    tokens(core, "w3", SeqTokens("r", 0, [2]), SeqTokens("r", 1, [3]))   # both samples: one observation
    count, total = stall_hist()
    assert count == count0 + 1 and abs(total - sum0 - 3.0) < 1e-9
    assert core.migrations["resumed"] == 1
    clock.t += 0.5                                        # t=103.5: w3's last tokens; then a second move
    tokens(core, "w3", SeqTokens("r", 0, [4]))
    clock.t += 0.5
    move(core, "w3")
    clock.t += 0.25
    tokens(core, "w4", SeqTokens("r", 0, [5], finish_reason="length"), SeqTokens("r", 1, [6], finish_reason="length"))
    count, total = stall_hist()
    assert count == count0 + 2 and abs(total - sum0 - 3.75) < 1e-9
    assert core.migrations == {"resumed": 2, "aborted": 0, "not_held": 0, "resent": 0} and not core.streams


def test_a_moved_stream_ended_before_new_tokens_observes_nothing():
    core, clock = core_with_stream()
    count0, _ = stall_hist()
    tokens(core, "w1", SeqTokens("r", 0, [0]))
    move(core, "w1")
    clock.t += 1.0
    core.abort(Abort(request_id="r", reason="worker_failed"))   # no worker left to take it
    assert core.migrations == {"resumed": 0, "aborted": 1, "not_held": 0, "resent": 0}
    move(core, "w1")                                      # a stream not held: over (or never opened)
    assert core.migrations["not_held"] == 1
    core.open(StreamOpen(request_id="r", params=SamplingParams(), reply_addr="gw", num_prompt_tokens=3))
    move(core, "w1")
    clock.t += 4000.0
    assert core.expire(3600.0) == 1                       # its end was lost
    assert core.migrations == {"resumed": 0, "aborted": 2, "not_held": 1, "resent": 0}
    assert stall_hist()[0] == count0
    # an abort or expiry of a stream never moved counts nothing
    core.open(StreamOpen(request_id="q", params=SamplingParams(), reply_addr="gw", num_prompt_tokens=3))
    core.abort(Abort(request_id="q", reason="client"))
    assert core.migrations == {"resumed": 0, "aborted": 2, "not_held": 1, "resent": 0}


def test_a_resent_stream_that_passed_nothing_on_is_left_to_its_gateway():
    """A restarted scheduler's Migrate (naming no worker) for a stream with no token passed on: its
    gateway re-sent it before its first token and times the client's wait from the Submit, so the
    detokenizer observes nothing, even across a later move or a wait it had begun."""
    core, clock = core_with_stream()
    count0, sum0 = stall_hist()
    move(core, "w1")                                      # its worker died before its first tokens: a wait begins
    clock.t += 1.0
    move(core, "")                                        # the scheduler restarted too: the gateway's now
    move(core, "")                                        # restarted again: counted once
    clock.t += 1.0
    move(core, "w2")                                      # the next worker died first: still the gateway's
    clock.t += 1.0
    tokens(core, "w3", SeqTokens("r", 0, [0]))
    assert stall_hist() == (count0, sum0)
    assert core.migrations == {"resumed": 0, "aborted": 0, "not_held": 0, "resent": 1}
    clock.t += 0.5                                        # tokens passed on: later moves are the detokenizer's
    move(core, "")
    clock.t += 0.25
    tokens(core, "w4", SeqTokens("r", 0, [1]))
    count, total = stall_hist()
    assert count == count0 + 1 and abs(total - sum0 - 0.75) < 1e-9
    assert core.migrations == {"resumed": 1, "aborted": 0, "not_held": 0, "resent": 1}
