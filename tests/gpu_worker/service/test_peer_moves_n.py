"""Peer moves of n > 1 requests (kv_transfer/group.py) through two WorkerCores over the shells'
hand-off sockets: every sample still going moves with its KV (the shared prompt blocks once, each
sample's own after them), a sample that ended stays ended, and each live sample streams exactly
what one engine would have (greedy and seeded). An abort mid-move leaves no block on either side."""
from __future__ import annotations

import msgspec
import pytest
import torch

from gpu_worker.service.move_cost import MoveCosts, TransferRates
from gpu_worker.prefill_rate import PrefillRate
from services.protocol.messages import Abort, Dispatch, MoveKV
from services.protocol.sampling import SamplingParams
from tests.gpu_worker.kv_transfer.conftest import collect, engine, greedy, prompt, run_single
from tests.gpu_worker.service.test_peer_moves import Move, _cuda_engine, _moves
from tests.gpu_worker.service.test_prefill_sender import llama  # noqa: F401  (fixture)
from tests.gpu_worker.service.test_worker_core_handoff import clean
from tests.gpu_worker.spec_decode.draft_models import draft_spec
from tests.gpu_worker.spec_decode.spec_fakes import ngram
from tests.gpu_worker.spec_decode.test_spec_async import spec_stats

BS = 16


def _seeded(n: int, stop: list[int] = ()) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=12, ignore_eos=True, n=n,
                          repetition_penalty=1.2, logprobs=1, stop_token_ids=list(stop))


def _per_sample(move: Move) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {}
    for env in move.out:
        for s in getattr(env.msg, "seqs", None) or []:
            got.setdefault(s.index, []).extend(s.token_ids)
    return got


def _stop_for_sample_1(model: str, ids: list[int], n: int) -> SamplingParams:
    """Seeded sampling where sample 1 ends within its first 3 tokens on a stop token that the
    other samples do not draw before it (a short run finds one)."""
    first = run_single(engine(model), [("r", ids, msgspec.structs.replace(_seeded(n), max_tokens=3))])
    for pos, token in enumerate(first[("r", 1)]):
        if all(token not in first[("r", i)][:pos + 1] for i in range(n) if i != 1):
            return _seeded(n, [token])
    raise AssertionError("no stop token ends sample 1 alone")


def _move(llama, ids, params, steps, end_sample=None, make=engine):
    """Run on W, end a sample if asked, drain; D resumes from the client's tokens with the KV."""
    move = Move(llama, make=make)
    move.out += move.w.run([Dispatch(request_id="r", epoch=1, prompt_token_ids=ids, params=params,
                                     reply_addr="gw", detok_addr="dt")])
    for _ in range(steps - 1):
        move.out += move.w.run([])
    if end_sample is not None:                 # the client's abort of one sample (n > 1)
        move.w.engine.abort_request("r", end_sample)
    move.w.settle(move.out)
    status = move.w.hand_back()
    assert status.kv_held == ["r"]
    streamed = _per_sample(move)
    outputs = [streamed.get(i, []) for i in range(params.n)]
    finished = {s.index for e in move.out for s in (getattr(e.msg, "seqs", None) or []) if s.finish_reason}
    ended = sorted(finished | ({end_sample} if end_sample is not None else set()))
    move.out += move.d.run([Dispatch(request_id="r", epoch=1, prompt_token_ids=ids, params=params, reply_addr="gw",
                                     detok_addr="dt", resumes=True, resume_output=outputs, resume_ended=ended,
                                     run=2, kv_from="w")])
    kv = MoveKV(request_id="r", epoch=1, to=move.d_addr, output_token_ids=outputs[0], sample_outputs=outputs,
                ended=ended)
    return move, outputs, ended, kv


