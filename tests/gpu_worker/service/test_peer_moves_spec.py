"""Peer moves (test_peer_moves.py's two cores over the hand-off sockets) of a grammar-constrained
request and of engines that speculate: the peer's matcher goes on from the streamed output, a
draft model's KV of the moved context is caught up on the peer (a draft equal to the target
accepts every draft there), an MTP layer's KV and pending row move with the target's (every draft
the peer draws equals one recomputed from scratch, from its first step), speculation on one side
only needs nothing of the other; greedy and seeded tokens are one engine's. A refused move (MTP KV
on one side only) recomputes, an abort mid-transfer frees both sides; a held sequence's lookahead
slots are freed, never sent."""
from __future__ import annotations

import json

import msgspec
import pytest
import torch

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.kv_transfer.connector import EngineKVProducer
from gpu_worker.outputs import RequestError
from services.protocol.messages import Abort, MoveKV
from services.protocol.sampling import SamplingParams, StructuredOutput
from tests.gpu_worker.engine.conftest import _one_torch_thread  # noqa: F401  (fixture)
from tests.gpu_worker.kv_transfer.conftest import check_clean, engine, greedy, prompt, run_single
from tests.gpu_worker.service.test_peer_moves import SEEDED, Move, _moves
from tests.gpu_worker.service.test_worker_core_handoff import clean
from tests.gpu_worker.spec_decode.draft_models import draft_spec
from tests.gpu_worker.spec_decode.mtp_models import Recompute, mtp_spec, random_mtp, spy_first_drafts
from tests.gpu_worker.spec_decode.spec_fakes import ngram, repetitive
from tests.gpu_worker.spec_decode.test_spec_async import spec_stats
from tests.gpu_worker.structured.schema_corpus import SCHEMAS

# a random tiny model closes this object in 36 greedy tokens: a move after 7 steps lands mid-JSON
JSON = SamplingParams(temperature=0.0, max_tokens=200,
                      structured=StructuredOutput(json_schema=json.dumps(SCHEMAS[3])))
# SEEDED without its repetition penalty: the random model's draws then repeat, so n-grams match
SEEDED_NGRAM = msgspec.structs.replace(SEEDED, repetition_penalty=1.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A tiny llama with a random MTP layer: every engine's target (its loader skips the MTP
    tensors), the draft model's too, and the MTP layer of method mtp."""
    return random_mtp("llama", tmp_path_factory.mktemp("peer_moves_spec") / "llama")


def spec_of(method: str, model_dir: str) -> str | None:
    return {"": None, "ngram": ngram(k=3, lo=1, hi=3), "draft_model": draft_spec(model_dir, 3),
            "mtp": mtp_spec(3)}[method]


def move_one(move: Move, ids: list[int], params: SamplingParams, steps: int) -> list[int]:
    """Run "r" on W for `steps` steps, drain W, move it to D with its KV; returns W's tokens."""
    streamed = move.start("r", ids, params, steps=steps, min_tokens=steps)
    assert move.held == ["r"] and 0 < len(streamed)
    assert not move.w.engine._constrained               # W's matcher is gone with the request
    move.resume("r", ids, params, streamed)
    move.drive([MoveKV(request_id="r", epoch=1, to=move.d_addr, output_token_ids=streamed)])
    return streamed


