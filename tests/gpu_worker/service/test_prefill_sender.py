"""The prefill worker's sender thread (handoff.PrefillSender) beside a real CPU engine and WorkerCore,
driven as the worker's engine thread drives them: a decode worker that never answers holds one
hand-off for its whole lease, and meanwhile P's engine keeps stepping its other requests and
handles an abort of the held one at once; the blocks are freed on the engine thread only."""
from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from gpu_worker.service.core import WorkerCore
from gpu_worker.service.handoff import PrefillSender
from services.protocol.messages import Abort, Dispatch, RequestFailed, StepOutput, WorkerStatus
from services.security.curve import Plane
from tests.gpu_worker.kv_transfer.conftest import MAX_STEPS, engine, greedy, prompt, run_single
from tests.gpu_worker.service.test_worker_core_handoff import clean

LEASE_S = 30.0          # far longer than the test may take: nothing may wait for it


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    from gpu_worker.make_model import make_model
    return str(make_model(tmp_path_factory.mktemp("model") / "llama", arch="llama", size="tiny", progress=False))


@pytest.fixture
def silent_d():
    """A decode worker's KV socket that takes every message and answers none."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}#worker"
    sock.close(0)


def hand_off_round(core: WorkerCore, sender: PrefillSender, out: list) -> None:
    """What EngineThread._hand_off does after each step."""
    todo, cancel = core.take_handoffs()
    for rid, to in cancel:
        sender.cancel(rid, to)
    for rid, to in todo:
        sender.submit(rid, to)
    for rid in core.take_stops():
        if sender.stop_sending(rid):          # had not begun: never will
            core.handoff_done(rid, False, "aborted", out)
    for result in sender.take_results():
        core.handoff_done(result.request_id, result.ok, result.reason, out)


def dispatch(rid: str, ids: list[int], steps: int, handoff_to: str = "") -> Dispatch:
    return Dispatch(request_id=rid, epoch=1, prompt_token_ids=ids, params=greedy(steps),
                    reply_addr="gw", detok_addr="dt", handoff_to=handoff_to)


def kinds(sock: zmq.Socket, count: int) -> list[str]:
    got = []
    while len(got) < count and sock.poll(5000):
        got.append(msgspec.msgpack.decode(sock.recv_multipart()[1])["type"])
    return got


def test_a_silent_decode_worker_stalls_neither_other_requests_nor_aborts(llama, silent_d):
    d_sock, d_addr = silent_d
    core = WorkerCore(engine(llama, max_num_batched_tokens=16), "p", 1)
    core.hands_off = True
    sender = PrefillSender(core.engine, Plane.insecure(), LEASE_S)
    out: list = []
    try:
        out += core.run([dispatch("a", prompt(40, 1), 20, handoff_to=d_addr)])
        for _ in range(MAX_STEPS):           # a's prefill, first token, hand-off queued
            hand_off_round(core, sender, out)
            if "a" in core._sending:
                break
            out += core.run([])
        assert kinds(d_sock, 1) == ["offer"]     # the sender waits for D's answer now

        b_ids = prompt(30, 2)
        out += core.run([dispatch("b", b_ids, 12)])      # a request P runs whole meanwhile
        slowest, t0 = 0.0, time.monotonic()
        for _ in range(MAX_STEPS):
            if "b" not in core.requests:
                break
            start = time.perf_counter()
            out += core.run([])
            hand_off_round(core, sender, out)
            slowest = max(slowest, time.perf_counter() - start)
        b_tokens = [t for e in out if isinstance(e.msg, StepOutput) for s in e.msg.seqs
                    if s.request_id == "b" for t in s.token_ids]
        assert b_tokens == run_single(engine(llama), [("b", b_ids, greedy(12))])[("b", 0)]
        assert slowest < 2.0 and time.monotonic() - t0 < LEASE_S / 2, slowest   # no step waited for D
        assert "a" in core._sending and "a" in core.engine.exported           # a's blocks still held

        out += core.run([dispatch("c", prompt(40, 4), 20, handoff_to=d_addr)])
        for _ in range(MAX_STEPS):           # c's hand-off queued behind a's
            hand_off_round(core, sender, out)
            if "c" in core._sending:
                break
            out += core.run([])
        out += core.run([Abort(request_id="c")])
        hand_off_round(core, sender, out)     # c had not begun: freed now, not after a's lease
        assert "c" not in core._sending and "c" not in core.engine.exported

        t_abort = time.monotonic()
        out += core.run([Abort(request_id="a")])
        assert "a" not in core.requests                   # the client's stream ends at once
        hand_off_round(core, sender, out)
        for _ in range(MAX_STEPS):                        # the sender gives up, the engine thread frees
            if "a" not in core._sending:
                break
            time.sleep(0.01)
            hand_off_round(core, sender, out)
        assert time.monotonic() - t_abort < 2.0
        assert clean(core)
        assert kinds(d_sock, 2) == ["abort", "abort"]     # D is told to drop a, and to stop awaiting c
        assert not [e for e in out if isinstance(e.msg, RequestFailed)]   # an abort, not a failure
    finally:
        sender.close()


def test_a_hand_off_that_outlives_its_lease_is_decoded_on_p_one_stream_and_its_blocks_freed(llama, silent_d):
    """D went silent (dead, perhaps, before the scheduler saw its lease lapse): P decodes the request
    itself from the KV and first token it holds, every token the one a single engine draws, and
    says so (`kept`) instead of failing it after its first token."""
    d_sock, d_addr = silent_d
    core = WorkerCore(engine(llama), "p", 1)
    core.hands_off = True
    sender = PrefillSender(core.engine, Plane.insecure(), lease_s=0.5)
    ids, out = prompt(40, 3), []
    try:
        out += core.run([msgspec.structs.replace(dispatch("a", ids, 20, handoff_to=d_addr), run=7)])
        deadline = time.monotonic() + 30
        while (core.requests or core._sending) and time.monotonic() < deadline:
            out += core.run([])
            hand_off_round(core, sender, out)
            time.sleep(0.01)
        got = [t for e in out if isinstance(e.msg, StepOutput) for s in e.msg.seqs for t in s.token_ids]
        assert got == run_single(engine(llama), [("a", ids, greedy(20))])[("a", 0)]
        statuses = [e.msg for e in out if isinstance(e.msg, WorkerStatus)]
        assert [(rid, run) for s in statuses for rid, run in zip(s.kept, s.kept_runs)] == [("a", 7)]
        assert [(rid, run) for s in statuses for rid, run in zip(s.finished, s.finished_runs)] == [("a", 7)]
        assert not [e for e in out if isinstance(e.msg, (RequestFailed, Abort))] and clean(core)
        assert kinds(d_sock, 2) == ["offer", "abort"]
    finally:
        sender.close()
