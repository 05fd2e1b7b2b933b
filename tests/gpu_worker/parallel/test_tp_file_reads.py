"""Loads beside the step with tensor_parallel_size=2: every rank reads its own shard's files on
reader threads while a running request keeps decoding (rank 0's reads held by a latch: the other
request's tokens advance meanwhile, on both ranks), and the prompt then gives TP=1's greedy tokens
without tiers; a file corrupted on rank 1 only cuts the load at that block on both ranks; an abort
while reading leaves no read, staging or load on either rank (TIER_CHECK asks the follower). In
process: a follower answers not-ready while its own reads run."""
from __future__ import annotations

import os

import pytest
import torch

from gpu_worker.kv_tiers.block_mover import BlockMover
from gpu_worker.kv_tiers.disk_tier import DiskBlock, DiskTier
from gpu_worker.kv_tiers.mirror import DISK_FILE, HOST_SLOT, BlockSource
from gpu_worker.kv_transfer.layout import KVLayout
from gpu_worker.make_model import make_model
from gpu_worker.parallel.tp_file_reads import FollowerFileLoads
from tests.gpu_worker.kv_tiers.conftest import (MAX_STEPS, check_all_tiers, decoding, greedy, prompt_hashes, push_out,
                                               run, tier_stats, tiered_engine, tokens)
from tests.gpu_worker.kv_tiers.test_file_reads_beside import Latch


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp("m") / "qwen3", "qwen3", "tiny", seed=7, progress=False))


def _drive(eng, outputs: dict[str, list[int]], steps: int = MAX_STEPS) -> None:
    for _ in range(steps):
        if not eng.has_unfinished_requests():
            return
        for d in eng.step():
            outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert steps < MAX_STEPS or not eng.has_unfinished_requests(), "not finished"


def _beside(eng, monkeypatch, request_id: str, prompt: list[int], other: list[int]):
    """Start `other` decoding, then `request_id`, whose reads rank 0's latch holds: -> (outputs, latch)."""
    outputs = {"other-" + request_id: decoding(eng, "other-" + request_id, other, 6)}
    eng.kv_tiers.disk.drain()              # the blocks it pushed down are files: read, not queued bytes
    latch = Latch(eng.kv_tiers.disk, monkeypatch)
    eng.add_request(request_id, prompt, greedy(4))
    _drive(eng, outputs, 1)                              # admits it: every rank's reads start
    assert latch.started.wait(30)
    return outputs, latch


def test_tp2_reads_beside_a_decode_match_tp1(qwen3, tmp_path, monkeypatch):
    check_tp2_reads_beside(qwen3, tmp_path, monkeypatch, "cpu")


