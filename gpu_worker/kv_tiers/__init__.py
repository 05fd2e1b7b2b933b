"""KV tiers below the device: host memory, then local disk; offload on eviction, reload on a hit.

    manager.py      KVTiers: eviction -> host -> disk, plan/load on admission, events, stats
    scheduling.py   TieredScheduler: the scheduler's hook points wired to KVTiers
    block_mover.py  device <-> host block copies (CUDA: streams of their own, loads in layer groups)
    layer_loads.py  loads a step's forward lands layer by layer, each before its layer runs
    host_tier.py    the host slot pool and its LRU
    disk_tier.py    one checked file per block in a private directory
    tier_file.py    the file format (header, checksum) and its checks
    load_policy.py  load or recompute, per request
    tier_stats.py   counters and histograms
"""
from __future__ import annotations

from gpu_worker.kv_tiers.manager import GIB, KVTiers
from gpu_worker.kv_tiers.scheduling import TieredScheduler


def build_kv_tiers(engine) -> KVTiers:
    """The lower tiers an engine's config asks for (gpu_worker.engine.Engine, after its runner's
    KV cache and block manager exist)."""
    from gpu_worker.kv_transfer.layout import layout_of
    cfg = engine.config
    return KVTiers(engine.block_manager, engine.runner.kv_caches, layout_of(engine),
                   cpu_bytes=int(cfg.kv_offload_cpu_gb * GIB), disk_dir=cfg.kv_offload_dir,
                   disk_bytes=int(cfg.kv_offload_disk_gb * GIB), policy=cfg.kv_load_policy)


__all__ = ["KVTiers", "TieredScheduler", "build_kv_tiers"]
