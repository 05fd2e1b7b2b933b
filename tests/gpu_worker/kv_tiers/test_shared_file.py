"""The shared tier's MAC: a file a process without the deployment's key makes (a valid checksum and
header, no tag, another key's tag, a cut tag, a good file under another block's name) is a deleted
miss; engines of another key use a subdirectory of their own, so they neither read nor delete ours."""
from __future__ import annotations

import os

import pytest

from gpu_worker.kv_tiers import shared_file, tier_file
from gpu_worker.kv_tiers.disk_tier import DiskBlock
from gpu_worker.kv_tiers.shared_tier import SharedTier
from gpu_worker.kv_transfer.layout import KVLayout

LAYOUT = KVLayout("m", 4, "float32", 1, 1, 8, 1)
PAYLOAD = 4096
KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


def block(i: int) -> tuple[bytes, bytearray, tuple[int, ...]]:
    return i.to_bytes(16, "little"), bytearray([i % 251]) * PAYLOAD, (i,) * 4


def plant(tier: SharedTier, name_of: bytes, parts: list) -> None:
    """What any process that can write the directory can do: a file under a block's name."""
    with open(tier._path(name_of), "wb") as f:
        f.write(b"".join(bytes(p) for p in parts))


def test_files_without_the_deployments_mac_are_deleted_misses(tmp_path):
    tier = SharedTier(str(tmp_path / "shared"), 1 << 20, LAYOUT, PAYLOAD, KEY)
    try:
        unsigned, other_key, cut_tag, renamed, good = (block(i) for i in range(5))
        plant(tier, unsigned[0], tier_file.encode(unsigned[0], LAYOUT, unsigned[1], None, unsigned[2]))
        plant(tier, other_key[0], shared_file.encode(OTHER_KEY, other_key[0], LAYOUT, other_key[1], None,
                                                     other_key[2]))
        plant(tier, cut_tag[0], shared_file.encode(KEY, cut_tag[0], LAYOUT, cut_tag[1], None, cut_tag[2])[:-1])
        # a good file of block `good` under `renamed`'s name: the MAC holds, the header names another block
        plant(tier, renamed[0], shared_file.encode(KEY, good[0], LAYOUT, good[1], None, good[2]))
        tier.write(good[0], DiskBlock(None, good[2]), bytearray(good[1]))
        tier.drain()
        for h in (unsigned[0], other_key[0], cut_tag[0], renamed[0]):
            assert tier.holds(h) and tier.read(h) is None and not tier.holds(h)
        assert tier.num_corrupt == 4
        assert bytes(tier.read(good[0])) == bytes(good[1])
        with open(tier._path(good[0]), "rb") as f:          # what the writer wrote verifies, and only with KEY
            data = f.read()
        assert bytes(shared_file.decode(KEY, data, good[0], LAYOUT, PAYLOAD)) == bytes(good[1])
        assert len(data) <= tier.file_bytes
        tier.check_integrity()
    finally:
        tier.close()


def test_engines_of_another_key_keep_to_their_own_subdirectory(tmp_path):
    root = str(tmp_path / "shared")
    ours = SharedTier(root, 1 << 20, LAYOUT, PAYLOAD, KEY)
    theirs = SharedTier(root, 1 << 20, LAYOUT, PAYLOAD, OTHER_KEY)
    try:
        h, payload, token_ids = block(1)
        ours.write(h, DiskBlock(None, token_ids), bytearray(payload))
        ours.drain()
        assert ours.directory != theirs.directory and len(os.listdir(root)) == 2
        assert not theirs.holds(h) and theirs.read(h) is None and theirs.num_corrupt == 0
        assert bytes(ours.read(h)) == bytes(payload)
        assert ours.directory.endswith(shared_file.key_id(KEY)) and KEY.hex() not in ours.directory
        theirs.check_integrity()                           # the bound counts every subdirectory
        assert theirs.estimate.files == 1
    finally:
        ours.close()
        theirs.close()


def test_a_short_key_is_refused(tmp_path):
    with pytest.raises(ValueError, match="32 to 64 bytes"):
        SharedTier(str(tmp_path / "shared"), 1 << 20, LAYOUT, PAYLOAD, b"sixteen bytes!!!")
