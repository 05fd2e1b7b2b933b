"""The prefill/decode hand-off through WorkerCore at the stages the end-to-end tests cannot pin
down by timing: preemption on the decode worker, an abort while the request still waits in P's
queue, and an abort of one request mid-transfer while another is handed off over the same
sockets (P's sender thread, D's CURVE-less loopback receiver: the worker shells' code)."""
from __future__ import annotations

import time

from gpu_worker.kv_transfer.connector import EngineKVProducer
from gpu_worker.kv_transfer.local import hand_off
from gpu_worker.kv_transfer.messages import Ack
from gpu_worker.sequence import SequenceStatus
from gpu_worker.service.core import WorkerCore
from gpu_worker.service.handoff import AwaitedImports, DecodeReceiver, PrefillSender
from services.protocol.messages import Abort, AwaitKV, Dispatch
from services.security.curve import Plane
from tests.gpu_worker.kv_transfer.conftest import MAX_STEPS, engine, greedy, prompt, run_single
from tests.gpu_worker.service.test_prefill_sender import hand_off_round, llama  # noqa: F401  (fixture)
from tests.gpu_worker.service.test_worker_core_handoff import D_ADDR, Pair, clean


class LocalPair(Pair):
    """Pair with engines of chosen sizes."""

    def __init__(self, model: str, p_kw: dict, d_kw: dict) -> None:
        self.p = WorkerCore(engine(model, **p_kw), "p", 1)
        self.p.hands_off = True
        self.d = WorkerCore(engine(model, **d_kw), "d", 1)
        self.d.imports = AwaitedImports(self.d.engine, lease_s=5.0)
        self.producer = EngineKVProducer(self.p.engine)
        self.out: list = []

    def drive(self) -> None:
        for _ in range(MAX_STEPS):
            if not (self.p.has_work() or self.d.has_work() or self.p.requests):
                return
            self.out += self.p.run([])
            todo, _ = self.p.take_handoffs()
            for rid, _to in todo:
                answer = hand_off(self.producer, self.d.imports, rid)
                self.p.handoff_done(rid, isinstance(answer, Ack), "", self.out)
            self.d.adopt_imports([])
            self.out += self.d.run([])
        raise AssertionError("the P/D run did not end")


def test_decodes_preempted_on_d_stream_what_one_engine_streams(llama):
    requests = [(f"r{i}", prompt(33, 10 + i), greedy(40)) for i in range(3)]
    pair = LocalPair(llama, {"max_num_batched_tokens": 16}, {"num_gpu_blocks": 10})
    for rid, ids, params in requests:
        pair.submit(rid, ids, params)
    pair.drive()
    assert pair.tokens() == run_single(engine(llama), requests)
    assert pair.d.engine.scheduler.num_preemptions > 0        # D ran out of blocks mid-decode
    assert clean(pair.p) and clean(pair.d)


def test_an_abort_while_queued_on_p_frees_it_and_spares_the_running_request(llama):
    pair = LocalPair(llama, {"max_num_seqs": 1, "max_num_batched_tokens": 16}, {})
    pair.submit("a", prompt(40, 20), greedy(10))
    pair.submit("b", prompt(40, 21), greedy(10))             # a prefills in chunks; b waits for its slot
    [b_seq] = pair.p.engine.requests["b"].seqs
    assert b_seq.status is SequenceStatus.WAITING and b_seq.num_computed_tokens == 0
    pair.out += pair.p.run([Abort(request_id="b")])          # the scheduler's Abort reaches both
    pair.out += pair.d.run([Abort(request_id="b")])
    assert "b" not in pair.p.requests and "b" not in pair.d.awaiting
    pair.drive()
    got = pair.tokens()
    assert ("b", 0) not in got
    assert got[("a", 0)] == run_single(engine(llama), [("a", prompt(40, 20), greedy(10))])[("a", 0)]
    assert clean(pair.p) and clean(pair.d)


def test_aborting_one_request_mid_transfer_never_touches_the_other(llama):
    """Two hand-offs over the sockets, frames small enough that each takes several; A is aborted
    (on P and on D, as the scheduler sends it) while its frames are moving: B's tokens are one
    engine's, and both workers end with every block free."""
    p = WorkerCore(engine(llama, max_num_batched_tokens=64), "p", 1)
    p.hands_off = True
    d = WorkerCore(engine(llama), "d", 1)
    receiver = DecodeReceiver(d.engine, Plane.insecure(), "127.0.0.1", 0, lease_s=10.0)
    d.imports = receiver.imports
    sender = PrefillSender(p.engine, Plane.insecure(), lease_s=10.0)
    sender.producer.max_frame_bytes = 2048          # a frame per layer and a block or two,
    frames = sender.producer.frames                 # 5 ms apart: A's import is seen in flight by this
    sender.producer.frames = lambda *a: ((time.sleep(0.005), f)[1] for f in frames(*a))   # loop at any load
    d_addr = receiver.endpoint.address + "#worker"
    ids = {"a": prompt(200, 30), "b": prompt(200, 31)}
    out: list = []
    try:
        for rid in ("a", "b"):
            out += d.run([AwaitKV(request_id=rid, epoch=1, n=1, reply_addr="gw", detok_addr="dt")])
            out += p.run([Dispatch(request_id=rid, epoch=1, prompt_token_ids=ids[rid], params=greedy(12),
                                   reply_addr="gw", detok_addr="dt", handoff_to=d_addr)])
        aborted = False
        deadline = time.monotonic() + 120
        while (p.requests or p._sending or d.requests or d.awaiting) and time.monotonic() < deadline:
            inbox: list = []
            if not aborted and d.engine.is_importing("a"):          # A's frames are arriving at D
                inbox, aborted = [Abort(request_id="a")], True
            out += p.run(inbox)
            hand_off_round(p, sender, out)
            receiver.poll()
            d.adopt_imports([])
            out += d.run(inbox)
            time.sleep(0.001)
        assert aborted, "A's transfer was never seen in flight"
        tokens: dict = {}
        for env in out:
            for s in getattr(env.msg, "seqs", None) or []:
                tokens.setdefault(s.request_id, []).extend(s.token_ids)
        assert tokens["b"] == run_single(engine(llama), [("b", ids["b"], greedy(12))])[("b", 0)]
        assert len(tokens.get("a", [])) < 12                     # A stopped early
        assert clean(p) and clean(d)
    finally:
        sender.close()
        receiver.close()
