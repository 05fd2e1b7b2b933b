"""A drain's move-or-recompute choice (gpu_worker/service/move_cost.py): the rule with given
rates, the rates it reads, and two drains through W's and D's cores, one whose measured KV rate
is too slow (the request is recomputed on D: one engine's tokens) and one over a cache read (the
KV moves, and the send's rate is measured)."""
from __future__ import annotations

import pytest

from gpu_worker.prefill_rate import PrefillRate
from gpu_worker.service.move_cost import DEFAULT_BYTES_PER_S, MoveCosts, TransferRates, choose_way
from services import metrics
from services.protocol.messages import Dispatch, MoveKV
from tests.gpu_worker.kv_transfer.conftest import engine, greedy, prompt, run_single
from tests.gpu_worker.service.test_peer_moves import Move
from tests.gpu_worker.service.test_prefill_sender import llama  # noqa: F401  (fixture)
from tests.gpu_worker.service.test_worker_core_handoff import clean

MB = 1_000_000


def _drained(way: str) -> float:
    return metrics.DRAIN_WAYS.labels(way).collect()[0].samples[0].value


def test_a_long_request_over_host_frames_is_recomputed_and_over_a_cache_read_moves():
    """2,048 tokens of an 8B model (278 MB) with a 40k tokens/s prefill: 0.55 GB/s frames take
    ~0.5 s against ~51 ms of recompute; a device-to-device read at 50 GB/s takes ~6 ms."""
    slow = choose_way(2048, 278 * MB, 0.55e9, 40_000.0)
    assert slow.way == "recompute" and slow.transfer_s == pytest.approx(0.505, rel=0.01)
    assert slow.recompute_s == pytest.approx(0.0512, rel=0.01)
    assert choose_way(2048, 278 * MB, 50e9, 40_000.0).way == "kv"
    assert choose_way(2048, 278 * MB, 0.55e9, None).way == "kv"          # no prefill measured yet
    # the margin leans to the KV: 60 ms of transfer against 50 ms of recompute still moves it
    assert choose_way(2000, 60 * MB, 1e9, 40_000.0).way == "kv"
    assert choose_way(2000, 60 * MB, 1e9, 40_000.0, margin=1.0).way == "recompute"


def test_costs_price_whole_blocks_at_the_last_paths_rate():
    rates, prefill = TransferRates("shm"), PrefillRate()
    costs = MoveCosts(rates, prefill, block_bytes=MB, block_size=16)
    prefill.observe(1000, 1.0)                          # 1,000 tokens/s: 17 tokens take 17 ms
    first = costs.choose(17)                            # 2 blocks at the shm default
    assert first.transfer_s == pytest.approx(2 * MB / DEFAULT_BYTES_PER_S["shm"]) and first.way == "kv"
    rates.observe("frames", 1 * MB, 0.001)              # a small send: mostly round trips, no sample
    assert rates.expected()[0] == "shm"
    rates.observe("frames", 40 * MB, 4.0)               # the last send took frames, at 10 MB/s
    assert rates.expected() == ("frames", 10 * MB) and costs.choose(17).way == "recompute"
    assert "frames at 0.01 GB/s (measured)" in costs.describe()


def _costs(move: Move) -> MoveCosts:
    w = move.w
    return MoveCosts(move.w_sender.rates, w.engine.scheduler.prefill_rate, move.w_sender.block_bytes,
                     move.w_sender.producer.layout.block_size)


def test_a_drain_whose_kv_moves_too_slowly_recomputes_on_the_peer(llama):
    ids = prompt(60, 4)
    expected = run_single(engine(llama), [("r", ids, greedy(16))])[("r", 0)]
    move, before = Move(llama), (_drained("kv"), _drained("recompute"))
    move.w.move_costs = _costs(move)
    move.w_sender.rates.min_bytes = 0                   # the tiny model's sends are KBs
    move.w_sender.rates.observe("frames", 1000, 1.0)    # measured: 1 kB/s
    try:
        streamed = move.start("r", ids, greedy(16), steps=4)
        assert move.w.engine.scheduler.prefill_rate.rate      # the prompt's step measured it
        assert move.held == [] and not move.w.engine.exported # handed back without its KV
        assert (_drained("kv"), _drained("recompute")) == (before[0], before[1] + 1)
        # the scheduler dispatches it to D without kv_from: D recomputes prompt + streamed tokens
        move.out += move.d.run([Dispatch(request_id="r", epoch=1, prompt_token_ids=ids, params=greedy(16),
                                         reply_addr="gw", detok_addr="dt", resumes=True,
                                         resume_output=[streamed], run=2)])
        move.drive()
        assert move.tokens()["r"] == expected
        assert clean(move.w) and clean(move.d)
    finally:
        move.close()


def test_a_drain_moves_the_kv_by_a_cache_read_when_that_is_faster(llama):
    """--kv-transport cuda_ipc: the peer reads the draining worker's cache (here a CPU cache in
    shared memory); the send is measured for the next drain."""
    ids = prompt(60, 4)
    expected = run_single(engine(llama), [("r", ids, greedy(16))])[("r", 0)]
    move, before = Move(llama, cache_reads=True), _drained("kv")
    move.w.move_costs = _costs(move)
    move.w_sender.rates.min_bytes = 0                   # the tiny model's sends are KBs
    try:
        streamed = move.start("r", ids, greedy(16), steps=4)
        assert move.held == ["r"] and _drained("kv") == before + 1
        move.resume("r", ids, greedy(16), streamed)
        move.drive([MoveKV(request_id="r", epoch=1, to=move.d_addr, output_token_ids=streamed)])
        assert move.tokens()["r"] == expected
        assert move.d_receiver.endpoint.cache_reader.blocks_read > 0       # no frame carried it
        assert "cache" in move.w_sender.rates.measured
        assert clean(move.w) and clean(move.d) and not move.w.engine.exported
    finally:
        move.close()
