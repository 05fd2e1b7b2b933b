"""The disk tier on its own: writes queued to its thread are readable at once, a bounded number
wait, deletes follow their writes, and everything lands as private, verified files."""
from __future__ import annotations

import os
import stat

from gpu_worker.kv_tiers.disk_tier import DiskBlock, DiskTier
from gpu_worker.kv_transfer.layout import KVLayout

LAYOUT = KVLayout("m", 4, "float32", 1, 1, 8, 1)
PAYLOAD = 4096


def block(i: int) -> tuple[bytes, bytearray]:
    return i.to_bytes(16, "little"), bytearray([i % 251]) * PAYLOAD


def test_queued_writes_read_back_and_land_on_disk(tmp_path):
    disk = DiskTier(str(tmp_path / "kv"), max_blocks=8, layout=LAYOUT, payload_len=PAYLOAD, max_queued=2)
    try:
        for i in range(6):
            h, payload = block(i)
            disk.write(h, DiskBlock(None, (i,) * 4), payload)
            assert len(disk._queued) <= 2                    # the writer's backlog stays bounded
            assert bytes(disk.read(h)) == bytes(payload)     # readable before it is on disk
        disk.forget(block(0)[0])                             # its delete runs after its write
        disk.drain()
        assert not disk._queued and disk.writes_on
        for i in range(1, 6):
            h, payload = block(i)
            assert bytes(disk.read(h)) == bytes(payload)     # now read from the file, verified
            assert stat.S_IMODE(os.stat(disk._path(h)).st_mode) == 0o600
        assert not os.path.exists(disk._path(block(0)[0]))
        written = disk.poll()
        assert len(written) >= 5 and all(n == PAYLOAD and s > 0 for n, s in written)
        disk.check_integrity()
    finally:
        disk.close()


def test_an_unusable_directory_is_a_clear_error(tmp_path):
    import pytest
    a_file = tmp_path / "not-a-directory"
    a_file.write_text("x")
    for bad in (a_file, a_file / "below"):
        with pytest.raises(ValueError, match="kv_offload_dir"):
            DiskTier(str(bad), max_blocks=1, layout=LAYOUT, payload_len=PAYLOAD)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(ValueError, match="is a symbolic link"):        # a symlink is not followed
        DiskTier(str(link), max_blocks=1, layout=LAYOUT, payload_len=PAYLOAD)


def test_a_tier_directory_given_as_a_symlink_is_refused_naming_its_target(tmp_path):
    """`--kv-offload-shared-dir /data/kv` where /data/kv is a link to a real directory: the error
    names the link and the directory to give instead, not 'is not a directory'."""
    import pytest

    from gpu_worker.kv_tiers.disk_tier import owned_directory
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ValueError, match=f"kv_offload_shared_dir: .* is a symbolic link; give the directory it "
                                         f"points to \\('{tmp_path / 'real'}'\\)"):
        owned_directory(str(tmp_path / "link"), "kv_offload_shared_dir")


def test_a_shared_temporary_directory_is_refused_not_made_private(tmp_path):
    """`--kv-offload-dir /tmp` or `--kv-offload-shared-dir /dev/shm` (sticky, world-writable):
    tightening it to 0700 would lock every other user out of it (as root nothing stops the chmod).
    It is refused naming the field and left as it was; a directory of its own inside is fine."""
    import pytest

    from gpu_worker.kv_tiers.disk_tier import owned_directory
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    for flag in ("kv_offload_dir", "kv_offload_shared_dir"):
        with pytest.raises(ValueError, match=f"{flag}: .* is a shared temporary directory .*a directory of its own"):
            owned_directory(str(sticky), flag)
        assert stat.S_IMODE(sticky.stat().st_mode) == 0o1777
    owned_directory(str(sticky / "kv"), "kv_offload_dir")
    assert stat.S_IMODE((sticky / "kv").stat().st_mode) == 0o700


def test_files_of_other_weights_or_format_versions_are_foreign_not_damaged(tmp_path, caplog):
    """A restart after a weights upgrade, or on files of an older format, deletes them in one line."""
    import logging

    import msgspec

    from gpu_worker.kv_tiers import disk_restore, tier_file
    mine = msgspec.structs.replace(LAYOUT, weights_digest="a" * 32)
    directory = tmp_path / "kv"
    directory.mkdir()
    for i in range(3):
        h, payload = block(i)
        (directory / f"{h.hex()}.kvb").write_bytes(b"".join(tier_file.encode(h, LAYOUT, payload, None, (i,) * 4)))
    h, payload = block(3)
    old = tier_file.TierFileHeader(tier_file.MAGIC, 2, h, mine, PAYLOAD, 0, None, [3] * 4)
    header = msgspec.msgpack.encode(old)
    (directory / f"{h.hex()}.kvb").write_bytes(tier_file._LEN.pack(len(header)) + header + bytes(payload))
    with caplog.at_level(logging.INFO, logger="kvmesh.kv_tiers"):
        found = disk_restore.scan(str(directory), mine, PAYLOAD)
    assert (found.blocks, found.dropped, found.foreign) == ([], 4, 4) and not os.listdir(directory)
    [line] = [r.getMessage() for r in caplog.records]
    assert "deleted 4 block files of another KV layout" in line and "weights_digest" in line, line


def test_a_fifo_or_symlink_named_like_a_block_is_dropped_at_start_without_blocking(tmp_path):
    """The start-up scan opened each `<hash>.kvb` without O_NONBLOCK: a FIFO planted under a
    block's name blocked the engine's start until someone wrote to it. It is dropped now, as is a
    symlink (never followed: its target is left alone), and the real blocks beside them restore."""
    import threading

    from gpu_worker.kv_tiers import disk_restore, tier_file
    directory = tmp_path / "kv"
    directory.mkdir(mode=0o700)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not a block")
    fifo, link = directory / f"{block(1)[0].hex()}.kvb", directory / f"{block(2)[0].hex()}.kvb"
    os.mkfifo(fifo, 0o600)
    link.symlink_to(target)
    h, payload = block(3)
    (directory / f"{h.hex()}.kvb").write_bytes(b"".join(tier_file.encode(h, LAYOUT, payload, None, (3,) * 4)))
    found: list = []
    scan = threading.Thread(target=lambda: found.append(disk_restore.scan(str(directory), LAYOUT, PAYLOAD)),
                            daemon=True)
    scan.start()
    scan.join(10)
    if scan.is_alive():                  # release the blocked open before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        scan.join(10)
        raise AssertionError("the scan blocked on a FIFO")
    [result] = found
    assert [b.block_hash for b in result.blocks] == [h] and result.dropped == 2
    assert sorted(os.listdir(directory)) == [f"{h.hex()}.kvb"] and target.read_bytes() == b"not a block"


def test_a_lock_file_that_is_a_symlink_is_a_clear_error_naming_the_argument(tmp_path):
    """`.lock` planted as a symlink (to /etc/passwd, say) is never followed; the engine's start
    then fails with an error naming kv_offload_dir (it was a bare ELOOP OSError, which the worker
    does not expect at start: a traceback instead of its "cannot start the engine" line)."""
    import pytest
    directory = tmp_path / "kv"
    directory.mkdir(mode=0o700)
    target = tmp_path / "passwd"
    target.write_text("root:x:0:0")
    (directory / ".lock").symlink_to(target)
    with pytest.raises(ValueError, match="kv_offload_dir: cannot lock .*lock"):
        DiskTier(str(directory), max_blocks=1, layout=LAYOUT, payload_len=PAYLOAD)
    assert target.read_text() == "root:x:0:0"
