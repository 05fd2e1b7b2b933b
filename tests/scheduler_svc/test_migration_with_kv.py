"""SchedulerCore moving a drained worker's request with its KV (WorkerStatus.kv_held): the peer's
Dispatch names the holder (kv_from) and the holder gets a MoveKV to the peer's KV socket; where no
peer qualifies, or the stream does not fit a move, or the client leaves, the holder frees the KV."""
from __future__ import annotations

import msgspec

from services import metrics
from services.protocol.messages import Abort, Dispatch, Migrate, MoveKV, Resume
from tests.scheduler_svc.test_migration import DT, core_with, messages, status, submit, worker

LAYOUT = {"model_id": "m", "block_size": 16}


def _view(wid: str, layout: dict, transport: str, role: str = "mixed"):
    w = worker(wid, role=role)
    w.kv_addr, w.kv_layout, w.kv_transport = f"tcp://{wid}:2#worker", dict(layout), transport
    return w


def drained(peer_layout: dict = LAYOUT, peer_role: str = "mixed", n: int = 1):
    """w1 runs "a", then drains holding its KV; the detokenizer has been asked."""
    core = core_with(_view("w1", LAYOUT, "zmq"))
    core.submit(submit("a", n=n))
    core.set_workers([_view("w1", LAYOUT, "zmq"), _view("w2", peer_layout, "zmq", peer_role)])
    held = msgspec.structs.replace(status("w1", handed_back=["a"]), kv_held=["a"])
    out = core.worker_status(held)
    assert [m.request_id for _, m in messages(out, Migrate)] == ["a"]
    return core


def _moves(path: str) -> float:
    return metrics.DRAIN_MOVES.labels(path).collect()[0].samples[0].value


def test_the_peer_awaits_the_kv_and_the_holder_sends_it_there():
    core, before = drained(), _moves("peer")
    out = core.resumed(Resume(request_id="a", output_token_ids=[[5, 6, 7]]))
    assert _moves("peer") == before + 1
    [(addr, d)] = messages(out, Dispatch)
    [(holder, move)] = messages(out, MoveKV)
    assert addr == "tcp://w2:1" and d.kv_from == "w1" and d.resume_output == [[5, 6, 7]]
    assert holder == "tcp://w1:1" and move.to == "tcp://w2:2#worker" and move.output_token_ids == [5, 6, 7]
    assert move.run == d.run and move.epoch == 1
    # an abort now reaches the peer and the holder (whose sender stops and frees the KV)
    assert {a for a, _ in messages(core.abort(Abort(request_id="a")), Abort)} == {"tcp://w1:1", "tcp://w2:1"}


def test_an_n_request_moves_with_every_samples_tokens_and_the_ended_ones():
    core = drained(n=3)
    out = core.resumed(Resume(request_id="a", output_token_ids=[[5, 6], [8], [9, 4]], ended=[1]))
    [(_, d)] = messages(out, Dispatch)
    [(_, move)] = messages(out, MoveKV)
    assert d.kv_from == "w1" and d.resume_ended == [1]
    assert move.sample_outputs == [[5, 6], [8], [9, 4]] and move.ended == [1] and move.output_token_ids == [5, 6]
    core = drained(n=2)                 # a sample still going without a token: recomputed
    out = core.resumed(Resume(request_id="a", output_token_ids=[[5, 6], []]))
    assert not messages(out, MoveKV) and messages(out, Dispatch)[0][1].kv_from == ""


def test_no_peer_with_the_layout_or_role_or_a_stream_a_move_does_not_fit_frees_the_kv():
    for core in (drained(peer_layout={"model_id": "m", "block_size": 32}), drained(peer_role="decode")):
        before = _moves("recompute")
        out = core.resumed(Resume(request_id="a", output_token_ids=[[5, 6, 7]]))
        assert _moves("recompute") == before + 1
        [(_, d)] = messages(out, Dispatch)
        assert d.kv_from == "" and not messages(out, MoveKV)
        assert [(a, m.reason) for a, m in messages(out, Abort)] == [("tcp://w1:1", "moved")]
    core = drained()
    out = core.resumed(Resume(request_id="a", output_token_ids=[[]]))     # no token streamed yet
    assert not messages(out, MoveKV) and [a for a, _ in messages(out, Abort)] == ["tcp://w1:1"]
    assert messages(out, Dispatch)[0][1].kv_from == ""


def test_a_client_gone_while_the_stream_moves_frees_the_held_kv():
    core = drained()
    out = core.abort(Abort(request_id="a"))
    assert ("tcp://w1:1", "moved") in [(a, m.reason) for a, m in messages(out, Abort)]
    assert DT in [a for a, _ in messages(out, Abort)] and not core.requests
