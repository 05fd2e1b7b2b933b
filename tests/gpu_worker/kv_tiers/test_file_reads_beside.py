"""Loads from the disk and shared tiers beside running requests: the files are read on reader
threads while another request keeps decoding (a latch holds the reads until it has stepped), then
the prompt joins with transformers' tokens; an abort while reading frees everything; a file
evicted or removed between the plan and its read ends the load there (the rest is recomputed)."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from tests.gpu_worker.kv_tiers.conftest import (
    MAX_STEPS, check_all_tiers, decoding, greedy, push_out, run, tier_stats, tiered_engine, tokens)

KEY = bytes(range(32))


def _tier_kwargs(tier: str, tmp_path) -> dict:
    if tier == "disk":      # no host tier: evictions go straight to the disk tier
        return dict(kv_offload_dir=str(tmp_path / "kv"), kv_offload_disk_gb=0.001)
    if tier == "cpu+disk":  # 3 host slots: the history's newest blocks there, the older ones on disk
        return dict(kv_offload_cpu_gb=6e-6, kv_offload_dir=str(tmp_path / "kv"), kv_offload_disk_gb=0.001)
    return dict(kv_offload_shared_dir=str(tmp_path / "shared"), kv_offload_shared_gb=0.001,
                kv_offload_shared_key=KEY)


class Latch:
    """Wraps a tier's read_file: each read waits for `release` (bounded), recording its thread."""

    def __init__(self, tier, monkeypatch, before=None) -> None:
        self.release, self.started, self.threads = threading.Event(), threading.Event(), []
        real = tier.read_file

        def held(block_hash):
            self.threads.append(threading.current_thread().name)
            self.started.set()
            assert self.release.wait(30), "the test never released the reads"
            if before is not None:
                before(block_hash)
            return real(block_hash)
        monkeypatch.setattr(tier, "read_file", held)


def _engine_with_history(model_dir, tier: str, tmp_path, **kw):
    eng = tiered_engine(model_dir, num_gpu_blocks=32, kv_load_policy="always", **_tier_kwargs(tier, tmp_path), **kw)
    history = tokens(20, 1)
    answer, _ = run(eng, "turn-0", history)
    push_out(eng, 1)
    lower = getattr(eng.kv_tiers, tier.removeprefix("cpu+"))
    lower.drain()                                   # the files are written: loads read them
    return eng, lower, history + answer + tokens(5, 2)


def _step(eng, outputs: dict[str, list[int]]) -> None:
    for d in eng.step():
        outputs.setdefault(d.request_id, []).extend(d.new_token_ids)


def _finish(eng, outputs: dict[str, list[int]]) -> None:
    for _ in range(MAX_STEPS):
        if not eng.has_unfinished_requests():
            return
        _step(eng, outputs)
    raise AssertionError("not finished")


