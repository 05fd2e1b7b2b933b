"""The shared tier: one directory that several engines use at once. A conversation one engine
drained there is loaded by another with transformers' tokens; a file that is torn, flipped, of
another layout or forged (a valid checksum, not the deployment's MAC) is a miss, deleted and
recomputed; two writers keep the directory's bound."""
from __future__ import annotations

import os
import stat
import time

import msgspec
import pytest
import torch

from gpu_worker.kv_tiers import shared_file, shared_store_id, tier_file
from gpu_worker.kv_tiers.disk_tier import DiskBlock
from gpu_worker.kv_tiers.drain_to_disk import drain_to_disk
from gpu_worker.kv_tiers.shared_tier import SharedTier
from gpu_worker.kv_transfer.layout import KVLayout
from tests.gpu_worker.kv_tiers.conftest import (
    BLOCK_SIZE, chat, check_all_tiers, prompt_hashes, push_out, run, tier_stats, tiered_engine, tokens)

LAYOUT = KVLayout("m", 4, "float32", 1, 1, 8, 1)
PAYLOAD = 4096
SHARED_GB = 0.001
KEY = bytes(range(32))                  # the deployment's key (a worker derives it from its trust dir)
OTHER_KEY = bytes(range(1, 33))


def block(i: int) -> tuple[bytes, bytearray]:
    return i.to_bytes(16, "little"), bytearray([i % 251]) * PAYLOAD


def write(tier: SharedTier, i: int) -> bytes:
    h, payload = block(i)
    tier.write(h, DiskBlock(None, (i,) * 4), payload)
    return h


def total_bytes(root) -> int:
    """The block files' bytes (what the bound counts; not the store's 48-byte id file)."""
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(root) for n in names
               if n != shared_store_id.NAME)


