"""The tier fields of EngineConfig are bounded and name themselves when wrong, sizes too small
for one block or too large for the machine included; the policy's choice
follows its cost model; the file format rejects what is not exactly the block asked for."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.config import EngineConfig
from gpu_worker.kv_tiers import tier_file, tier_sizes
from gpu_worker.kv_tiers.block_mover import BlockMover
from gpu_worker.kv_tiers.load_policy import LoadPolicy
from gpu_worker.kv_transfer.layout import KVLayout
from tests.gpu_worker.kv_tiers.conftest import tiered_engine


DISK = dict(kv_offload_disk_gb=1.0)
SHARED = dict(kv_offload_shared_dir="/tmp/kv", kv_offload_shared_gb=1.0, kv_offload_shared_key=b"k" * 32)


@pytest.mark.parametrize("kwargs, names", [
    (dict(kv_offload_cpu_gb=-1.0), "kv_offload_cpu_gb"),
    (dict(kv_offload_cpu_gb=1e9), "kv_offload_cpu_gb"),
    (dict(kv_offload_dir="/tmp/x"), "kv_offload_dir"),                 # without a size
    (dict(kv_offload_disk_gb=1.0), "kv_offload_dir"),                  # without a directory
    (dict(kv_offload_dir="", kv_offload_disk_gb=1.0), "kv_offload_dir"),
    (dict(kv_load_policy="sometimes"), "kv_load_policy"),
    (dict(kv_offload_cpu_gb=1.0, enable_prefix_caching=False), "enable_prefix_caching"),
    # the shared tier's bound scans its subdirectories: it would delete the private tier's files
    (dict(DISK, kv_offload_dir="/tmp/kv", **SHARED), "kv_offload_shared_dir: .* and kv_offload_dir .* overlap"),
    (dict(DISK, kv_offload_dir="/tmp/kv/worker-0", **SHARED), "kv_offload_shared_dir: .* and kv_offload_dir .* overlap"),
    (dict(DISK, kv_offload_dir="/tmp/kv/../kv/./worker-0", **SHARED), "kv_offload_shared_dir: .* and kv_offload_dir .* overlap"),
    (dict(DISK, kv_offload_dir="/tmp", **SHARED), "kv_offload_shared_dir: .* and kv_offload_dir .* overlap"),
])
def test_bad_tier_fields_are_named(kwargs, names):
    with pytest.raises(ValueError, match=names):
        EngineConfig(model="m", **kwargs)


@pytest.mark.parametrize("tier", [dict(kv_offload_cpu_gb=1.0), dict(kv_offload_dir="/tmp/x", kv_offload_disk_gb=1.0)])
def test_tiers_run_with_tensor_parallel(tier):
    """Every rank repeats rank 0's tier copies (tests/gpu_worker/parallel/test_tp_tiers.py)."""
    cfg = EngineConfig(model="m", tensor_parallel_size=2, **tier)
    assert cfg.kv_offload_enabled and cfg.tensor_parallel_size == 2


def test_disk_and_shared_tiers_in_sibling_directories_are_accepted():
    cfg = EngineConfig(model="m", kv_offload_dir="/tmp/kv-private/worker-0", **dict(DISK, **SHARED))
    assert cfg.kv_offload_dir and cfg.kv_offload_shared_dir


def test_tiers_are_off_by_default():
    assert not EngineConfig(model="m").kv_offload_enabled


def test_auto_takes_the_cheapest_split():
    policy = LoadPolicy("auto", block_bytes=1000, block_size=10)
    policy.bandwidth.update(cpu=1e6, disk=1e3)              # 1 ms and 1 s a block
    policy.prefill_rate = 1e3                               # 10 ms a block's tokens
    plan = policy.choose(["cpu", "cpu", "disk", "disk"], num_uncached_tokens=50)
    assert plan.num_blocks == 2 and plan.load_s == pytest.approx(2e-3) and plan.recompute_s == pytest.approx(0.03)
    policy.prefill_rate = 1e7                               # computing beats even the host tier
    assert policy.choose(["cpu", "cpu"], 50).num_blocks == 0
    assert LoadPolicy("always", 1000, 10).choose(["disk"], 50).num_blocks == 1
    assert LoadPolicy("never", 1000, 10).choose(["cpu"], 50).num_blocks == 0


LAYOUT = KVLayout("m", 16, "float32", 2, 2, 8, 1)
HASH = bytes(range(16))


def _file(payload: bytes = b"x" * 64) -> bytes:
    return b"".join(bytes(p) for p in tier_file.encode(HASH, LAYOUT, payload, None, range(16)))


def test_a_valid_file_round_trips():
    assert bytes(tier_file.decode(_file(), HASH, LAYOUT, 64)) == b"x" * 64


