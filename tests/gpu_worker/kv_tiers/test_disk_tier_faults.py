"""The disk tier's faults on its own, in proportion: a failed write costs its block only,
persistent failure turns writes off for a back-off (reads go on) and then writes are tried
again, and files deleted outside kvmesh leave the index at their read or at the periodic check."""
from __future__ import annotations

import errno
import logging
import os

import pytest

from gpu_worker.kv_tiers import disk_reconcile, disk_tier, write_backoff
from gpu_worker.kv_tiers.disk_tier import DiskBlock, DiskTier
from tests.gpu_worker.kv_tiers.test_disk_tier import LAYOUT, PAYLOAD, block


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def tier(tmp_path):
    disk = DiskTier(str(tmp_path / "kv"), max_blocks=16, layout=LAYOUT, payload_len=PAYLOAD, clock=Clock())
    yield disk
    disk.close()


def write(disk: DiskTier, i: int) -> bytes:
    h, payload = block(i)
    disk.write(h, DiskBlock(None, (i,) * 4), payload)
    return h


def settle(disk: DiskTier) -> list[bytes]:
    disk.drain()
    disk.poll()
    return disk.take_dropped()


def block_a_write(disk: DiskTier, i: int) -> None:
    """The block's .tmp name is taken by a directory: its file cannot be created (EISDIR)."""
    os.mkdir(disk._path(block(i)[0]) + ".tmp")


def unblock(disk: DiskTier, i: int) -> None:
    os.rmdir(disk._path(block(i)[0]) + ".tmp")


def test_a_failed_write_drops_its_block_only(tier):
    ok = write(tier, 0)
    block_a_write(tier, 1)
    bad = write(tier, 1)
    later = write(tier, 2)
    assert settle(tier) == [bad]                           # reported once, for the caller's event
    assert bad not in tier and len(tier) == 2 and tier.writes_on
    assert tier.read(bad) is None
    assert bytes(tier.read(ok)) == bytes(block(0)[1]) and bytes(tier.read(later)) == bytes(block(2)[1])
    assert tier.backoff.num_errors == 1
    assert write(tier, 3) in tier and settle(tier) == []   # writes go on
    unblock(tier, 1)
    tier.check_integrity()                                 # no file of the dropped block, nor a .tmp


def test_a_block_written_again_after_its_failed_write_is_not_reported_gone(tier):
    block_a_write(tier, 0)
    h = write(tier, 0)
    tier.drain()                                           # failed and dropped, not yet taken...
    unblock(tier, 0)
    write(tier, 0)                                         # ...when its block is written again
    assert settle(tier) == [] and h in tier
    assert bytes(tier.read(h)) == bytes(block(0)[1])
    tier.check_integrity()


def test_persistent_failures_turn_writes_off_then_back_on(tier, caplog):
    clock = tier.clock
    kept = write(tier, 0)
    for i in (1, 2, 3):
        block_a_write(tier, i)
    with caplog.at_level(logging.INFO, logger="kvmesh.kv_tiers"):
        for i in (1, 2, 3):
            write(tier, i)
        assert len(settle(tier)) == 3
        assert not tier.writes_on                          # MAX_CONSECUTIVE failures in a row
        assert bytes(tier.read(kept)) == bytes(block(0)[1])        # reads go on
        clock.now += write_backoff.FIRST_BACKOFF_S - 1
        assert not tier.writes_on
        clock.now += 2
        assert tier.writes_on                              # the back-off passed: try again
        assert write(tier, 4) in tier and settle(tier) == []
    assert tier.backoff.backoff_s == write_backoff.FIRST_BACKOFF_S     # a success resets it
    messages = [r.getMessage() for r in caplog.records]
    assert sum("writes turned off" in m for m in messages) == 1
    assert sum("writing a block failed" in m for m in messages) == 1   # rate-limited
    assert sum("trying writes again" in m for m in messages) == 1
    for i in (1, 2, 3):
        unblock(tier, i)
    tier.check_integrity()


def test_a_full_disk_turns_writes_off_at_once_and_backs_off_longer(tier, monkeypatch):
    clock = tier.clock
    real = disk_tier.write_file

    def full(path, tmp, parts, exclusive):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(disk_tier, "write_file", full)
    write(tier, 0)
    settle(tier)
    assert not tier.writes_on and len(tier) == 0
    clock.now += write_backoff.FIRST_BACKOFF_S
    assert tier.writes_on
    write(tier, 1)                                          # still full: off for twice as long
    settle(tier)
    clock.now += write_backoff.FIRST_BACKOFF_S + 1
    assert not tier.writes_on
    clock.now += write_backoff.FIRST_BACKOFF_S
    monkeypatch.setattr(disk_tier, "write_file", real)      # space again
    assert tier.writes_on and write(tier, 2) in tier and settle(tier) == []
    assert bytes(tier.read(block(2)[0])) == bytes(block(2)[1])
    tier.check_integrity()


def test_a_file_deleted_by_hand_is_forgotten_at_its_read(tier):
    h = write(tier, 0)
    settle(tier)
    os.unlink(tier._path(h))
    assert tier.read(h) is None and h not in tier
    assert tier.num_vanished == 1 and tier.num_corrupt == 0       # gone is not damage
    tier.check_integrity()


def test_the_periodic_check_drops_files_deleted_by_hand(tier, monkeypatch):
    monkeypatch.setattr(disk_reconcile, "BATCH", 3)         # several batches, one in flight at a time
    clock = tier.clock
    hashes = [write(tier, i) for i in range(10)]
    settle(tier)
    gone = hashes[1:8:3]
    for h in gone:
        os.unlink(tier._path(h))
    assert settle(tier) == [] and len(tier) == 10           # not yet: a pass every EVERY_S
    clock.now += disk_reconcile.EVERY_S
    fresh = write(tier, 10)
    dropped = []
    for _ in range(10):
        dropped += settle(tier)
    assert sorted(dropped) == sorted(gone) and len(tier) == 8 and fresh in tier
    assert tier.num_vanished == 3
    tier.check_integrity()


def test_a_block_written_again_during_its_check_is_kept(tier, monkeypatch):
    """Evicted and written again between its stat and the check's settling: the new entry stays."""
    clock = tier.clock
    h = write(tier, 0)
    settle(tier)
    os.unlink(tier._path(h))
    clock.now += disk_reconcile.EVERY_S
    tier.poll()                                             # the batch starts: its stat finds no file
    tier.forget(h)
    write(tier, 0)
    assert settle(tier) == [] and h in tier
    assert bytes(tier.read(h)) == bytes(block(0)[1])
    tier.check_integrity()
