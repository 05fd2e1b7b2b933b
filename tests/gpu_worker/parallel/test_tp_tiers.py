"""KV tiers with tensor_parallel_size=2: rank 0 decides, the follower repeats every copy on its
shard. A chat whose history goes to host memory and disk and comes back gives TP=1's greedy
tokens without tiers; every rank's tiers hold the same slots, files and loads at the end; a
file missing on the follower only is recomputed, on both ranks."""
from __future__ import annotations

import os

import pytest
import torch

from gpu_worker.kv_tiers.disk_tier import DiskBlock
from gpu_worker.kv_tiers.mirror import DEVICE_BLOCK, DISK_FILE, HOST_SLOT, SHARED_FILE, BlockSource
from gpu_worker.make_model import make_model
from gpu_worker.parallel import tp_tier_records as rec
from tests.gpu_worker.kv_tiers.conftest import (check_all_tiers, chat, prompt_hashes, run, tier_stats,
                                               tiered_engine)


def test_records_round_trip():
    h, p = bytes(range(16)), bytes(range(100, 116))
    payload = (rec.offload([3, 4], [0, 1]) + rec.disk_write(BlockSource(HOST_SLOT, 2), h, DiskBlock(p, (5, 6)))
               + rec.disk_write(BlockSource(DEVICE_BLOCK, 7), p, DiskBlock(None, (1,))) + rec.disk_forget(h)
               + rec.disk_clear() + rec.scatter(9, [1, 2, 3]) + rec.release(9)
               + rec.shared_write(BlockSource(DEVICE_BLOCK, 8), h, DiskBlock(None, (4,))))
    got = list(rec.decode(payload))
    assert [r.kind for r in got] == [rec.OFFLOAD, rec.DISK_WRITE, rec.DISK_WRITE, rec.DISK_FORGET, rec.DISK_CLEAR,
                                     rec.SCATTER, rec.RELEASE, rec.SHARED_WRITE]
    assert got[0].ids == [3, 4] and got[0].slots == [0, 1]
    assert got[1].source == BlockSource(HOST_SLOT, 2) and got[1].block_hash == h and got[1].block == DiskBlock(p, (5, 6))
    assert got[2].block == DiskBlock(None, (1,)) and got[3].block_hash == h
    assert got[5].load_id == 9 and got[5].ids == [1, 2, 3] and got[6].load_id == 9
    assert got[7].source == BlockSource(DEVICE_BLOCK, 8) and got[7].block_hash == h
    assert got[7].block == DiskBlock(None, (4,))
    sources = [BlockSource(HOST_SLOT, 4), BlockSource(DISK_FILE, -1, h), BlockSource(SHARED_FILE, -1, p)]
    assert rec.decode_sources(rec.stage_sources(sources)) == sources
    [read, forget] = rec.decode(rec.read_files(3, sources) + rec.disk_forget(p))   # fields sized by n
    assert read.kind == rec.READ_FILES and read.load_id == 3 and read.sources == sources
    assert forget.block_hash == p


def test_tp2_tiers_match_tp1_without_tiers(tmp_path):
    check_tp2_tiers(tmp_path, "cpu")


@pytest.mark.gpu
def test_tp2_tiers_match_tp1_without_tiers_on_cuda(tmp_path):
    """The CUDA paths: pinned host slots, offload and load streams, their events on each rank."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    check_tp2_tiers(tmp_path, "cuda")


def check_tp2_tiers(tmp_path, device: str) -> None:
    model_dir = str(make_model(tmp_path / "m", "qwen3", "tiny", seed=7, progress=False))
    plain = tiered_engine(model_dir, device=device)
    ref = chat(plain, 3)
    kv = tmp_path / "kv"
    eng = tiered_engine(model_dir, device=device, tensor_parallel_size=2, kv_offload_cpu_gb=0.00002,
                        kv_offload_dir=str(kv), kv_offload_disk_gb=0.001, kv_load_policy="always")
    try:
        turns = chat(eng, 3)
        assert [answer for _, answer, _ in turns] == [answer for _, answer, _ in ref]
        stats = tier_stats(eng)
        assert stats["loaded_blocks"]["cpu"] > 0 and stats["loaded_blocks"]["disk"] > 0, stats
        assert turns[-1][2] > 0                               # the history came back
        check_all_tiers(eng)                                  # every rank: same files, no staged load left
        eng.kv_tiers.disk.drain()
        files = {r: sorted(os.listdir(kv / r)) for r in ("rank0", "rank1")}
        assert files["rank0"] == files["rank1"] and any(f.endswith(".kvb") for f in files["rank0"])

        # the follower loses one file: the load stops there, and the block is forgotten on both ranks
        prompt = turns[-1][0] + turns[-1][1] + [11, 12, 13]
        tiers = eng.kv_tiers
        lost = next(h for h in prompt_hashes(eng, prompt) if h in tiers.disk and h not in tiers.host)
        os.unlink(kv / "rank1" / (lost.hex() + ".kvb"))
        before = stats["load_shortfall_blocks"]
        assert run(eng, "after-loss", prompt)[0] == run(plain, "after-loss", prompt)[0]
        assert tier_stats(eng)["load_shortfall_blocks"] > before and lost not in tiers.disk
        check_all_tiers(eng)
    finally:
        eng.close()