@pytest.mark.parametrize("data, block_hash, layout, why", [
    (_file()[:3], HASH, LAYOUT, "truncated"),
    (_file()[:-1], HASH, LAYOUT, "payload of"),
    (_file()[:-1] + b"y", HASH, LAYOUT, "checksum"),
    (_file(), bytes(16), LAYOUT, "another block"),
    (_file(), HASH, KVLayout("m", 16, "bfloat16", 2, 2, 8, 1), "foreign KV layout"),
    (b"".join(bytes(p) for p in tier_file.encode(HASH, LAYOUT, b"x" * 64, None, range(3))), HASH, LAYOUT,
     "token ids"),
    ((1 << 31).to_bytes(4, "little") + _file()[4:], HASH, LAYOUT, "header length"),
    (b"\x02\x00\x00\x00\x91\x01" + b"x" * 64, HASH, LAYOUT, "unreadable header"),
])
def test_a_bad_file_is_refused(data, block_hash, layout, why):
    with pytest.raises(tier_file.TierFileError, match=why):
        tier_file.decode(data, block_hash, layout, 64)


@pytest.mark.parametrize("tier, name", [
    (dict(kv_offload_cpu_gb=1e-9), "kv_offload_cpu_gb"),
    (dict(kv_offload_disk_gb=1e-9), "kv_offload_disk_gb"),
    (dict(kv_offload_shared_gb=1e-9), "kv_offload_shared_gb"),
])
def test_a_tier_too_small_for_one_block_is_refused_by_name(llama, tmp_path, tier, name):
    """A size below one block used to leave the tier silently absent (no directory, no warning)."""
    if "kv_offload_disk_gb" in tier:
        tier = dict(tier, kv_offload_dir=str(tmp_path / "kv"))
    if "kv_offload_shared_gb" in tier:
        tier = dict(tier, kv_offload_shared_dir=str(tmp_path / "shared"), kv_offload_shared_key=b"k" * 32)
    with pytest.raises(ValueError, match=f"{name}: .*holds no KV block.*give at least"):
        tiered_engine(llama[0], **tier)
    assert not (tmp_path / "kv").exists() and not (tmp_path / "shared").exists()


def test_a_host_tier_beyond_the_machine_is_refused_by_name(llama, monkeypatch):
    """More than the machine's memory, or what the allocator refuses: a ValueError naming the
    field (the worker exits 2 with it), not the allocator's RuntimeError from deep inside."""
    monkeypatch.setattr(tier_sizes, "physical_memory_bytes", lambda: 1 << 30)
    with pytest.raises(ValueError, match="kv_offload_cpu_gb: 2 GiB is more than this machine's memory"):
        tiered_engine(llama[0], kv_offload_cpu_gb=2.0)
    monkeypatch.setattr(tier_sizes, "physical_memory_bytes", lambda: None)
    mover = BlockMover([(torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8))])
    with pytest.raises(ValueError, match="kv_offload_cpu_gb: cannot allocate"):
        mover.host_blocks(1 << 50)                    # 2^50 blocks of 512 bytes: past any address space


def test_a_file_tier_bound_beyond_its_filesystem_is_refused_by_name(llama, tmp_path, monkeypatch, caplog):
    """Past the filesystem's size: refused naming the field; past its free space: one warning (the
    disk fills before the bound, and its writes fail and are retried after back-offs)."""
    size, free = tier_sizes.filesystem_bytes(str(tmp_path / "not" / "made" / "yet"))    # its nearest parent's
    assert size >= free > 0
    monkeypatch.setattr(tier_sizes, "filesystem_bytes", lambda d: (1 << 30, 1 << 29))   # 1 GiB, half free
    with pytest.raises(ValueError, match="kv_offload_disk_gb: 2 GiB is more than the whole filesystem"):
        tiered_engine(llama[0], kv_offload_dir=str(tmp_path / "kv"), kv_offload_disk_gb=2.0)
    with pytest.raises(ValueError, match="kv_offload_shared_gb: 2 GiB is more than the whole filesystem"):
        tiered_engine(llama[0], kv_offload_shared_dir=str(tmp_path / "sh"), kv_offload_shared_gb=2.0,
                      kv_offload_shared_key=b"k" * 32)
    with caplog.at_level("WARNING", logger="kvmesh.kv_tiers"):
        eng = tiered_engine(llama[0], kv_offload_dir=str(tmp_path / "kv"), kv_offload_disk_gb=0.75)
    assert eng.kv_tiers.disk is not None
    assert [r.getMessage() for r in caplog.records if "GiB free" in r.getMessage()] == [
        f"kv_offload_disk_gb=0.75 GiB is more than the 0.5 GiB free under {str(tmp_path / 'kv')!r}: the tier "
        "will fill the disk before its bound (once it is full, writes fail and their blocks are recomputed)"]
