"""Drain to disk: the device's and the host tier's cached blocks go to the disk tier, newest first
and within a deadline; the next engine on the directory serves them with transformers' tokens."""
from __future__ import annotations

import time

from gpu_worker.kv_tiers.drain_to_disk import drain_to_disk
from tests.gpu_worker.kv_tiers.conftest import (
    BLOCK_SIZE, check_all_tiers, prompt_hashes, run, tier_stats, tiered_engine, tokens)

TIERS = dict(kv_offload_cpu_gb=0.00002, kv_offload_disk_gb=0.001)      # a few host slots


def _held(eng) -> set[bytes]:
    """Hashes of the blocks the device and the host tier hold."""
    device = {b.hash for b in eng.block_manager.blocks_newest_first()}
    return device | {h for h, _ in eng.kv_tiers.host.hashes()}


def test_cached_blocks_reach_the_disk_and_serve_the_next_engine(llama, tmp_path):
    model_dir, hf = llama
    directory = str(tmp_path / "kv")
    eng = tiered_engine(model_dir, num_gpu_blocks=16, kv_offload_dir=directory, **TIERS)
    try:
        old = tokens(48, 1)
        run(eng, "old", old)
        history = tokens(30, 2)
        answer, _ = run(eng, "chat", history)                 # the newest: pushes "old" to the host tier
        assert len(eng.kv_tiers.host) > 0
        held = _held(eng)
        assert not held & {h for h, _ in eng.kv_tiers.disk.hashes()}
        result = drain_to_disk(eng.kv_tiers, time.monotonic() + 30)
        assert result.written == len(held) and result.left == 0, result
        assert held <= {h for h, _ in eng.kv_tiers.disk.hashes()}
        assert drain_to_disk(eng.kv_tiers, time.monotonic() + 30).written == 0     # all there already
        check_all_tiers(eng)
    finally:
        eng.close()

    prompt = history + answer + tokens(5, 3)
    eng = tiered_engine(model_dir, kv_offload_dir=directory, **TIERS)
    try:
        assert tier_stats(eng)["disk_restored_blocks"] == len(held)
        reply, cached = run(eng, "next", prompt)
        assert reply == hf.greedy(prompt, len(reply))[0]
        assert cached >= (len(history) // BLOCK_SIZE) * BLOCK_SIZE and tier_stats(eng)["loaded_blocks"]["disk"] > 0
        check_all_tiers(eng)
    finally:
        eng.close()


def test_the_deadline_bounds_the_drain(llama, tmp_path):
    model_dir, _ = llama
    eng = tiered_engine(model_dir, kv_offload_dir=str(tmp_path / "kv"), **TIERS)
    try:
        prompt = tokens(30, 4)
        run(eng, "a", prompt)
        result = drain_to_disk(eng.kv_tiers, time.monotonic() - 1)
        assert result.written == 0 and result.left == len(_held(eng)) > 0
        assert not set(prompt_hashes(eng, prompt)) & {h for h, _ in eng.kv_tiers.disk.hashes()}
        check_all_tiers(eng)
    finally:
        eng.close()