@pytest.mark.parametrize("case", ["greedy-n2", "greedy-n3", "seeded-n3"])
def test_every_sample_of_an_n_request_goes_on_at_the_peer_with_its_kv(llama, case):
    """A sample that ended before the move (its client's abort; a stop token) stays ended; the
    others stream one engine's tokens. D rebuilds one group: the prompt's blocks shared."""
    ids = prompt(45, 3)
    n = int(case[-1])
    if case.startswith("greedy"):
        params, end_sample = greedy(24, n=n), 1
    else:
        params, end_sample = _stop_for_sample_1(llama, ids, n), None
    expected = run_single(engine(llama), [("r", ids, params)])
    before = _moves("peer")
    move, outputs, ended, kv = _move(llama, ids, params, steps=6, end_sample=end_sample)
    tables: list[list[list[int]]] = []          # D's live samples' block tables, as admitted
    admit = move.d.engine._admit_group

    def admit_and_look(rid: str) -> None:
        admit(rid)
        tables.append([list(s.block_table) for s in move.d.engine.requests[rid].seqs if s.block_table])

    move.d.engine._admit_group = admit_and_look
    try:
        assert 1 in ended and len(ended) < n
        move.drive([kv])
        assert _moves("peer") == before + 1
        got = _per_sample(move)
        for i in range(params.n):
            if i in ended:            # over before the move: nothing more streams for it
                assert got.get(i, []) == outputs[i]
            else:                     # no position twice, none missing: one engine's tokens
                assert got[i] == expected[("r", i)], i
        # the prompt's full blocks came once, then each live sample's own
        live = [i for i in range(params.n) if i not in ended]
        shared = len(ids) // BS
        own = sum(-(-(len(ids) + len(outputs[i]) - 1) // BS) - shared for i in live)
        assert move.d_receiver.imports.blocks_received == shared + own
        assert len(tables) == 1 and len(tables[0]) == len(live)    # one group, each live sample in it
        assert all(t[:shared] == tables[0][0][:shared] for t in tables[0])   # the prompt's blocks shared
        assert clean(move.w) and clean(move.d) and not move.w.engine.exported
    finally:
        move.close()


@pytest.mark.parametrize("w_spec, d_spec", [("ngram", "draft_model"), ("draft_model", "draft_model")])
def test_an_n_request_moves_between_speculating_engines(llama, w_spec, d_spec):
    """n-gram drafts need nothing moved; a draft model on D computes its KV over each live sample's
    context (the shared prompt blocks once): with the target as its own draft every draft D
    proposes is accepted, and each sample streams one plain engine's greedy tokens."""
    specs = {"ngram": ngram(k=3, lo=1, hi=3), "draft_model": draft_spec(llama, 3)}
    ids, params = prompt(45, 3), greedy(24, n=2)
    expected = run_single(engine(llama), [("r", ids, params)])

    methods = iter([w_spec, d_spec])              # Move makes W's engine first, then D's

    def make(model: str):
        return engine(model, speculative_config=specs[next(methods)])

    move, outputs, ended, kv = _move(llama, ids, params, steps=5, make=make)
    try:
        assert ended == []
        move.drive([kv])
        got = _per_sample(move)
        assert all(got[i] == expected[("r", i)] for i in range(2))
        stats = spec_stats(move.d.engine)
        assert stats["proposed"] > 0 and stats["accepted"] == stats["proposed"]
        assert clean(move.w) and clean(move.d) and not move.w.engine.exported
    finally:
        move.close()


def test_an_abort_mid_move_of_an_n_request_frees_both_sides(llama):
    ids = prompt(300, 7)
    move, outputs, ended, kv = _move(llama, ids, greedy(20, n=2), steps=3)
    move.slow_frames()
    try:
        move.drive([kv], abort_when_importing="r")
        assert _per_sample(move) == {i: out for i, out in enumerate(outputs) if out}   # nothing after it
        assert clean(move.w) and clean(move.d) and not move.w.engine.exported
        move.w.engine.block_manager.check_integrity()
        move.d.engine.block_manager.check_integrity()
    finally:
        move.close()


def test_the_drain_weighs_every_samples_blocks_and_tokens(llama):
    """Move or recompute (move_cost.py) for n = 3: the KV is the shared prompt blocks plus each
    sample's own; the recompute, every sample's computed tokens."""
    seen: list[tuple[int, int]] = []

    class Spy(MoveCosts):
        def choose_blocks(self, num_tokens, num_blocks):
            seen.append((num_tokens, num_blocks))
            return super().choose_blocks(num_tokens, num_blocks)

    ids = prompt(40, 9)
    move = Move(llama)
    try:
        move.w.move_costs = Spy(TransferRates("frames"), PrefillRate(), block_bytes=1, block_size=BS)
        move.out += move.w.run([Dispatch(request_id="r", epoch=1, prompt_token_ids=ids, params=greedy(20, n=3),
                                         reply_addr="gw", detok_addr="dt")])
        for _ in range(4):
            move.out += move.w.run([])
        move.w.settle(move.out)
        computed = len(ids) + len(_per_sample(move)[0]) - 1     # per sample: all but its last token
        assert move.w.hand_back().kv_held == ["r"]
        assert seen == [(3 * computed, len(ids) // BS + 3 * (-(-computed // BS) - len(ids) // BS))]
        move.w.engine.release_export("r")
        move.w.held.clear()
        assert clean(move.w)
    finally:
        move.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("params", [greedy(24, n=3), _seeded(2)], ids=["greedy-n3", "seeded-n2"])
def test_an_n_request_moves_between_two_gpu_engines_with_one_engines_tokens(llama, params):
    """The CUDA path (async scheduling settled first, device gathers and writes): sample 1 ended
    by its client, the others go on with one engine's tokens."""
    ids = prompt(45, 3)
    expected = run_single(_cuda_engine(llama), [("r", ids, params)])
    move, outputs, ended, kv = _move(llama, ids, params, steps=6, end_sample=1, make=_cuda_engine)
    try:
        move.drive([kv])
        got = _per_sample(move)
        assert all(got[i] == expected[("r", i)] for i in range(params.n) if i not in ended)
        assert clean(move.w) and clean(move.d) and not move.w.engine.exported
    finally:
        move.close()


@pytest.mark.parametrize("when", ["before-offer", "importing", "recomputed"])
def test_a_sample_stopped_at_the_peer_mid_move_ends_alone(llama, when):
    """The client's stop of one sample reaches D (its stream's worker now) while the KV is
    awaited: that sample ends, the others go on with one engine's tokens (with the KV, or
    recomputed where W's KV does not come: its MoveKV names other tokens), nothing leaks."""
    ids = prompt(300, 7) if when == "importing" else prompt(45, 3)   # long: the import is seen in flight
    params = greedy(20, n=3)
    expected = run_single(engine(llama), [("r", ids, params)])
    move, outputs, ended, kv = _move(llama, ids, params, steps=3)
    stop = Abort(request_id="r", index=2, reason="stop")
    try:
        if when != "importing":
            move.out += move.d.run([stop])
            other = [outputs[0][:-1], *outputs[1:]]
            move.drive([kv if when == "before-offer" else msgspec.structs.replace(kv, sample_outputs=other)])
        else:
            move.slow_frames()
            move.drive([kv], abort_when_importing="r", abort_msg=stop)
        got = _per_sample(move)
        assert got[0] == expected[("r", 0)] and got[1] == expected[("r", 1)]
        assert got.get(2, []) == outputs[2]                     # nothing after its stop
        assert not any(isinstance(e.msg, Abort) for e in move.out)   # the stream was not ended
        assert clean(move.w) and clean(move.d) and not move.w.engine.exported
        move.d.engine.block_manager.check_integrity()
    finally:
        move.close()
