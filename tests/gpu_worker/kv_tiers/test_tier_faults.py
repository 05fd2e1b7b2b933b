"""Faults of the lower tiers never fail a request nor feed wrong KV: corrupt, truncated, foreign
and other-layout files are dropped and recomputed; a disk that refuses writes turns the disk
tier off with one warning; a directory removed mid-run does the same; a load racing with the
eviction of its own source blocks still reads them. Every test ends with zero leaked blocks."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import msgspec
import pytest

from tests.gpu_worker.kv_tiers.conftest import check_all_tiers, chat, prompt_hashes, run, tier_stats, tiered_engine
from gpu_worker.kv_tiers import tier_file

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


def test_directory_removed_mid_run_turns_the_disk_tier_off(llama, tmp_path, caplog):
    model_dir, hf = llama
    directory = tmp_path / "kv"
    eng = tiered_engine(model_dir, kv_offload_dir=str(directory), **DISK)

    def remove(eng, turn, next_prompt):
        if turn == 0:
            eng.kv_tiers.disk.drain()        # no file half-made while the directory goes
            shutil.rmtree(directory)

    with caplog.at_level("WARNING", logger="kvmesh.kv_tiers"):
        turns = chat(eng, 3, between=remove)
    for prompt, answer, _ in turns:
        assert answer == hf.greedy(prompt, len(answer))[0]
    stats = tier_stats(eng)
    assert not stats["disk_enabled"] and stats["disk_blocks"] == 0
    assert sum("turned off" in r.getMessage() for r in caplog.records) == 1
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


def test_a_disk_that_refuses_writes_leaves_no_disk_tier_and_one_warning(llama, tmp_path):
    """A real failing write (the process's file-size limit: EFBIG, as ENOSPC would be): the host
    tier keeps working, the requests all succeed with transformers' tokens."""
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
