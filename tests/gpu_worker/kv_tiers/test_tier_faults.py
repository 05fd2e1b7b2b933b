"""Faults of the lower tiers never fail a request nor feed wrong KV: corrupt, truncated, foreign
and other-layout files are dropped and recomputed; a failed write costs its block only, a disk
that keeps refusing writes turns them off with one warning while its blocks still load, and the
blocks of a directory removed mid-run leave the index; a load racing with the eviction of its own
source blocks still reads them. Every test ends with zero leaked blocks."""
from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest
from prometheus_client import REGISTRY

from tests.gpu_worker.kv_tiers.conftest import check_all_tiers, chat, prompt_hashes, run, tier_stats, tiered_engine
from gpu_worker.kv_tiers import disk_reconcile, disk_tier, tier_file
from services import metrics

DISK = dict(kv_offload_disk_gb=0.001)


def _flip_a_byte(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0x01
    open(path, "wb").write(bytes(data))


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def _other_layout(path: str) -> None:
    """A well-formed file with a valid checksum, but written by an engine of another layout."""
    data = open(path, "rb").read()
    n = int.from_bytes(data[:4], "little")
    header = msgspec.msgpack.decode(data[4:4 + n], type=tier_file.TierFileHeader)
    layout = msgspec.structs.replace(header.layout, num_layers=header.layout.num_layers + 1)
    parts = tier_file.encode(header.block_hash, layout, data[4 + n:])
    open(path, "wb").write(b"".join(bytes(p) for p in parts))


def _another_block(path: str) -> None:
    """A valid file of another block put under this block's name."""
    others = [f for f in os.listdir(os.path.dirname(path)) if f.endswith(".kvb") and f != os.path.basename(path)]
    shutil.copyfile(os.path.join(os.path.dirname(path), others[0]), path)


@pytest.mark.parametrize("damage", [_flip_a_byte, _truncate, _other_layout, _another_block],
                         ids=["flipped-byte", "truncated", "other-layout", "foreign-block"])
def test_a_damaged_file_is_dropped_and_its_block_recomputed(llama, damage, tmp_path):
    model_dir, hf = llama
    directory = tmp_path / "kv"
    eng = tiered_engine(model_dir, kv_offload_dir=str(directory), **DISK)

    def damage_second_block(eng, turn, next_prompt):
        eng.kv_tiers.disk.drain()                            # the background writes are on disk
        damage(str(directory / (prompt_hashes(eng, next_prompt)[1].hex() + ".kvb")))

    turns = chat(eng, 2, between=damage_second_block)
    for prompt, answer, _ in turns:
        assert answer == hf.greedy(prompt, len(answer))[0]
    stats = tier_stats(eng)
    assert stats["disk_corrupt_files"] == 1 and stats["load_shortfall_blocks"] >= 1, stats
    assert stats["loaded_blocks"]["disk"] == 1          # block 0 loaded, block 1 on is recomputed
    assert turns[1][2] == 4                              # cached_tokens: the one loaded block
    check_all_tiers(eng)                                 # the damaged file is gone from the directory


def test_block_files_are_private(llama, tmp_path):
    model_dir, _ = llama
    directory = tmp_path / "kv"
    directory.mkdir(mode=0o755)
    (directory / ("ab" * 16 + ".kvb")).write_bytes(b"left by an earlier run")
    (directory / "notes.txt").write_text("not ours")
    eng = tiered_engine(model_dir, kv_offload_dir=str(directory), **DISK)
    chat(eng, 2)
    eng.kv_tiers.disk.drain()
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    files = [f for f in os.listdir(directory) if f.endswith(".kvb")]
    assert files and all(stat.S_IMODE(os.stat(directory / f).st_mode) == 0o600 for f in files)
    assert "ab" * 16 + ".kvb" not in files and (directory / "notes.txt").exists()
    check_all_tiers(eng)


class DiskEvents:
    """The disk blocks the KV events announce (what the prefix index and the router believe)."""

    def __init__(self, eng) -> None:
        self.held: set[bytes] = {h for h, _ in eng.kv_tiers.disk.hashes()}
        eng.block_manager.add_listener(self)

    def on_stored(self, block_hash, parent, token_ids, tier="gpu") -> None:
        if tier == "disk":
            self.held.add(block_hash)

    def on_removed(self, block_hash, tier="gpu") -> None:
        if tier == "disk":
            self.held.discard(block_hash)

    def on_cleared(self) -> None:
        self.held.clear()


def fail_writes(monkeypatch, err: int, times: int | None = None) -> list[int]:
    """The disk tier's next `times` writes (all: None) fail with `err`; -> a list of the failures."""
    real, failed = disk_tier.write_file, []

    def write_file(path, tmp, parts, exclusive):
        if times is None or len(failed) < times:
            failed.append(err)
            raise OSError(err, os.strerror(err))
        return real(path, tmp, parts, exclusive)
    monkeypatch.setattr(disk_tier, "write_file", write_file)
    return failed


def test_one_failed_write_costs_its_block_and_the_disk_tier_goes_on(llama, tmp_path, monkeypatch):
    model_dir, hf = llama
    eng = tiered_engine(model_dir, kv_offload_dir=str(tmp_path / "kv"), **DISK)
    events = DiskEvents(eng)

    def one_eio(eng, turn, next_prompt):
        if turn == 0:
            eng.kv_tiers.disk.drain()   # the failing write is one of the next turn's, whatever the load
            fail_writes(monkeypatch, errno.EIO, times=1)

    turns = chat(eng, 3, between=one_eio)
    for prompt, answer, _ in turns:
        assert answer == hf.greedy(prompt, len(answer))[0]
    stats = tier_stats(eng)
    assert stats["disk_enabled"] and stats["disk_write_errors"] == 1, stats
    assert stats["disk_blocks"] == len(eng.kv_tiers.disk) > 0 and turns[2][2] > 0
    eng.kv_tiers.disk.drain()
    eng.kv_tiers.poll_disk()
    assert events.held == {h for h, _ in eng.kv_tiers.disk.hashes()}    # the dropped block announced gone
    check_all_tiers(eng)


def test_blocks_on_disk_still_load_while_writes_are_off(llama, tmp_path, monkeypatch, caplog):
    model_dir, hf = llama
    eng = tiered_engine(model_dir, kv_offload_dir=str(tmp_path / "kv"), **DISK)
    loaded = []

    def full_disk(eng, turn, next_prompt):
        eng.kv_tiers.disk.drain()       # the writes queued so far land (or fail) before the disk fills
        if turn == 0:
            fail_writes(monkeypatch, errno.ENOSPC)
        loaded.append(tier_stats(eng)["loaded_blocks"]["disk"])

    with caplog.at_level("WARNING", logger="kvmesh.kv_tiers"):
        turns = chat(eng, 3, between=full_disk)
    for prompt, answer, _ in turns:
        assert answer == hf.greedy(prompt, len(answer))[0]
    stats = tier_stats(eng)
    assert not stats["disk_enabled"] and stats["disk_blocks"] > 0, stats
    assert stats["loaded_blocks"]["disk"] > loaded[1] > 0       # the third turn loaded with writes off
    assert sum("turned off" in r.getMessage() for r in caplog.records) == 1
    metrics.publish_kv_tiers(stats)
    assert REGISTRY.get_sample_value("kvmesh_kv_tier_disk_enabled") == 0
    check_all_tiers(eng)


def test_a_removed_directory_turns_writes_off_and_its_blocks_leave_the_index(llama, tmp_path, caplog):
    model_dir, hf = llama
    directory = tmp_path / "kv"
    eng = tiered_engine(model_dir, kv_offload_dir=str(directory), **DISK)
    events = DiskEvents(eng)

    def remove(eng, turn, next_prompt):
        if turn == 0:
            eng.kv_tiers.disk.drain()        # no file half-made while the directory goes
            shutil.rmtree(directory)

    with caplog.at_level("WARNING", logger="kvmesh.kv_tiers"):
        turns = chat(eng, 3, between=remove)
    for prompt, answer, _ in turns:
        assert answer == hf.greedy(prompt, len(answer))[0]
    stats = tier_stats(eng)
    assert not stats["disk_enabled"] and stats["disk_write_errors"] >= 3, stats
    assert sum("turned off" in r.getMessage() for r in caplog.records) == 1
    disk = eng.kv_tiers.disk
    assert len(disk) > 0                         # blocks no load asked for: still counted...
    later = time.monotonic() + disk_reconcile.EVERY_S + 1
    disk.clock = lambda: later
    for _ in range(10):                          # ...until the periodic check's batches settle,
        disk.drain()                             # also while no request runs
        eng.idle()
    stats = tier_stats(eng)
    assert stats["disk_blocks"] == 0 and stats["disk_vanished_files"] > 0 and not events.held, stats
    check_all_tiers(eng)


_FULL_DISK = textwrap.dedent("""
    import json, logging, resource, signal, sys
    sys.path[:0] = [{root!r}]
    logging.basicConfig(level=logging.WARNING)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)           # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (512, 512))   # every block file is larger
    from tests.gpu_worker.kv_tiers.conftest import chat, check_all_tiers, tier_stats, tiered_engine
    eng = tiered_engine({model!r}, kv_offload_cpu_gb=6e-6, kv_offload_dir={directory!r}, kv_offload_disk_gb=0.001)
    turns = chat(eng, 3)
    check_all_tiers(eng)
    print(json.dumps({{"turns": turns, "stats": tier_stats(eng)}}))
""")


def test_a_disk_that_refuses_writes_turns_disk_writes_off_with_one_warning(llama, tmp_path):
    """A real failing write (the process's file-size limit: EFBIG, persistent as ENOSPC is): the
    host tier keeps working, the requests all succeed with transformers' tokens."""
    model_dir, hf = llama
    here = os.path.dirname(__file__)
    script = _FULL_DISK.format(root=os.path.abspath(os.path.join(here, "../../..")),
                               model=model_dir, directory=str(tmp_path / "kv"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for prompt, answer, _ in result["turns"]:
        assert answer == hf.greedy(prompt, len(answer))[0]
    stats = result["stats"]
    assert not stats["disk_enabled"] and stats["loaded_blocks"]["cpu"] > 0, stats
    assert proc.stderr.count("turned off") == 1, proc.stderr[-3000:]


def test_a_load_racing_with_the_eviction_of_its_sources(llama, tmp_path):
    """Three host slots hold the history; admitting the next turn evicts three device blocks whose
    flush takes exactly those slots while the history is being loaded from them."""
    model_dir, hf = llama
    eng = tiered_engine(model_dir, kv_offload_cpu_gb=6e-6)
    assert eng.kv_tiers.host.num_slots == 3
    following: list[list[int]] = []

    def remember(eng, turn, next_prompt):
        following.append(next_prompt)

    chat(eng, 1, between=remember)
    history = following[0]
    in_host = [h for h in prompt_hashes(eng, history) if h in eng.kv_tiers.host]
    assert len(in_host) == 3
    answer, cached = run(eng, "next", history)
    assert answer == hf.greedy(history, len(answer))[0]
    assert cached == 12                                              # all three loaded...
    assert not any(h in eng.kv_tiers.host for h in in_host)          # ...while their slots were taken
    check_all_tiers(eng)
