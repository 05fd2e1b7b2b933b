"""A hand-off that goes wrong frees its blocks on both sides and touches no other request:
mismatched layouts are refused before any byte moves; garbage, truncated, oversize,
wrong-checksum, out-of-order and misdirected frames fail their request on D with one
rate-limited log line; an abort on either side at any stage frees the blocks; P holds its
blocks until D answers."""
from __future__ import annotations

import logging

import msgspec
import pytest

from gpu_worker.kv_transfer.connector import EngineKVConsumer, EngineKVProducer
from gpu_worker.make_model import make_model
from gpu_worker.kv_transfer.layout import KVLayoutMismatch
from gpu_worker.kv_transfer.local import hand_off
from gpu_worker.kv_transfer.messages import Accept, Ack, Done, Fail, Refuse
from tests.gpu_worker.kv_transfer.conftest import (MAX_STEPS, check_clean, collect, engine, greedy, prompt,
                                                   run_single)

STEPS = 8


def prefill_on(p, rid: str, ids: list[int] | None, params=None) -> None:
    """Run rid's prefill on P (ids None: already added) until its blocks are held for the hand-off."""
    if ids is not None:
        p.add_request(rid, ids, params or greedy(STEPS), export_kv=True)
    for _ in range(MAX_STEPS):
        if rid in p.exported:
            return
        p.step()
    raise AssertionError("the prefill did not end")


def drain(eng) -> dict:
    out: dict = {}
    for _ in range(MAX_STEPS):
        if not eng.has_unfinished_requests():
            return out
        collect(out, eng.step())
    raise AssertionError("the engine did not drain")


@pytest.fixture
def pd(llama):
    """(P, D, producer, consumer) on small frames (one block of every layer each), with a
    bystander request decoding on D that every fault must leave alone."""
    p, d = engine(llama), engine(llama)
    producer, consumer = EngineKVProducer(p, max_frame_bytes=1), EngineKVConsumer(d)
    d.seen = {}                                          # every token D produced, for the bystander
    step = d.step

    def recording_step():
        deltas = step()
        collect(d.seen, deltas)
        return deltas
    d.step = recording_step
    d.add_request("bystander", prompt(20, 99), greedy(40))
    d.step()
    return p, d, producer, consumer


def finish_bystander(d, llama) -> None:
    drain(d)
    want = run_single(engine(llama), [("bystander", prompt(20, 99), greedy(40))])
    assert d.seen[("bystander", 0)] == want[("bystander", 0)]
    check_clean(d)


def test_p_holds_its_blocks_until_d_acknowledges(pd, llama):
    p, d, producer, consumer = pd
    prefill_on(p, "r", prompt(40, 1))
    held = p.block_manager.num_used_blocks
    assert held == 3
    accept = consumer.accept(producer.offer("r"))
    for frame, payload in producer.frames(accept):
        assert consumer.receive(frame, payload) is None
    assert p.block_manager.num_used_blocks == held       # sent, not yet acknowledged
    assert isinstance(consumer.complete(producer.done("r")), Ack)
    assert p.block_manager.num_used_blocks == held
    assert producer.release("r") and not producer.release("r")
    check_clean(p)
    assert p.block_manager.num_cached_blocks == 2        # its full blocks stay as prefix cache
    out = drain(d)
    assert len(out[("r", 0)]) == STEPS - 1
    finish_bystander(d, llama)


@pytest.mark.parametrize("other,field", [(dict(block_size=32), "block_size"), (dict(kv_cache_dtype="fp8"), "kv_dtype"),
                                         (dict(model_id="other"), "model_id"),
                                         (dict(quantization="fp8"), "weights_numerics")])
def test_a_layout_mismatch_is_refused_before_any_byte_moves(pd, llama, other, field):
    p, d, producer, _ = pd
    wrong = engine(llama, **other)
    consumer = EngineKVConsumer(wrong)
    prefill_on(p, "r", prompt(40, 2))
    answer = hand_off(producer, consumer, "r")
    assert isinstance(answer, Refuse) and "KV layouts differ" in answer.reason
    assert field in answer.reason                        # names the field that differs
    assert producer.bytes_sent == 0
    check_clean(p)
    check_clean(wrong)
    # P checks D's layout too, before its first frame
    prefill_on(p, "r2", prompt(40, 3))
    accept = EngineKVConsumer(d).accept(producer.offer("r2"))
    with pytest.raises(KVLayoutMismatch, match=field):
        next(producer.frames(msgspec.structs.replace(accept, layout=consumer.layout)))
    d.abort_request("r2")
    producer.release("r2")
    check_clean(p)
    finish_bystander(d, llama)