def test_a_drained_conversation_is_loaded_by_another_engine(llama, tmp_path):
    model_dir, hf = llama
    shared = dict(kv_offload_shared_dir=str(tmp_path / "shared"), kv_offload_shared_gb=SHARED_GB,
                  kv_offload_shared_key=KEY)
    a = tiered_engine(model_dir, num_gpu_blocks=16, **shared)          # no host tier: evictions go to shared
    b = tiered_engine(model_dir, **shared)                             # no lock: both at once
    try:
        history = tokens(30, 1)
        answer, _ = run(a, "turn-0", history)
        push_out(a, 1)                                                 # its history leaves the device
        assert tier_stats(a)["offloaded_blocks"]["shared"] > 0
        history = history + answer + tokens(5, 2)
        answer, cached = run(a, "turn-1", history)                    # A loads its own evictions back
        assert answer == hf.greedy(history, len(answer))[0] and cached > 0
        assert tier_stats(a)["loaded_blocks"]["shared"] > 0
        result = drain_to_disk(a.kv_tiers, time.monotonic() + 30)    # A leaves: its hot blocks to shared
        assert result.written > 0 and result.left == 0, result
        a.kv_tiers.shared.drain()
        files = [n for _, _, names in os.walk(tmp_path / "shared") for n in names]
        assert files and all(n.endswith(".kvb") or n == shared_store_id.NAME for n in files)
        assert all(stat.S_IMODE(os.stat(d).st_mode) == 0o700 for d, _, _ in os.walk(tmp_path / "shared"))

        prompt = history + answer + tokens(5, 3)                       # the next turn lands on B
        reply, cached = run(b, "turn-2", prompt)
        assert reply == hf.greedy(prompt, len(reply))[0]
        assert cached >= (len(history + answer) // BLOCK_SIZE) * BLOCK_SIZE - BLOCK_SIZE
        assert tier_stats(b)["loaded_blocks"]["shared"] * BLOCK_SIZE == cached
        check_all_tiers(a)
        check_all_tiers(b)
    finally:
        a.close()
        b.close()


def _flip_last_payload_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-shared_file.MAC_BYTES - 1, os.SEEK_END)
        last = f.read(1)
        f.seek(-shared_file.MAC_BYTES - 1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


def _forge(tier: SharedTier, block_hash: bytes, key: bytes | None) -> None:
    """Replace a good file by one a process without the deployment's key can make: the same header
    (block hash, parent, token ids, layout), other KV with a valid xxh3, and no MAC or another key's."""
    with open(tier._path(block_hash), "rb") as f:
        data = f.read()
    header_len = tier_file.header_length(data, tier.layout)
    header = tier_file.decode_header(data[tier_file.LEN_BYTES:tier_file.LEN_BYTES + header_len], block_hash,
                                     tier.layout, tier.payload_len)
    payload = bytes(header.payload_len)                                # KV of the forger's choosing
    args = (block_hash, tier.layout, payload, header.parent, header.token_ids)
    parts = tier_file.encode(*args) if key is None else shared_file.encode(key, *args)
    with open(tier._path(block_hash), "wb") as f:
        f.write(b"".join(bytes(p) for p in parts))


@pytest.mark.parametrize("damage", ["flipped", "unsigned", "other key"])
def test_a_bad_shared_file_is_a_miss_and_the_block_is_recomputed(llama, tmp_path, damage):
    model_dir, hf = llama
    shared = dict(kv_offload_shared_dir=str(tmp_path / "shared"), kv_offload_shared_gb=SHARED_GB,
                  kv_offload_shared_key=KEY)
    a = tiered_engine(model_dir, **shared)
    b = tiered_engine(model_dir, **shared)
    try:
        history = tokens(30, 4)
        answer, _ = run(a, "turn-0", history)
        drain_to_disk(a.kv_tiers, time.monotonic() + 30)
        hashes = prompt_hashes(b, history)
        path = b.kv_tiers.shared._path(hashes[3])                      # block 3's file damaged or forged
        if damage == "flipped":
            _flip_last_payload_byte(path)
        else:
            _forge(b.kv_tiers.shared, hashes[3], None if damage == "unsigned" else OTHER_KEY)
        prompt = history + answer + tokens(5, 5)
        reply, cached = run(b, "turn-1", prompt)
        assert reply == hf.greedy(prompt, len(reply))[0]
        assert cached == 3 * BLOCK_SIZE                                # blocks 0..2 loaded, the rest computed
        assert tier_stats(b)["shared_corrupt_files"] == 1 and not os.path.exists(path)
        check_all_tiers(b)
    finally:
        a.close()
        b.close()


def test_torn_flipped_and_foreign_files_are_deleted_misses(tmp_path):
    tier = SharedTier(str(tmp_path / "shared"), 1 << 20, LAYOUT, PAYLOAD, KEY)
    try:
        torn, flipped, foreign, good = (write(tier, i) for i in range(4))
        tier.drain()
        with open(tier._path(torn), "r+b") as f:
            f.truncate(100)
        with open(tier._path(flipped), "r+b") as f:
            f.seek(-7, os.SEEK_END)
            f.write(b"\x00\x01")
        other = msgspec.structs.replace(LAYOUT, model_id="another")
        with open(tier._path(foreign), "wb") as f:      # signed with the key: the layout check drops it
            for part in shared_file.encode(KEY, foreign, other, block(2)[1], None, (2,) * 4):
                f.write(part)
        for h in (torn, flipped, foreign):
            assert tier.holds(h) and tier.read(h) is None and not tier.holds(h)
        assert tier.num_corrupt == 3
        assert bytes(tier.read(good)) == bytes(block(3)[1])
        assert tier.read(block(9)[0]) is None and tier.num_corrupt == 3    # never written: a plain miss
        tier.check_integrity()
    finally:
        tier.close()


def test_two_writers_keep_the_bound(tmp_path):
    file_bytes = len(b"".join(bytes(p) for p in shared_file.encode(KEY, b"\0" * 16, LAYOUT, block(0)[1], None,
                                                                   (0,) * 4)))
    bound = 10 * file_bytes
    root = str(tmp_path / "shared")
    a = SharedTier(root, bound, LAYOUT, PAYLOAD, KEY, max_queued=2)
    b = SharedTier(root, bound, LAYOUT, PAYLOAD, KEY, max_queued=2)
    try:
        newest = []
        for i in range(0, 60, 2):
            newest = [write(a, i), write(b, i + 1)]
            a.drain()
            b.drain()
            # each writer sees the other's files only at its scans; a bound of 10 files makes each
            # scan after every write of its own (1/16 of the bound, at least one)
            assert total_bytes(root) <= bound + a.file_bytes
        a.check_integrity()                                  # a scan: within the bound
        assert total_bytes(root) <= bound
        assert all(a.read(h) is not None for h in newest)    # the oldest went, the newest stayed
        b.check_integrity()
    finally:
        a.close()
        b.close()


def test_a_tensor_parallel_rank_bounds_its_own_subdirectory(tmp_path):
    """Rank r of a TP=2 layout writes to a subdirectory of its own and bounds only that one; a
    one-rank engine on the same root bounds everything, the ranks' files included."""
    root = str(tmp_path / "shared")
    tp2 = msgspec.structs.replace(LAYOUT, tp_size=2)
    file_bytes = len(b"".join(bytes(p) for p in shared_file.encode(KEY, b"\0" * 16, tp2, block(0)[1], None,
                                                                   (0,) * 4)))
    ranks = [SharedTier(root, 4 * file_bytes, tp2, PAYLOAD, KEY, rank=r) for r in (0, 1)]
    try:
        assert [os.path.basename(t.directory).rsplit("-", 1)[1] for t in ranks] == ["rank0", "rank1"]
        for i in range(3):
            write(ranks[1], i)
        ranks[1].drain()
        for i in range(3, 9):                       # rank 0's bound: 4 files, its own only
            write(ranks[0], i)
            ranks[0].drain()
        ranks[0].check_integrity()
        def block_files(tier):
            return [n for n in os.listdir(tier.directory) if n.endswith(".kvb")]
        assert len(block_files(ranks[1])) == 3 and len(block_files(ranks[0])) <= 4
        one = SharedTier(root, 2 * file_bytes, LAYOUT, PAYLOAD, KEY)   # scans every subdirectory
        try:
            one.check_integrity()
            assert total_bytes(root) <= 2 * file_bytes
        finally:
            one.close()
    finally:
        for t in ranks:
            t.close()


def test_shared_tier_settings_are_checked(tmp_path, llama):
    model_dir, _ = llama
    from gpu_worker.config import EngineConfig
    with pytest.raises(ValueError, match="kv_offload_shared_dir"):
        EngineConfig(model=model_dir, kv_offload_shared_dir=str(tmp_path))          # without a size
    with pytest.raises(ValueError, match="kv_offload_shared_dir"):
        EngineConfig(model=model_dir, kv_offload_shared_gb=1.0)
    with pytest.raises(ValueError, match="kv_offload_shared_dir: the shared tier needs kv_offload_shared_key"):
        EngineConfig(model=model_dir, kv_offload_shared_dir=str(tmp_path), kv_offload_shared_gb=1.0)
    with pytest.raises(ValueError, match="kv_offload_shared_key: must be 32 to 64 bytes"):
        EngineConfig(model=model_dir, kv_offload_shared_dir=str(tmp_path), kv_offload_shared_gb=1.0,
                     kv_offload_shared_key=b"short")
    assert "kv_offload_shared_key" not in repr(EngineConfig(model=model_dir, kv_offload_shared_dir=str(tmp_path),
                                                            kv_offload_shared_gb=1.0, kv_offload_shared_key=KEY))
    a_file = tmp_path / "not-a-directory"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="kv_offload_shared_dir: cannot use"):
        SharedTier(str(a_file), 1 << 20, LAYOUT, PAYLOAD, KEY)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_shared_tier_on_the_gpu(arch_model, tmp_path):
    """The CUDA path (pinned host slots spilling to the shared directory, pageable file reads
    pinned before their copy, a second engine on the same GPU loading them): transformers' tokens."""
    model_dir, hf = arch_model
    cuda = dict(device="cuda", dtype="float32", attention_backend="triton", cuda_graph_max_bs=16,
                kv_offload_cpu_gb=6e-6, kv_offload_shared_dir=str(tmp_path / "shared"), kv_offload_shared_gb=SHARED_GB,
                kv_offload_shared_key=KEY)
    a = tiered_engine(model_dir, **cuda)
    try:
        turns = chat(a, 3)
        for prompt, answer, _ in turns:
            assert answer == hf.greedy(prompt, len(answer))[0]
        assert tier_stats(a)["offloaded_blocks"]["shared"] > 0 and tier_stats(a)["loaded_blocks"]["shared"] > 0
        drain_to_disk(a.kv_tiers, time.monotonic() + 30)
        check_all_tiers(a)
    finally:
        a.close()
    prompt, answer, _ = turns[-1]
    prompt = prompt + answer + tokens(5, 9)
    b = tiered_engine(model_dir, **cuda)
    try:
        reply, cached = run(b, "next", prompt)
        assert reply == hf.greedy(prompt, len(reply))[0] and cached > 0
        assert tier_stats(b)["loaded_blocks"]["shared"] > 0
        check_all_tiers(b)
    finally:
        b.close()