CASES = {   # id: (W's method, D's method, params, prompt, W's extra engine settings)
    "json": ("", "", JSON, prompt(30, 3), {}),
    "json-ngram-async": ("ngram", "ngram", JSON, prompt(30, 3), {"async_scheduling": True}),
    "ngram": ("ngram", "ngram", greedy(30), repetitive(40, 5, 2), {}),
    "ngram-seeded": ("ngram", "ngram", SEEDED_NGRAM, repetitive(40, 5, 2), {}),
    "plain-to-ngram": ("", "ngram", greedy(30), repetitive(40, 5, 2), {}),
    "ngram-to-plain": ("ngram", "", greedy(30), repetitive(40, 5, 2), {}),
    "draft_model": ("draft_model", "draft_model", greedy(24), prompt(37, 4), {}),
    "mtp": ("mtp", "mtp", greedy(24), prompt(37, 4), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_constrained_or_speculating_request_moves_with_its_kv(model, case):
    w_method, d_method, params, ids, w_kw = CASES[case]
    # greedy: speculation is exact, so one plain engine's tokens; seeded: one engine of W's kind
    reference = engine(model, speculative_config=spec_of(w_method, model)) if params.temperature else engine(model)
    expected = run_single(reference, [("r", ids, params)])[("r", 0)]
    move = Move(model, w_kw={"speculative_config": spec_of(w_method, model), **w_kw},
                d_kw={"speculative_config": spec_of(d_method, model)})
    firsts = spy_first_drafts(move.d.engine) if d_method == "mtp" else []
    peer_before = _moves("peer")
    try:
        streamed = move_one(move, ids, params, steps=5)
        assert len(streamed) < len(expected)
        assert move.tokens()["r"] == expected                 # the grammar went on constraining
        assert _moves("peer") == peer_before + 1
        assert move.d_receiver.imports.blocks_received == -(-(len(ids) + len(streamed) - 1) // 16)
        assert clean(move.w) and clean(move.d) and not move.w.engine.exported
        if d_method in ("ngram", "draft_model", "mtp"):
            stats = spec_stats(move.d.engine)
            assert stats["proposed"] > 0
            if d_method == "draft_model":      # its KV of the moved prompt and output is the target's own
                assert stats["accepted"] == stats["proposed"]
        if d_method == "mtp":                  # its KV and W's pending row came: exact from D's first step
            ref = Recompute(model)
            assert [d for _, d in firsts] == [ref.first_draft(tokens) for tokens, _ in firsts]
            assert firsts[0][0] == ids + streamed
    finally:
        move.close()


def test_a_refused_move_of_a_constrained_mtp_request_recomputes_with_its_grammar(model):
    """W carries MTP KV, D not: D refuses the Offer (layouts differ), W frees the blocks, D
    recomputes from the Dispatch's tokens, its matcher advanced through them."""
    ids = prompt(30, 3)
    expected = run_single(engine(model), [("r", ids, JSON)])[("r", 0)]
    move, before = Move(model, w_kw={"speculative_config": mtp_spec(3)}), _moves("recompute")
    try:
        move_one(move, ids, JSON, steps=5)
        assert move.tokens()["r"] == expected and _moves("recompute") == before + 1
        assert clean(move.w) and clean(move.d) and not move.w.engine.exported
    finally:
        move.close()


def test_an_abort_during_a_speculating_constrained_move_frees_both_sides(model):
    ids = prompt(300, 7)
    spec = {"speculative_config": draft_spec(model, 3)}
    move = Move(model, w_kw=spec, d_kw=spec)
    move.slow_frames()
    try:
        streamed = move.start("r", ids, JSON, steps=3, min_tokens=3)
        move.resume("r", ids, JSON, streamed)
        move.drive([MoveKV(request_id="r", epoch=1, to=move.d_addr, output_token_ids=streamed)],
                   abort_when_importing="r")
        assert len(move.tokens()["r"]) == len(streamed)
        assert any(isinstance(e.msg, Abort) and e.dest == "dt" for e in move.out)
        assert clean(move.w) and clean(move.d) and not move.w.engine.exported
    finally:
        move.close()


def test_a_held_sequences_lookahead_slots_are_freed_and_never_offered(model):
    """A sequence holding slots past its computed tokens (a verification's draft slots) when it is
    held: they go back to the free list, the Offer names ceil((num_tokens - 1) / block_size) blocks."""
    eng = engine(model, speculative_config=ngram(k=3, lo=1, hi=3))
    eng.add_request("r", repetitive(40, 5, 2), greedy(30))
    for _ in range(3):
        eng.step()
    seq = eng.requests["r"].seqs[0]
    used = eng.block_manager.num_used_blocks
    assert eng.block_manager.allocate_slots(seq, 1 + 20) == []          # the next token + 20 drafts' slots
    assert len(seq.block_table) > -(-seq.num_computed_tokens // 16)
    assert eng.hold_for_move("r")
    assert eng.block_manager.num_used_blocks == used
    offer = EngineKVProducer(eng).offer("r")
    assert offer.num_blocks == len(offer.src_block_ids) == -(-(seq.num_tokens - 1) // 16)
    assert eng.release_export("r")
    check_clean(eng)


def test_an_mtp_engine_neither_holds_nor_takes_an_n_request(model):
    """MTP's pending row is one per request: an n > 1 request is recomputed at the peer, never
    held, and an MTP engine refuses a moved group (kv_transfer/group.py) before reserving a block."""
    eng = engine(model, speculative_config=mtp_spec(3))
    ids = prompt(20, 1)
    eng.add_request("n2", ids, greedy(30, n=2))
    for _ in range(3):
        eng.step()
    assert not eng.hold_for_move("n2")
    eng.abort_request("n2")
    free = eng.block_manager.num_free_blocks
    with pytest.raises(RequestError, match="without mtp"):
        eng.import_moved("g", ids, greedy(30, n=2), seed=0, samples=[(0, 5, 0.0), (1, 6, 0.0)],
                         outputs={0: [7], 1: [8]}, num_shared_blocks=1)
    assert eng.block_manager.num_free_blocks == free and "g" not in eng.requests
    check_clean(eng)


def _cuda_engine(model_dir: str, **kw) -> Engine:
    return Engine(EngineConfig(model=model_dir, device="cuda", dtype="float32", num_gpu_blocks=64,
                               async_scheduling=True, **kw))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["", "ngram", "draft_model", "mtp"])
def test_a_constrained_move_between_speculating_gpu_engines_streams_one_engines_tokens(model, method):
    """The CUDA path (decode graphs; mtp's keep the pre-norm states): a JSON request drained from
    W and decoded on at D, both speculating alike, streams one plain engine's tokens."""
    ids = prompt(30, 3)
    expected = run_single(_cuda_engine(model), [("r", ids, JSON)])[("r", 0)]
    spec = {"speculative_config": spec_of(method, model)}
    move = Move(model, w_kw=spec, d_kw=spec, make=_cuda_engine)
    try:
        move_one(move, ids, JSON, steps=5)
        assert move.tokens()["r"] == expected
        assert clean(move.w) and clean(move.d) and not move.w.engine.exported
    finally:
        move.close()