def test_other_weights_of_the_same_shape_and_name_are_refused(pd, llama, tmp_path):
    """A rolling upgrade: D already serves a fine-tune under the same model id, P the old weights."""
    p, d, producer, _ = pd
    upgraded = engine(str(make_model(tmp_path / "llama", seed=1, progress=False)), model_id=p.setup.model_id)
    consumer = EngineKVConsumer(upgraded)
    assert msgspec.structs.replace(consumer.layout, weights_digest=producer.layout.weights_digest) == producer.layout
    prefill_on(p, "r", prompt(40, 4))
    answer = hand_off(producer, consumer, "r")
    assert isinstance(answer, Refuse) and "weights_digest" in answer.reason and "different weights" in answer.reason
    assert producer.bytes_sent == 0
    check_clean(p)
    check_clean(upgraded)
    finish_bystander(d, llama)


def test_an_offer_whose_hashes_do_not_match_its_prompt_is_refused(pd, llama):
    p, d, producer, consumer = pd
    prefill_on(p, "r", prompt(40, 4))
    offer = producer.offer("r")
    forged = msgspec.structs.replace(offer, block_hashes=offer.block_hashes[::-1])
    assert isinstance(consumer.accept(forged), Refuse)
    producer.release("r")
    check_clean(p)
    finish_bystander(d, llama)


@pytest.mark.parametrize("token_id", [-1, 2**40])
def test_an_offer_of_token_ids_past_32_bits_is_refused(pd, llama, token_id):
    """Hashing such a prompt failed inside accept() with struct.error, which no caller expects: it
    ended D's engine thread (the worker) instead of refusing the offer."""
    p, d, producer, consumer = pd
    prefill_on(p, "r", prompt(40, 4))
    offer = producer.offer("r")
    forged = msgspec.structs.replace(offer, prompt_token_ids=[token_id] * len(offer.prompt_token_ids))
    answer = consumer.accept(forged)
    assert isinstance(answer, Refuse) and "prompt_token_ids" in answer.reason
    assert not d.is_importing("r") and "r" not in d.requests
    producer.release("r")
    check_clean(p)
    finish_bystander(d, llama)


@pytest.mark.parametrize("seed", [-1, 2**64 - 1])
def test_an_offer_whose_seed_is_outside_63_bits_is_refused(pd, llama, seed):
    """A seed no request can have (SamplingParams allows [0, 2**63-1]) was accepted: the first
    random draw of the imported request then raised OverflowError in the sampler's keys (-1) and
    ended D's engine thread, every request on it with it."""
    p, d, producer, consumer = pd
    prefill_on(p, "r", prompt(40, 4))
    answer = consumer.accept(msgspec.structs.replace(producer.offer("r"), seed=seed))
    assert isinstance(answer, Refuse) and "seed" in answer.reason
    assert not d.is_importing("r") and "r" not in d.requests
    producer.release("r")
    check_clean(p)
    finish_bystander(d, llama)


@pytest.mark.parametrize("field, value", [("num_cached_tokens", -1), ("num_cached_tokens", 10**6),
                                          ("cumulative_logprob", float("nan")), ("cumulative_logprob", float("inf"))])
def test_an_offer_with_an_impossible_count_or_logprob_is_refused(pd, llama, field, value):
    """Values no prefill engine sends: a cached count outside the prompt (the client's usage would
    say it), a NaN or positive cumulative logprob (every later logprob of the sample with it)."""
    p, d, producer, consumer = pd
    prefill_on(p, "r", prompt(40, 4))
    offer = producer.offer("r")
    if field == "num_cached_tokens":
        offer = msgspec.structs.replace(offer, num_cached_tokens=value)
    else:
        offer = msgspec.structs.replace(offer, samples=[msgspec.structs.replace(s, cumulative_logprob=value)
                                                        for s in offer.samples])
    answer = consumer.accept(offer)
    assert isinstance(answer, Refuse) and field.split("_")[-1] in answer.reason, answer
    assert not d.is_importing("r") and "r" not in d.requests
    producer.release("r")
    check_clean(p)
    finish_bystander(d, llama)


