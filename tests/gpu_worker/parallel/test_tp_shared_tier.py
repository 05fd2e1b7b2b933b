"""The shared KV tier with tensor_parallel_size=2: each rank writes and reads its own shard's files
in a subdirectory of its own. Engine A demotes and drains a chat's history there; engine B (another
TP=2 worker on the node) serves the next turn from it with TP=1's greedy tokens without tiers; a
file missing on rank 1 only ends B's load at that block on both ranks; a TP=1 engine on the same
directory reads none of the TP=2 files."""
from __future__ import annotations

import os
import time

import pytest
import torch

from gpu_worker.kv_tiers.drain_to_disk import drain_to_disk
from gpu_worker.make_model import make_model
from tests.gpu_worker.kv_tiers.conftest import (BLOCK_SIZE, chat, check_all_tiers, prompt_hashes, push_out, run,
                                               tier_stats, tiered_engine, tokens)

KEY = bytes(range(7, 39))


def _rank_files(root) -> dict[str, set[str]]:
    """{rank suffix: its .kvb names} over the TP=2 subdirectories of the shared root."""
    out: dict[str, set[str]] = {}
    for name in os.listdir(root):
        if "-rank" in name:
            out[name.rsplit("-", 1)[1]] = {n for n in os.listdir(root / name) if n.endswith(".kvb")}
    return out


def test_tp2_engines_share_kv_rank_by_rank(tmp_path):
    check_tp2_shared(tmp_path, "cpu")


@pytest.mark.gpu
def test_tp2_engines_share_kv_rank_by_rank_on_cuda(tmp_path):
    """The CUDA paths: each rank's D2H copies of its shard for the files, its loads' H2D copies."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    check_tp2_shared(tmp_path, "cuda")


def check_tp2_shared(tmp_path, device: str) -> None:
    model_dir = str(make_model(tmp_path / "m", "qwen3", "tiny", seed=7, progress=False))
    plain = tiered_engine(model_dir, device=device)
    root = tmp_path / "shared"
    shared = dict(device=device, tensor_parallel_size=2, kv_offload_shared_dir=str(root), kv_offload_shared_gb=0.002,
                  kv_offload_shared_key=KEY, kv_load_policy="always")

    # A: a small host tier demotes to the shared tier; then A drains (a worker told to leave)
    a = tiered_engine(model_dir, kv_offload_cpu_gb=0.00002, **shared)
    try:
        assert all(KEY.hex() not in " ".join(map(str, p.args)) for p in a.runner.children)
        turns = chat(a, 2)
        assert tier_stats(a)["offloaded_blocks"]["shared"] > 0
        assert drain_to_disk(a.kv_tiers, time.monotonic() + 30).written > 0
        check_all_tiers(a)                    # every rank: its writes settled, its bound kept
    finally:
        a.close()                             # the followers' queued writes finish
    files = _rank_files(root)
    assert set(files) == {"rank0", "rank1"} and files["rank0"] == files["rank1"] and files["rank0"]

    prompt = turns[-1][0] + turns[-1][1] + tokens(5, 77)
    want = run(plain, "next-turn", prompt)[0]
    b = tiered_engine(model_dir, **shared)    # no host tier: its evictions go to the shared tier
    try:
        reply, cached = run(b, "next-turn", prompt)
        assert reply == want and cached > 0
        assert tier_stats(b)["loaded_blocks"]["shared"] * BLOCK_SIZE == cached

        # rank 1 loses one file of the next prompt: the load ends there on both ranks, no error
        push_out(b, 5)
        check_all_tiers(b)                    # settles every rank's queued writes (a queued block reads from memory)
        follow_up = prompt + reply + tokens(5, 78)
        hashes = prompt_hashes(b, follow_up)
        on_device = {h for h, _, _ in b.block_manager.cached_block_hashes()}
        first = next(i for i, h in enumerate(hashes) if h not in on_device)     # the device's hit ends here
        lost = first + 2
        assert lost < len(hashes) - 1
        subdir = next(n for n in os.listdir(root) if n.endswith("-rank1"))
        os.unlink(root / subdir / (hashes[lost].hex() + ".kvb"))
        before = tier_stats(b)
        reply, cached = run(b, "after-loss", follow_up)
        assert reply == run(plain, "after-loss", follow_up)[0]
        after = tier_stats(b)
        assert after["loaded_blocks"]["shared"] - before["loaded_blocks"]["shared"] == lost - first
        assert after["load_shortfall_blocks"] > before["load_shortfall_blocks"] and cached == lost * BLOCK_SIZE
        check_all_tiers(b)
    finally:
        b.close()

    # TP=1 on the same directory: another layout, so none of the TP=2 shards
    c = tiered_engine(model_dir, device=device, kv_offload_shared_dir=str(root), kv_offload_shared_gb=0.002,
                      kv_offload_shared_key=KEY, kv_load_policy="always")
    try:
        assert run(c, "tp1", prompt) == (want, 0)
        assert tier_stats(c)["loaded_blocks"].get("shared", 0) == 0
    finally:
        c.close()