@pytest.mark.parametrize("tiers", ["disk", "shared", "cpu+disk"])
def test_a_history_read_from_files_while_another_request_decodes(llama, tiers, tmp_path, monkeypatch):
    """cpu+disk: the host blocks are staged at admission, the disk ones once read; both land."""
    _reads_beside(llama, tiers, tmp_path, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_reads_beside_the_step_on_the_gpu(llama, tmp_path, monkeypatch):
    """The CUDA path: reader threads copy each verified payload into pinned memory (so the H2D
    copy on the load stream needs no host memcpy), host blocks staged at admission."""
    eng = _reads_beside(llama, "cpu+disk", tmp_path, monkeypatch, device="cuda", dtype="float32",
                        attention_backend="triton", cuda_graph_max_bs=16)
    eng.close()


def _reads_beside(llama, tiers: str, tmp_path, monkeypatch, **kw):
    model_dir, hf = llama
    eng, lower, prompt = _engine_with_history(model_dir, tiers, tmp_path, **kw)
    mover, staged_pinned = eng.kv_tiers.mover, []
    real_stage = mover.stage
    monkeypatch.setattr(mover, "stage", lambda sources, *a, **k: (
        staged_pinned.append(all(s.is_pinned() for s in sources)), real_stage(sources, *a, **k))[1])
    tier = tiers.removeprefix("cpu+")
    other = tokens(9, 3)
    outputs = {"other": decoding(eng, "other", other, 8)}
    latch = Latch(lower, monkeypatch)
    eng.kv_tiers.policy.bandwidth.pop(tier)         # measured again from the reads below
    try:
        eng.add_request("next", prompt, greedy(4))
        _step(eng, outputs)                          # admits "next": its reads start
        assert latch.started.wait(30)
        for _ in range(2):                           # the batch goes on while the read is held
            before = len(outputs["other"])
            _step(eng, outputs)
            assert len(outputs["other"]) == before + 1
            assert [s.request.request_id for s in eng.scheduler.loading] == ["next"]
            assert "next" not in outputs
    finally:
        latch.release.set()
    _finish(eng, outputs)
    assert outputs["next"] == hf.greedy(prompt, 4)[0]
    assert outputs["other"] == hf.greedy(other, 8)[0]
    assert latch.threads and all(name.startswith("kvmesh-kv-read") for name in latch.threads)
    stats = tier_stats(eng)
    assert stats["loaded_blocks"][tier] >= (2 if tiers == "cpu+disk" else 5), stats
    assert (stats["loaded_blocks"]["cpu"] > 0) == (tiers == "cpu+disk"), stats
    assert stats["load_shortfall_blocks"] == 0, stats
    assert stats["bandwidth_bytes_per_s"][tier] > 0                # timed on the reader threads
    assert staged_pinned and all(staged_pinned) == mover.cuda
    check_all_tiers(eng)
    return eng


def test_an_abort_while_reading_frees_everything(llama, tmp_path, monkeypatch):
    model_dir, hf = llama
    eng, disk, prompt = _engine_with_history(model_dir, "disk", tmp_path)
    other = tokens(9, 4)
    outputs = {"other": decoding(eng, "other", other, 6)}
    reader = eng.kv_tiers.file_loads.reader
    with monkeypatch.context() as patch:
        latch = Latch(disk, patch)
        try:
            eng.add_request("next", prompt, greedy(4))
            _step(eng, outputs)
            assert latch.started.wait(30) and eng.scheduler.loading
            eng.abort_request("next")
            assert not eng.scheduler.loading and not eng.scheduler._loads
            assert reader.num_batches == 0 and reader.in_flight_bytes == 0
            _step(eng, outputs)                      # the held read is discarded, not landed
        finally:
            latch.release.set()
    _finish(eng, outputs)
    assert "next" not in outputs
    assert outputs["other"] == hf.greedy(other, 6)[0]
    assert tier_stats(eng)["loaded_blocks"]["disk"] == 0
    check_all_tiers(eng)
    answer, cached = run(eng, "again", prompt)       # the files are still there: loaded again
    assert answer == hf.greedy(prompt, 4)[0] and cached >= 5 * 4
    check_all_tiers(eng)


@pytest.mark.parametrize("how", ["evicted", "removed"])
def test_a_file_gone_between_plan_and_read_ends_the_load_there(llama, how, tmp_path, monkeypatch):
    """Evicted: the tier's LRU forgot the block and its writer deleted the file while the read was
    queued (a miss, no error). Removed: the file vanished under the index (dropped, counted)."""
    model_dir, hf = llama
    eng, disk, prompt = _engine_with_history(model_dir, "disk", tmp_path)
    other = tokens(9, 5)
    outputs = {"other": decoding(eng, "other", other, 6)}
    latch = Latch(disk, monkeypatch)
    try:
        eng.add_request("next", prompt, greedy(4))
        _step(eng, outputs)
        assert latch.started.wait(30)
        [load] = eng.scheduler._loads.values()
        gone = load.hashes[1]
        if how == "evicted":
            eng.kv_tiers.forget_disk(gone)
            disk.drain()
        else:
            os.unlink(disk._path(gone))
    finally:
        latch.release.set()
    _finish(eng, outputs)
    assert outputs["next"] == hf.greedy(prompt, 4)[0]
    assert outputs["other"] == hf.greedy(other, 6)[0]
    stats = tier_stats(eng)
    assert stats["loaded_blocks"]["disk"] == 1 and stats["load_shortfall_blocks"] >= 1, stats
    # deleted outside kvmesh: counted as gone, not as damage
    assert stats["disk_corrupt_files"] == 0 and stats["disk_vanished_files"] == (0 if how == "evicted" else 1)
    assert gone not in disk
    check_all_tiers(eng)


def test_the_reader_budget_starts_batches_in_order_and_drops_free_it():
    """A batch over the budget starts alone; the next waits until the bytes in flight fall; a
    dropped batch (queued or started) leaves nothing counted."""
    from gpu_worker.kv_tiers.file_reads import FileRead, FileReader
    reader = FileReader(100, torch.device("cpu"), max_bytes=250)
    gate = threading.Event()

    def read() -> FileRead:
        assert gate.wait(30)
        return FileRead(memoryview(bytearray(100)), None, False, 1.0, 2.0)
    try:
        big = reader.submit([read] * 3)                  # 300 bytes, nothing in flight: starts
        small, later = reader.submit([read]), reader.submit([read])
        assert big.started and not small.started and reader.in_flight_bytes == 300
        reader.drop(later)                               # queued: never starts
        gate.set()
        assert len(reader.collect(big)) == 3 and small.started and reader.in_flight_bytes == 100
        reader.drop(small)                               # started: its result is discarded
        assert reader.num_batches == 0 and reader.in_flight_bytes == 0 and not later.started
        reader.check_integrity()
    finally:
        gate.set()
        reader.close()


def test_a_load_waits_while_another_rank_still_reads(llama, tmp_path, monkeypatch):
    """Rank 0's side of the vote (file_loads.ready), another rank stood in for: it answers -1 (its
    reads still run) at two schedules, then verified one file block less than this rank. The
    load waits in `loading` meanwhile, the other request decodes, and the load is cut where the
    ranks agree (the block after it forgotten, as when a follower lacks its file)."""
    model_dir, hf = llama
    eng, disk, prompt = _engine_with_history(model_dir, "disk", tmp_path)
    other = tokens(9, 6)
    outputs = {"other": decoding(eng, "other", other, 6)}
    answers, asked = [-1, -1], []

    def agree_read(load_id, verified):
        asked.append(verified)
        return answers.pop(0) if answers else verified - 1
    monkeypatch.setattr(eng.kv_tiers.mirror, "agree_read", agree_read)
    eng.add_request("next", prompt, greedy(4))
    _step(eng, outputs)                                  # admitted: its reads start
    [load] = eng.scheduler._loads.values()
    for _ in range(MAX_STEPS):
        before = len(outputs["other"])
        _step(eng, outputs)
        if len(asked) == 2:
            break
        assert len(outputs["other"]) == before + 1       # the batch goes on while the load waits
    assert "next" not in outputs and [s.request.request_id for s in eng.scheduler.loading] == ["next"]
    assert eng.kv_tiers.file_loads.awaiting_ranks == {id(load)}
    _finish(eng, outputs)
    assert outputs["next"] == hf.greedy(prompt, 4)[0] and outputs["other"] == hf.greedy(other, 6)[0]
    assert load.cut == asked[-1] - 1 and load.hashes[load.cut] not in disk
    assert tier_stats(eng)["loaded_blocks"]["disk"] == load.cut
    assert not eng.kv_tiers.file_loads.awaiting_ranks
    check_all_tiers(eng)
