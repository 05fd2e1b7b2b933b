"""Blocks streamed while the prefill worker (P) still computes a prompt's later chunks: a P core with
its PrefillSender and a decode core (D) with its real KV socket, both over CPU engines, driven as
their engine threads drive them. The order of what happens is recorded as events (P's steps, the
blocks D holds), not timed: D holds blocks of the prompt before P's step that draws its first token.
Abort mid-stream, D gone mid-stream (P runs the request itself) and P gone mid-stream each leave no
block held on either side."""
from __future__ import annotations

import time

import pytest

from gpu_worker.service.core import WorkerCore
from gpu_worker.service.handoff import DecodeReceiver, PrefillSender
from services.protocol.messages import Abort, AwaitKV, Dispatch, RequestFailed, StepOutput, WorkerStatus
from services.protocol.sampling import SamplingParams
from services.security.curve import Plane
from tests.gpu_worker.kv_transfer.conftest import MAX_STEPS, engine, greedy, prompt, run_single
from tests.gpu_worker.service.test_prefill_sender import hand_off_round
from tests.gpu_worker.service.test_worker_core_handoff import clean

CHUNK = 16                 # P's tokens per step: a 70-token prompt takes 5 steps
WAIT_S = 20.0              # bound on waiting for the other side (never reached when it works)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    from gpu_worker.make_model import make_model
    return str(make_model(tmp_path_factory.mktemp("model") / "llama", arch="llama", size="tiny", progress=False))


class StreamingPair:
    def __init__(self, model: str, lease_s: float = 30.0, streams: bool = True) -> None:
        self.p = WorkerCore(engine(model, max_num_batched_tokens=CHUNK), "p", 1)
        self.p.hands_off, self.p.streams_kv = True, streams
        self.sender = PrefillSender(self.p.engine, Plane.insecure(), lease_s)
        self.d = WorkerCore(engine(model), "d", 1)
        self.rx = DecodeReceiver(self.d.engine, Plane.insecure(), "127.0.0.1", 0, lease_s)
        self.d.imports = self.rx.imports
        self.out: list = []
        self.events: list[tuple] = []          # ("p_step", n) / ("d_holds", rid, blocks) / ("first_token", rid)
        self.streamed: dict[str, int] = {}     # blocks handed to the sender while prefilling
        self.over_budget: list[str] = []       # requests the sender streamed no more of

    def submit(self, rid: str, ids: list[int], params: SamplingParams) -> None:
        self.out += self.d.run([AwaitKV(request_id=rid, epoch=1, n=params.n, reply_addr="gw", detok_addr="dt")])
        self.out += self.p.run([Dispatch(request_id=rid, epoch=1, prompt_token_ids=ids, params=params,
                                         reply_addr="gw", detok_addr="dt", handoff_to=self.rx.endpoint.address)])

    def p_round(self, inbox: list | None = None) -> None:
        """One P iteration as EngineThread runs it: step, then stream and hand off."""
        out = self.p.run(inbox or [])
        self.events.append(("p_step", self.p.num_steps))
        for env in out:
            if isinstance(env.msg, StepOutput):
                self.events += [("first_token", s.request_id) for s in env.msg.seqs
                                if s.token_ids and not any(e == ("first_token", s.request_id) for e in self.events)]
        self.out += out
        for rid, to, first, ids in self.p.take_stream_blocks():   # as EngineThread._hand_off
            if self.sender.stream(rid, to, first, ids):
                self.streamed[rid] = first + len(ids)
            else:
                self.p.stop_streaming(rid)
                self.over_budget.append(rid)
        hand_off_round(self.p, self.sender, self.out)

    def d_round(self) -> None:
        self.rx.poll()
        self.d.adopt_imports([])
        self.out += self.d.run([])

    def received(self, rid: str) -> int:
        """Blocks of rid D holds every layer of (its prefix hits included)."""
        rx = self.rx.imports._rx.get(rid)
        return 0 if rx is None else rx.first_block + int(rx.covered.all(dim=0).sum())

    def settle_stream(self, rid: str) -> None:
        """D takes every frame P streamed of rid so far (bounded wait), and records what it holds."""
        deadline = time.monotonic() + WAIT_S
        while self.received(rid) < self.streamed.get(rid, 0) and time.monotonic() < deadline:
            self.d_round()
            time.sleep(0.002)
        self.events.append(("d_holds", rid, self.received(rid)))

    def drive(self) -> None:
        deadline = time.monotonic() + 60
        for _ in range(MAX_STEPS):
            if not (self.p.has_work() or self.d.has_work() or self.p.requests or self.d.awaiting):
                return
            assert time.monotonic() < deadline, "the P/D run did not end"
            self.p_round()
            for rid in list(self.streamed):
                if rid in self.p._prefilling:
                    self.settle_stream(rid)
            self.d_round()
            time.sleep(0.001)
        raise AssertionError("the P/D run did not end")

    def tokens(self) -> dict:
        got: dict = {}
        for env in self.out:
            if isinstance(env.msg, StepOutput):
                for s in env.msg.seqs:
                    got.setdefault((s.request_id, s.index), []).extend(s.token_ids)
        return got

    def close(self) -> None:
        self.sender.close()
        self.rx.close()