def test_a_writer_keeps_another_writers_tmp_file_and_still_writes(tmp_path):
    """Workers in other pods (PID namespaces) share pids and each counts its tmp names from 0: a
    name collision must neither delete the other writer's half-written file nor fail the write."""
    tier = SharedTier(str(tmp_path / "shared"), 1 << 20, LAYOUT, PAYLOAD, KEY)
    try:
        h, payload = block(5)
        others = [f"{tier._path(h)}.{os.getpid()}-{n}.tmp" for n in range(4)]   # mid-write elsewhere
        for name in others:
            with open(name, "wb") as f:
                f.write(b"another writer's bytes")
        write(tier, 5)
        tier.drain()
        assert tier.num_write_errors == 0
        assert bytes(tier.read(h)) == bytes(payload)
        assert all(os.path.exists(name) for name in others)
    finally:
        tier.close()


def test_write_file_never_deletes_a_tmp_it_did_not_create(tmp_path):
    from gpu_worker.kv_tiers.disk_tier import write_file
    path, tmp = str(tmp_path / "f.kvb"), str(tmp_path / "f.kvb.x.tmp")
    with open(tmp, "wb") as f:
        f.write(b"theirs")
    with pytest.raises(FileExistsError):
        write_file(path, tmp, [b"mine"], exclusive=True)
    assert open(tmp, "rb").read() == b"theirs" and not os.path.exists(path)


