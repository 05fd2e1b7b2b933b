"""A drain's peer move through two WorkerCores over the worker shells' hand-off sockets (W's
sender thread, D's CURVE-less loopback receiver): W holds a decoding request's KV at hand_back,
D opens the stream and awaits it (Dispatch.kv_from), W sends it on MoveKV, and D decodes on. The
tokens are one engine's (greedy and seeded), and every fallback (a refusing D, a W that never
sends, other tokens at the client) recomputes on D with the same tokens; nothing is left held."""
from __future__ import annotations

import time

import pytest
import torch

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.kv_transfer.cuda_ipc import export_cache
from gpu_worker.service.core import WorkerCore
from gpu_worker.service.handoff import DecodeReceiver, PrefillSender
from services import metrics
from services.protocol.messages import Abort, Dispatch, MoveKV
from services.protocol.sampling import SamplingParams
from services.security.curve import Plane
from tests.gpu_worker.kv_transfer.conftest import engine, greedy, prompt, run_single
from tests.gpu_worker.service.test_prefill_sender import hand_off_round, llama  # noqa: F401  (fixture)
from tests.gpu_worker.service.test_worker_core_handoff import clean

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=24, ignore_eos=True,
                        repetition_penalty=1.2, logprobs=1)


def _moves(outcome: str) -> float:
    return metrics.PEER_MOVES.labels(outcome).collect()[0].samples[0].value


class Move:
    """W (draining) and D, each a core with the shells' KV endpoints."""

    def __init__(self, model: str, d_kw: dict | None = None, lease_s: float = 5.0, w_kw: dict | None = None,
                 make=engine, cache_reads: bool = False) -> None:
        """cache_reads: D reads W's exported cache (--kv-transport cuda_ipc; a CPU cache through
        shared memory) instead of taking frames."""
        self.w = WorkerCore(make(model, **(w_kw or {})), "w", 1)
        self.d = WorkerCore(make(model, **(d_kw or {})), "d", 1)
        source = export_cache(self.w.engine) if cache_reads else None
        self.w_sender = PrefillSender(self.w.engine, Plane.insecure(), lease_s=lease_s, cache_source=source)
        self.d_receiver = DecodeReceiver(self.d.engine, Plane.insecure(), "127.0.0.1", 0, lease_s=lease_s,
                                         cache_reads=cache_reads)
        self.w.moves_kv, self.w.move_lease_s = True, lease_s
        self.d.imports, self.d.move_lease_s = self.d_receiver.imports, lease_s
        self.d_addr = self.d_receiver.endpoint.address + "#worker"
        self.out: list = []

    def close(self) -> None:
        self.w_sender.close()
        self.d_receiver.close()

    def slow_frames(self) -> None:
        """W sends the KV in many small frames, 5 ms apart: D's import is seen in flight by a
        driver loop however loaded the machine is (one poll could otherwise take every frame)."""
        producer = self.w_sender.producer
        producer.max_frame_bytes = 2048
        frames = producer.frames
        producer.frames = lambda *a: ((time.sleep(0.005), f)[1] for f in frames(*a))

    def tokens(self) -> dict[str, list[int]]:
        got: dict[str, list[int]] = {}
        for env in self.out:
            for s in getattr(env.msg, "seqs", None) or []:
                got.setdefault(s.request_id, []).extend(s.token_ids)
        return got

    def start(self, rid: str, ids: list[int], params: SamplingParams, steps: int, min_tokens: int = 0) -> list[int]:
        """Run rid on W for `steps` steps, and on until its client has min_tokens tokens (a grammar
        compiling holds the first draws for a time), then drain W: returns the tokens its client has."""
        self.out += self.w.run([Dispatch(request_id=rid, epoch=1, prompt_token_ids=ids, params=params,
                                         reply_addr="gw", detok_addr="dt")])
        for _ in range(steps - 1):
            self.out += self.w.run([])
        deadline = time.monotonic() + 60
        while len(self.tokens().get(rid, [])) < min_tokens and time.monotonic() < deadline:
            self.out += self.w.run([])
        self.w.settle(self.out)
        status = self.w.hand_back()
        assert status.handed_back == [rid]
        self.held = status.kv_held
        return self.tokens()[rid]

    def resume(self, rid: str, ids: list[int], params: SamplingParams, streamed: list[int]) -> None:
        self.out += self.d.run([Dispatch(request_id=rid, epoch=1, prompt_token_ids=ids, params=params,
                                         reply_addr="gw", detok_addr="dt", resumes=True, resume_output=[streamed],
                                         run=2, kv_from="w")])

    def drive(self, inbox_w: list | None = None, abort_when_importing: str = "", abort_msg=None) -> None:
        """abort_when_importing: the request aborted on both sides once D imports it (abort_msg:
        D's Abort instead, W not told)."""
        inbox, deadline = list(inbox_w or []), time.monotonic() + 120
        while (self.d.requests or self.d.awaiting or self.w.has_moves()) and time.monotonic() < deadline:
            d_inbox: list = []
            if abort_when_importing and self.d.engine.is_importing(abort_when_importing):
                if abort_msg is None:
                    inbox += [Abort(request_id=abort_when_importing)]
                d_inbox, abort_when_importing = [abort_msg or Abort(request_id=abort_when_importing)], ""
            self.out += self.w.run(inbox)
            inbox = []
            hand_off_round(self.w, self.w_sender, self.out)
            self.d_receiver.poll()
            self.d.adopt_imports(self.out)
            self.out += self.d.run(d_inbox)
            time.sleep(0.001)
        assert time.monotonic() < deadline, "the move did not end"


