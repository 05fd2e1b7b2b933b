"""One sender thread per decode worker on a prefill worker: a decode worker that takes the Offer and
never answers holds its own hand-off only; a hand-off to another decode worker, queued after it,
completes at once (its tokens match one engine's). Idle sender threads end."""
from __future__ import annotations

import time

import pytest

from gpu_worker.service.core import WorkerCore
from gpu_worker.service.handoff import DecodeReceiver, PrefillSender
from services.protocol.messages import Abort, AwaitKV, RequestFailed, StepOutput
from services.security.curve import Plane
from tests.gpu_worker.kv_transfer.conftest import MAX_STEPS, engine, greedy, prompt, run_single
from tests.gpu_worker.service.test_prefill_sender import dispatch, hand_off_round, kinds, silent_d  # noqa: F401
from tests.gpu_worker.service.test_worker_core_handoff import clean

LEASE_S = 30.0          # far longer than the test may take: nothing may wait for it


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    from gpu_worker.make_model import make_model
    return str(make_model(tmp_path_factory.mktemp("model") / "llama", arch="llama", size="tiny", progress=False))


def test_a_silent_decode_worker_delays_only_its_own_hand_offs(llama, silent_d):
    silent_sock, silent_addr = silent_d
    p = WorkerCore(engine(llama), "p", 1)
    p.hands_off = True
    sender = PrefillSender(p.engine, Plane.insecure(), LEASE_S)
    sender.peer_idle_s = 0.3
    d = WorkerCore(engine(llama), "d", 1)
    rx = DecodeReceiver(d.engine, Plane.insecure(), "127.0.0.1", 0, LEASE_S)
    d.imports = rx.imports
    out: list = []
    try:
        out += p.run([dispatch("stuck", prompt(40, 1), 8, handoff_to=silent_addr)])
        for _ in range(MAX_STEPS):               # its hand-off begins: the Offer waits for an answer
            hand_off_round(p, sender, out)
            if "stuck" in p._sending:
                break
            out += p.run([])
        assert kinds(silent_sock, 1) == ["offer"]

        b_ids = prompt(30, 2)
        out += d.run([AwaitKV(request_id="b", epoch=1, n=1, reply_addr="gw", detok_addr="dt")])
        out += p.run([dispatch("b", b_ids, 6, handoff_to=rx.endpoint.address)])
        t0, seen_peers = time.monotonic(), set()
        for _ in range(MAX_STEPS):               # b's hand-off, queued after stuck's, to the other D
            out += p.run([])
            hand_off_round(p, sender, out)
            seen_peers.update(sender.peers())
            rx.poll()
            d.adopt_imports([])
            out += d.run([])
            if "b" not in p.requests and "b" not in d.requests and "b" not in d.awaiting:
                break
            assert time.monotonic() - t0 < LEASE_S / 3, "b waited behind the silent decode worker"
            time.sleep(0.002)
        b_tokens = [t for e in out if isinstance(e.msg, StepOutput) for s in e.msg.seqs
                    if s.request_id == "b" for t in s.token_ids]
        assert b_tokens == run_single(engine(llama), [("b", b_ids, greedy(6))])[("b", 0)]
        assert "stuck" in p._sending and "stuck" in p.engine.exported     # still held for its D
        assert seen_peers == {silent_addr, rx.endpoint.address}

        deadline = time.monotonic() + 10         # the idle peer's thread ends; the busy one stays
        while len(sender.peers()) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sender.peers() == [silent_addr]

        out += p.run([Abort(request_id="stuck")])
        for _ in range(MAX_STEPS):
            hand_off_round(p, sender, out)
            if "stuck" not in p._sending:
                break
            time.sleep(0.01)
        assert clean(p) and clean(d)
        assert kinds(silent_sock, 1) == ["abort"]
        assert not [e for e in out if isinstance(e.msg, RequestFailed)]
        while sender.peers() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sender.peers() == []
    finally:
        sender.close()
        rx.close()