def test_the_bound_holds_past_the_scan_cap(tmp_path, monkeypatch):
    """A bound of more files than one scan counts (a large node disk): scans still see enough of
    the directory to keep it."""
    from gpu_worker.kv_tiers import shared_tier
    monkeypatch.setattr(shared_tier, "SCAN_MAX_FILES", 4)
    file_bytes = len(b"".join(bytes(p) for p in shared_file.encode(KEY, b"\0" * 16, LAYOUT, block(0)[1], None,
                                                                   (0,) * 4)))
    bound = 10 * file_bytes                      # 10 files: more than a scan of 4 counts
    root = str(tmp_path / "shared")
    tier = SharedTier(root, bound, LAYOUT, PAYLOAD, KEY, max_queued=2)
    try:
        for i in range(40):
            write(tier, i)
            tier.drain()
        tier.check_integrity()
        assert total_bytes(root) <= bound
    finally:
        tier.close()


def test_a_scan_that_reaches_its_cap_deletes_the_oldest_it_saw(tmp_path, monkeypatch):
    """Many small files of another layout fill a scan's count before the bound's bytes: scans
    thin them until one sees the whole directory."""
    from gpu_worker.kv_tiers import shared_tier
    monkeypatch.setattr(shared_tier, "SCAN_MAX_FILES", 4)
    root = tmp_path / "shared"
    foreign = root / "0123456789abcdef-0123456789abcdef"
    foreign.mkdir(parents=True, mode=0o700)
    for i in range(100):
        (foreign / f"{i:032x}.kvb").write_bytes(b"x")
    tier = SharedTier(str(root), 10 * (PAYLOAD + 2000), LAYOUT, PAYLOAD, KEY)
    try:
        for _ in range(40):                  # each scan deletes 10% of its cap: 100 files take ~35
            tier.estimate = tier._writer.submit(tier._scan).result()
        assert sum(len(names) for _, _, names in os.walk(root)) < tier.scan_max_files
    finally:
        tier.close()


def test_a_fifo_under_a_blocks_name_is_a_dropped_file_not_a_hung_reader(tmp_path):
    """Another process of the user can plant a FIFO under a block's name: opening it for a read
    must not block the reader (the engine's thread, or a reader thread) until someone writes."""
    import threading
    tier = SharedTier(str(tmp_path / "shared"), 1 << 20, LAYOUT, PAYLOAD, KEY)
    h = block(7)[0]
    os.mkfifo(tier._path(h), 0o600)
    got = []
    reader = threading.Thread(target=lambda: got.append(tier.read(h)), daemon=True)
    reader.start()
    reader.join(5)
    hung = reader.is_alive()
    if hung:                                  # let it go: a writer's open releases the reader's
        os.close(os.open(tier._path(h), os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
    try:
        assert not hung and got == [None] and tier.num_corrupt == 1 and not tier.holds(h)
    finally:
        tier.close()