@pytest.mark.parametrize("params, w_kw", [(greedy(24), {}), (SEEDED, {}), (greedy(24), {"async_scheduling": True})],
                         ids=["greedy", "seeded", "greedy-async"])
def test_a_request_drained_mid_decode_goes_on_at_the_peer_with_its_kv(llama, params, w_kw):
    """With async scheduling, W's launched step settles first (its tokens go out) and then holds."""
    ids = prompt(45, 3)
    expected = run_single(engine(llama), [("r", ids, params)])[("r", 0)]
    move, peer_before = Move(llama, w_kw=w_kw), _moves("peer")
    try:
        streamed = move.start("r", ids, params, steps=7)
        assert move.held == ["r"] and 0 < len(streamed) < 24
        move.resume("r", ids, params, streamed)
        move.drive([MoveKV(request_id="r", epoch=1, to=move.d_addr, output_token_ids=streamed)])
        assert move.tokens()["r"] == expected                 # no position twice, none missing
        assert _moves("peer") == peer_before + 1
        # every position W computed came as KV: prompt + output but its last token
        assert move.d_receiver.imports.blocks_received == -(-(len(ids) + len(streamed) - 1) // 16)
        assert clean(move.w) and clean(move.d) and not move.w.engine.exported
    finally:
        move.close()


def test_a_refusing_peer_recomputes_and_nothing_stays_held(llama):
    """D's KV layout differs (another block size): it refuses the Offer and recomputes."""
    ids = prompt(40, 5)
    expected = run_single(engine(llama), [("r", ids, greedy(20))])[("r", 0)]
    move, before = Move(llama, {"block_size": 32}), _moves("recompute")
    try:
        streamed = move.start("r", ids, greedy(20), steps=5)
        move.resume("r", ids, greedy(20), streamed)
        move.drive([MoveKV(request_id="r", epoch=1, to=move.d_addr, output_token_ids=streamed)])
        assert move.tokens()["r"] == expected
        assert _moves("recompute") == before + 1
        assert clean(move.w) and clean(move.d) and not move.w.engine.exported
    finally:
        move.close()


def test_a_sender_that_never_sends_or_other_tokens_fall_back_within_the_lease(llama):
    ids = prompt(40, 6)
    expected = run_single(engine(llama), [("r", ids, greedy(20))])[("r", 0)]
    move = Move(llama, lease_s=0.3)
    try:
        streamed = move.start("r", ids, greedy(20), steps=5)
        move.resume("r", ids, greedy(20), streamed)
        move.drive()                       # no MoveKV (W died): W frees, D recomputes, both in the lease
        assert move.tokens()["r"] == expected
        assert clean(move.w) and clean(move.d) and not move.w.engine.exported
    finally:
        move.close()
    move = Move(llama)
    try:                       # W freed the KV past its lease before the MoveKV: the peer need not wait
        streamed = move.start("r", ids, greedy(20), steps=5)
        move.w.held["r"] = 0.0
        move.resume("r", ids, greedy(20), streamed)
        started = time.monotonic()
        move.drive([MoveKV(request_id="r", epoch=1, to=move.d_addr, output_token_ids=streamed)])
        assert move.tokens()["r"] == expected and time.monotonic() - started < 4.0   # not the 5 s lease
        assert clean(move.w) and clean(move.d) and not move.w.engine.exported
    finally:
        move.close()
    move = Move(llama)
    try:
        streamed = move.start("r", ids, greedy(20), steps=5)
        move.resume("r", ids, greedy(20), streamed[:-1])     # the client lacks the last token
        move.drive([MoveKV(request_id="r", epoch=1, to=move.d_addr, output_token_ids=streamed[:-1])])
        got = move.tokens()["r"]
        assert got[:len(streamed)] == streamed and got[len(streamed):] == expected[len(streamed) - 1:]
        assert clean(move.w) and clean(move.d) and not move.w.engine.exported
    finally:
        move.close()


def test_a_rerun_that_takes_over_an_awaited_move_forgets_the_move(llama):
    """W dies before its MoveKV and the scheduler re-runs the request on D (a resumed Dispatch
    without kv_from) while D still awaits the KV: D runs it from the tokens, the move is forgotten
    (nothing of it left to fall back on), and a late Abort of the finished request is a no-op."""
    ids = prompt(40, 8)
    expected = run_single(engine(llama), [("r", ids, greedy(20))])[("r", 0)]
    move = Move(llama)
    try:
        streamed = move.start("r", ids, greedy(20), steps=5)
        move.resume("r", ids, greedy(20), streamed)
        assert "r" in move.d.awaiting
        move.out += move.d.run([Dispatch(request_id="r", epoch=1, prompt_token_ids=ids, params=greedy(20),
                                         reply_addr="gw", detok_addr="dt", resumes=True, resume_output=[streamed],
                                         run=3)])
        assert "r" not in move.d.awaiting and not move.d._peer_moves
        move.w.held.clear()                # W is gone: its held KV goes with it
        move.w.engine.release_export("r")
        move.drive()
        assert move.tokens()["r"] == expected
        move.out += move.d.run([Abort(request_id="r")])
        assert clean(move.w) and clean(move.d)
    finally:
        move.close()


def test_an_abort_during_the_peer_hand_off_frees_both_sides(llama):
    ids = prompt(300, 7)
    move = Move(llama)
    move.slow_frames()
    try:
        streamed = move.start("r", ids, greedy(20), steps=3)
        move.resume("r", ids, greedy(20), streamed)
        move.drive([MoveKV(request_id="r", epoch=1, to=move.d_addr, output_token_ids=streamed)],
                   abort_when_importing="r")
        assert len(move.tokens()["r"]) == len(streamed)      # nothing after the abort
        assert any(isinstance(e.msg, Abort) and e.dest == "dt" for e in move.out)   # D ended the stream
        assert clean(move.w) and clean(move.d) and not move.w.engine.exported
    finally:
        move.close()


def _cuda_engine(model: str, **kw) -> Engine:
    return Engine(EngineConfig(model=model, device="cuda", dtype="float32", num_gpu_blocks=64,
                               async_scheduling=True, **kw))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("params", [greedy(24), SEEDED], ids=["greedy", "seeded"])
def test_a_peer_move_between_two_gpu_engines_streams_one_engines_tokens(llama, params):
    """The CUDA path: W settles its launched step, its frames are gathered from the device cache
    and D writes them into its own; the tokens are those of one engine that never moved."""
    ids = prompt(45, 3)
    expected = run_single(_cuda_engine(llama), [("r", ids, params)])[("r", 0)]
    move, peer_before = Move(llama, make=_cuda_engine), _moves("peer")
    try:
        streamed = move.start("r", ids, params, steps=7)
        assert move.held == ["r"]
        move.resume("r", ids, params, streamed)
        move.drive([MoveKV(request_id="r", epoch=1, to=move.d_addr, output_token_ids=streamed)])
        assert move.tokens()["r"] == expected and _moves("peer") == peer_before + 1
        assert clean(move.w) and clean(move.d) and not move.w.engine.exported
    finally:
        move.close()