def _flip(b: bytes | memoryview) -> bytes:
    data = bytearray(b)
    data[len(data) // 2] ^= 0xFF
    return bytes(data)


CORRUPTIONS = {
    "checksum": lambda f, b: (f, _flip(b)),
    "truncated": lambda f, b: (f, bytes(b)[:-7]),
    "oversize": lambda f, b: (f, bytes(b) + bytes(4096)),
    "repeated_seq_no": lambda f, b: (msgspec.structs.replace(f, seq_no=0), b),    # frames come in any order, once
    "misdirected": lambda f, b: (msgspec.structs.replace(f, dst_block_ids=[0]), b),
    "wrong_shape": lambda f, b: (msgspec.structs.replace(f, shape=list(reversed(f.shape))), b),
    "wrong_dtype": lambda f, b: (msgspec.structs.replace(f, dtype="bfloat16"), b),
    "layers_out_of_range": lambda f, b: (msgspec.structs.replace(f, layer_start=5, layer_end=9), b),
}


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_a_bad_frame_fails_its_request_and_frees_its_blocks(pd, llama, kind, caplog):
    p, d, producer, consumer = pd
    prefill_on(p, "r", prompt(40, 5))
    accept = consumer.accept(producer.offer("r"))
    assert isinstance(accept, Accept)
    frames = producer.frames(accept)
    assert consumer.receive(*next(frames)) is None       # a good first frame lands
    frame, payload = CORRUPTIONS[kind](*next(frames))
    with caplog.at_level(logging.WARNING, "kvmesh.kv_transfer"):
        answer = consumer.receive(frame, payload)
        assert isinstance(answer, Fail)
        for frame, payload in frames:                    # the rest of the stream is dropped too
            assert isinstance(consumer.receive(frame, payload), Fail)
        assert isinstance(consumer.complete(producer.done("r")), Fail)
    assert len([r for r in caplog.records if r.name == "kvmesh.kv_transfer"]) == 1   # rate-limited
    assert not d.is_importing("r") and "r" not in d.requests
    producer.release("r")
    check_clean(p)
    finish_bystander(d, llama)


def test_garbage_for_an_unknown_request_is_dropped(pd, llama):
    p, d, producer, consumer = pd
    prefill_on(p, "r", prompt(40, 6))
    accept = consumer.accept(producer.offer("r"))
    frame, payload = next(producer.frames(accept))
    stray = msgspec.structs.replace(frame, request_id="bystander")   # a running, non-imported request
    assert isinstance(consumer.receive(stray, payload), Fail)
    assert "bystander" in d.requests                     # untouched
    assert isinstance(consumer.complete(Done("nobody", 1)), Fail)
    assert consumer.receive(frame, payload) is None      # the real transfer goes on
    for frame, payload in producer.frames(accept):
        if frame.seq_no > 0:
            assert consumer.receive(frame, payload) is None
    assert isinstance(consumer.complete(producer.done("r")), Ack)
    producer.release("r")
    out = drain(d)
    assert out[("r", 0)] == run_single(engine(llama), [("r", prompt(40, 6), greedy(STEPS))])[("r", 0)][1:]
    check_clean(p)
    finish_bystander(d, llama)


@pytest.mark.parametrize("stage", ["prefilling", "held", "mid_transfer", "decoding"])
def test_abort_on_p_at_every_stage(pd, llama, stage):
    p, d, producer, consumer = pd
    ids = prompt(70, 7)
    if stage == "prefilling":
        p.add_request("r", ids, greedy(STEPS), export_kv=True)
        p.step()
        p.abort_request("r")
    else:
        prefill_on(p, "r", ids)
    if stage == "held":
        p.abort_request("r")                             # the client left before the hand-off
        assert producer.offer("r") is None
    if stage == "mid_transfer":
        accept = consumer.accept(producer.offer("r"))
        frames = producer.frames(accept)
        consumer.receive(*next(frames))
        p.abort_request("r")                             # P's blocks go at once...
        assert list(frames) == []                        # ...no more of them is read...
        consumer.abort("r")                              # ...and its Abort reaches D
    if stage == "decoding":
        assert isinstance(hand_off(producer, consumer, "r"), Ack)
        d.step()
        d.abort_request("r")                             # the cancellation reaches D
    assert "r" not in d.requests
    check_clean(p)
    finish_bystander(d, llama)


@pytest.mark.parametrize("how", ["engine_abort", "consumer_abort"])
def test_abort_on_d_mid_transfer(pd, llama, how):
    p, d, producer, consumer = pd
    prefill_on(p, "r", prompt(70, 8))
    accept = consumer.accept(producer.offer("r"))
    frames = producer.frames(accept)
    assert consumer.receive(*next(frames)) is None
    assert d.block_manager.num_used_blocks > 0
    d.abort_request("r") if how == "engine_abort" else consumer.abort("r")
    assert isinstance(consumer.receive(*next(frames)), Fail)   # what P sends next is refused
    assert isinstance(consumer.complete(producer.done("r")), Fail)
    producer.release("r")                                      # on that Fail
    check_clean(p)
    finish_bystander(d, llama)


def test_no_free_blocks_on_d_is_refused_and_d_keeps_serving(llama):
    p, d = engine(llama), engine(llama, num_gpu_blocks=8)
    producer, consumer = EngineKVProducer(p), EngineKVConsumer(d)
    d.add_request("big", prompt(90, 11), greedy(4))
    d.step()                                             # holds 6 of D's 8 blocks
    prefill_on(p, "r", prompt(40, 9))                    # needs 3
    answer = hand_off(producer, consumer, "r")
    assert isinstance(answer, Refuse) and "no free KV blocks" in answer.reason
    check_clean(p)
    d.block_manager.check_integrity()
    assert d.block_manager.num_used_blocks == 6
    drain(d)                                             # "big" ends: room again
    prefill_on(p, "s", prompt(40, 10))
    assert isinstance(hand_off(producer, consumer, "s"), Ack)
    assert len(drain(d)[("s", 0)]) == STEPS - 1
    check_clean(d)


def test_aborting_one_sample_on_p_hands_off_the_others(pd, llama):
    p, d, producer, consumer = pd
    ids = prompt(40, 12)
    prefill_on(p, "r", ids, greedy(STEPS, n=3))
    p.abort_request("r", 1)
    assert [s.index for s in producer.offer("r").samples] == [0, 2]
    assert isinstance(hand_off(producer, consumer, "r"), Ack)
    check_clean(p)
    drain(d)
    want = run_single(engine(llama), [("r", ids, greedy(STEPS))])[("r", 0)]
    assert d.seen[("r", 0)] == d.seen[("r", 2)] == want[1:] and ("r", 1) not in d.seen
    finish_bystander(d, llama)


def test_aborting_the_reserving_sample_on_d_mid_transfer_keeps_the_others(pd, llama):
    p, d, producer, consumer = pd
    ids = prompt(40, 13)
    prefill_on(p, "r", ids, greedy(STEPS, n=2))
    accept = consumer.accept(producer.offer("r"))
    frames = producer.frames(accept)
    assert consumer.receive(*next(frames)) is None
    d.abort_request("r", 0)                              # sample 0's sequence reserved the blocks
    for frame, payload in frames:
        assert consumer.receive(frame, payload) is None
    assert isinstance(consumer.complete(producer.done("r")), Ack)
    producer.release("r")
    drain(d)
    want = run_single(engine(llama), [("r", ids, greedy(STEPS))])[("r", 0)]
    assert d.seen[("r", 1)] == want[1:] and ("r", 0) not in d.seen
    check_clean(p)
    finish_bystander(d, llama)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_p_waits_for_its_held_blocks_instead_of_failing(llama, async_scheduling):
    """P's pool is full of blocks held for D: a new request waits (no 'engine stuck'), and runs
    once D's answer releases them."""
    p, d = engine(llama, num_gpu_blocks=6, async_scheduling=async_scheduling), engine(llama)
    producer, consumer = EngineKVProducer(p), EngineKVConsumer(d)
    prefill_on(p, "held", prompt(60, 14))                # 4 of P's 6 blocks, held
    p.add_request("next", prompt(40, 15), greedy(STEPS), export_kv=True)   # needs 3
    for _ in range(3):
        assert p.step() == []
    assert isinstance(hand_off(producer, consumer, "held"), Ack)
    prefill_on(p, "next", None)
    assert isinstance(hand_off(producer, consumer, "next"), Ack)
    check_clean(p)
    drain(d)
    check_clean(d)


def test_a_transfer_whose_producer_goes_silent_is_dropped_on_d(pd, llama):
    """P died after D accepted (or mid-stream): D frees the blocks once the transfer has been
    idle for the timeout, and not before."""
    p, d, producer, consumer = pd
    prefill_on(p, "r", prompt(40, 16))
    accept = consumer.accept(producer.offer("r"))
    assert consumer.receive(*next(producer.frames(accept))) is None
    assert consumer.expire(30.0) == [] and d.is_importing("r")
    assert consumer.expire(0.0) == ["r"]
    assert not d.is_importing("r") and "r" not in d.requests
    producer.release("r")
    check_clean(p)
    finish_bystander(d, llama)
