"""The worker's shared KV tier key: derived from the trust directory's worker secret, the same for
every worker of one directory and another for another; refused, naming the flags, without trust
material (never a shared tier whose files anyone who can write the directory could plant)."""
from __future__ import annotations

import pytest

from gpu_worker.service.main import shared_tier_key
from services.config import WorkerConfig
from services.security import bundle
from services.security.bundle import TrustError
from services.security.curve import Plane

SHARED = dict(model="/m", kv_offload_shared_dir="/var/cache/kvmesh-shared/kv-shared", kv_offload_shared_gb=1.0)


def test_workers_of_one_trust_directory_derive_one_key(tmp_path):
    one = bundle.generate(tmp_path / "one", roles=("gateway", "worker")).root
    other = bundle.generate(tmp_path / "other", roles=("worker",)).root
    cfg = WorkerConfig(**SHARED)
    key = shared_tier_key(cfg, Plane.load(str(one), "worker"))
    assert key == shared_tier_key(cfg, Plane.load(str(one), "worker")) and len(key) == 32
    assert key != shared_tier_key(cfg, Plane.load(str(other), "worker"))
    worker = bundle.load(one, "worker")
    assert key not in (worker.curve_secret, worker.curve_public)
    with pytest.raises(TrustError, match="worker role's"):
        bundle.shared_kv_key(bundle.load(one, "gateway"))
    assert shared_tier_key(WorkerConfig(model="/m"), Plane.load(str(one), "worker")) is None


def test_no_shared_tier_without_trust_material():
    with pytest.raises(ValueError, match="--kv-offload-shared-dir is refused with --insecure-internal-planes"):
        shared_tier_key(WorkerConfig(**SHARED, insecure_internal_planes=True), Plane.insecure())