@pytest.mark.gpu
def test_tp2_reads_beside_a_decode_on_cuda(qwen3, tmp_path, monkeypatch):
    """The CUDA paths on each rank: payloads copied into pinned memory on its reader threads, the
    host and file stagings' H2D on its load stream, their scatters after the vote."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    check_tp2_reads_beside(qwen3, tmp_path, monkeypatch, "cuda")


def check_tp2_reads_beside(qwen3: str, tmp_path, monkeypatch, device: str) -> None:
    plain = tiered_engine(qwen3, num_gpu_blocks=32, device=device)
    kv = tmp_path / "kv"
    eng = tiered_engine(qwen3, num_gpu_blocks=32, device=device, tensor_parallel_size=2, kv_offload_cpu_gb=0.00002,
                        kv_offload_dir=str(kv), kv_offload_disk_gb=0.001, kv_load_policy="always")
    try:
        history = tokens(20, 1)
        answer, _ = run(eng, "turn-0", history)
        push_out(eng, 1)
        eng.kv_tiers.disk.drain()
        prompt = history + answer + tokens(5, 2)

        # rank 0's reads held: the other request decodes on both ranks, the prompt waits in loading
        other = tokens(9, 3)
        with monkeypatch.context() as patch:
            outputs, latch = _beside(eng, patch, "next", prompt, other)
            try:
                for _ in range(2):
                    before = len(outputs["other-next"])
                    _drive(eng, outputs, 1)
                    assert len(outputs["other-next"]) == before + 1
                    assert [s.request.request_id for s in eng.scheduler.loading] == ["next"]
                    assert "next" not in outputs
            finally:
                latch.release.set()
            _drive(eng, outputs)
        assert outputs["next"] == run(plain, "next", prompt)[0]
        assert outputs["other-next"] == run(plain, "other", other, 6)[0]
        stats = tier_stats(eng)
        assert stats["loaded_blocks"]["disk"] > 0 and stats["load_shortfall_blocks"] == 0, stats
        assert latch.threads and all(n.startswith("kvmesh-kv-read") for n in latch.threads)
        check_all_tiers(eng)                             # the follower holds no read, staging or load

        # an abort while reading: nothing left on either rank, and the next turn loads again
        push_out(eng, 2)
        eng.kv_tiers.disk.drain()
        with monkeypatch.context() as patch:
            outputs, latch = _beside(eng, patch, "aborted", prompt, tokens(9, 4))
            try:
                eng.abort_request("aborted")
                assert not eng.scheduler.loading and eng.kv_tiers.file_loads.reader.num_batches == 0
                _drive(eng, outputs, 1)
            finally:
                latch.release.set()
            _drive(eng, outputs)
        assert "aborted" not in outputs
        check_all_tiers(eng)

        # rank 1's file of one block corrupted: both ranks load the blocks before it, none after
        push_out(eng, 3)
        tiers = eng.kv_tiers
        tiers.disk.drain()
        on_disk = [h for h in prompt_hashes(eng, prompt) if h in tiers.disk and h not in tiers.host]
        assert len(on_disk) >= 2, on_disk
        bad = on_disk[1]
        path = kv / "rank1" / (bad.hex() + ".kvb")
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF                                 # a payload byte: its checksum fails there
        path.write_bytes(bytes(data))
        before = tier_stats(eng)
        outputs = {"other-c": decoding(eng, "other-c", tokens(9, 5), 4)}
        eng.add_request("corrupt", prompt, greedy(4))
        _drive(eng, outputs, 1)
        assert [s.request.request_id for s in eng.scheduler.loading] == ["corrupt"]     # beside the decode
        _drive(eng, outputs)
        assert outputs["corrupt"] == run(plain, "corrupt", prompt)[0]
        after = tier_stats(eng)
        assert after["load_shortfall_blocks"] > before["load_shortfall_blocks"], after
        assert after["loaded_blocks"]["disk"] > before["loaded_blocks"]["disk"], after   # the blocks before it
        assert bad not in tiers.disk                     # forgotten on both ranks
        check_all_tiers(eng)
        tiers.disk.drain()
        files = {r: sorted(os.listdir(kv / r)) for r in ("rank0", "rank1")}
        assert files["rank0"] == files["rank1"]
    finally:
        eng.close()
        plain.close()


def test_a_follower_answers_not_ready_until_its_reads_are_done(tmp_path, monkeypatch):
    """The follower's side in-process: TIER_LAND's answer is -1 while its reads run (rank 0 asks
    again later), then the leading file blocks that verified here; the agreed cut stages the host
    block and the file blocks before it; a release before the land leaves no read behind."""
    k, v = torch.zeros(4, 4, 1, 8), torch.zeros(4, 4, 1, 8)          # (num_blocks, bs, n_kv, hd)
    mover = BlockMover([(k, v)])
    disk = DiskTier(str(tmp_path / "kv"), 8, KVLayout("m", 4, "float32", 1, 1, 8, 1), mover.block_bytes)
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.randint(0, 256, mover.block_shape, dtype=torch.uint8, generator=gen) for _ in range(4)]
    hashes = [bytes([i]) * 16 for i in range(3)]
    for h, block in zip(hashes, blocks):
        disk.write(h, DiskBlock(None, (1, 2, 3, 4)), bytearray(block.reshape(-1).numpy()))
    disk.drain()
    path = disk._path(hashes[2])
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(bytes(data))
    host = mover.host_blocks(2)
    host[1].copy_(blocks[3])
    loads = FollowerFileLoads(mover, host, {}, disk, None)
    sources = [BlockSource(HOST_SLOT, 1)] + [BlockSource(DISK_FILE, -1, h) for h in hashes]
    try:
        with monkeypatch.context() as patch:
            latch = Latch(disk, patch)
            loads.begin(7, sources)
            assert latch.started.wait(30)
            assert loads.verified(7) == -1 and loads.verified(7) == -1        # held: not ready
            latch.release.set()
            for _ in range(1000):
                loads.reader.wait_any(0.05)
                if loads.reading[7].reads.done():
                    break
        assert loads.verified(7) == 2                   # the third file fails its checksum here
        landed = loads.land(7, 1)                       # another rank verified one file block only
        assert landed.kinds == [HOST_SLOT, DISK_FILE]
        landed.scatter(mover, [2, 0])
        for block_id, block in ((2, blocks[3]), (0, blocks[0])):
            assert torch.equal(k.view(torch.uint8)[block_id], block[0, 0])
            assert torch.equal(v.view(torch.uint8)[block_id], block[0, 1])
        assert not loads.reading and not loads.settled
        loads.begin(8, sources[1:])                     # released before its land
        loads.drop(8)
        assert not loads.reading and loads.reader.num_batches == 0 and loads.reader.in_flight_bytes == 0
        loads.check_integrity()
    finally:
        loads.close()
        disk.close()