def test_blocks_reach_d_while_p_still_prefills_and_the_tokens_match_one_engine(llama):
    requests = [("long", prompt(70, 1), greedy(6)),
                ("sampled", prompt(53, 2), SamplingParams(temperature=0.8, seed=5, max_tokens=5, ignore_eos=True, n=2))]
    expected = run_single(engine(llama, max_num_batched_tokens=CHUNK), requests)
    pair = StreamingPair(llama)
    try:
        for rid, ids, params in requests:
            pair.submit(rid, ids, params)
        pair.drive()
        assert pair.tokens() == expected
        first = pair.events.index(("first_token", "long"))
        held_before = [e[2] for e in pair.events[:first] if e[0] == "d_holds" and e[1] == "long"]
        assert held_before and max(held_before) >= 3, pair.events    # 4 full blocks, 3+ before the last chunk
        assert pair.streamed["long"] >= 3
        assert clean(pair.p) and clean(pair.d)
        pair.p.engine.block_manager.check_integrity()
        pair.d.engine.block_manager.check_integrity()
    finally:
        pair.close()


def test_streaming_off_sends_everything_after_the_first_token(llama):
    pair = StreamingPair(llama, streams=False)
    try:
        pair.submit("a", prompt(70, 1), greedy(4))
        pair.drive()
        assert not pair.streamed and pair.tokens()[("a", 0)] == run_single(
            engine(llama), [("a", prompt(70, 1), greedy(4))])[("a", 0)]
        assert clean(pair.p) and clean(pair.d)
    finally:
        pair.close()


def test_past_the_snapshot_budget_the_rest_goes_after_the_first_token(llama):
    pair = StreamingPair(llama)
    pair.sender.max_snapshot_bytes = 0         # no copy may wait: nothing streams
    try:
        pair.submit("a", prompt(70, 1), greedy(4))
        pair.drive()
        assert pair.over_budget == ["a"] and not pair.streamed
        assert pair.tokens()[("a", 0)] == run_single(engine(llama), [("a", prompt(70, 1), greedy(4))])[("a", 0)]
        assert clean(pair.p) and clean(pair.d)
    finally:
        pair.close()


def _until_streamed(pair: StreamingPair, rid: str, blocks: int) -> None:
    for _ in range(MAX_STEPS):
        pair.p_round()
        pair.settle_stream(rid)
        if pair.received(rid) >= blocks:
            return
    raise AssertionError("nothing was streamed")


def test_an_abort_mid_stream_frees_both_sides(llama):
    pair = StreamingPair(llama)
    try:
        pair.submit("a", prompt(90, 3), greedy(8))
        _until_streamed(pair, "a", 2)
        assert "a" in pair.p._prefilling           # P still prefills it
        pair.p_round([Abort(request_id="a")])     # the scheduler's Abort reaches P ...
        pair.out += pair.d.run([Abort(request_id="a")])   # ... and D
        deadline = time.monotonic() + WAIT_S
        while not (clean(pair.p) and clean(pair.d)) and time.monotonic() < deadline:
            pair.p_round()
            pair.d_round()
            time.sleep(0.005)
        assert clean(pair.p) and clean(pair.d)
        assert not [e for e in pair.out if isinstance(e.msg, RequestFailed)]
    finally:
        pair.close()


def test_d_gone_mid_stream_leaves_the_request_to_p_which_runs_it_and_frees_its_blocks(llama):
    ids = prompt(90, 4)
    expected = run_single(engine(llama, max_num_batched_tokens=CHUNK), [("a", ids, greedy(8))])
    pair = StreamingPair(llama, lease_s=0.5)
    try:
        pair.submit("a", ids, greedy(8))
        _until_streamed(pair, "a", 2)
        pair.rx.close()                            # D's socket is gone; P keeps prefilling
        deadline = time.monotonic() + WAIT_S
        while pair.p.requests and time.monotonic() < deadline:
            pair.p_round()
            time.sleep(0.01)
        from_p = [e.msg for e in pair.out if getattr(e.msg, "worker_id", "") == "p"]
        assert [k for m in from_p if isinstance(m, WorkerStatus) for k in m.kept] == ["a"]
        assert pair.tokens() == expected           # one stream, from P, token for token
        assert not [e for e in pair.out if isinstance(e.msg, RequestFailed)] and clean(pair.p)
    finally:
        pair.sender.close()


def test_p_gone_mid_stream_frees_d_blocks_within_the_lease(llama):
    pair = StreamingPair(llama, lease_s=0.5)
    try:
        pair.submit("a", prompt(90, 5), greedy(8))
        _until_streamed(pair, "a", 2)
        assert pair.d.engine.stats().num_free_blocks < pair.d.engine.stats().num_total_blocks
        # P stops here (dead): no more frames, no Done; D drops the transfer after its lease
        deadline = time.monotonic() + WAIT_S
        while pair.d.awaiting and time.monotonic() < deadline:
            pair.d_round()
            time.sleep(0.02)
        assert clean(pair.d)
    finally:
        pair.close()
