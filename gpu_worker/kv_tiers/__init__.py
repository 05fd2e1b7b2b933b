"""KV tiers below the device: host memory, then local disk, and a directory the node's workers
share; offload on eviction, reload on a hit.

    manager.py      KVTiers: eviction -> host -> disk, plan/load on admission, events, stats
    scheduling.py   TieredScheduler: the scheduler's hook points wired to KVTiers
    block_mover.py  device <-> host block copies (CUDA: streams of their own, loads in layer groups)
    layer_loads.py  loads a step's forward lands layer by layer, each before its layer runs
    host_tier.py    the host slot pool and its LRU
    disk_tier.py    one checked file per block in a private directory
    shared_tier.py  the same files in a directory every worker on the node uses at once
    shared_file.py  its files: the tier-file format with a MAC keyed by the workers' trust material
    tier_file.py    the file format (header, checksum) and its checks
    load_policy.py  load or recompute, per request
    tier_stats.py   counters and histograms
    tier_sizes.py   the configured sizes checked against one block and the machine's memory
    mirror.py       what the other tensor-parallel ranks repeat (gpu_worker/parallel/tp_tiers.py)
"""
from __future__ import annotations

from gpu_worker.kv_tiers.block_mover import block_bytes_of
from gpu_worker.kv_tiers.manager import GIB, KVTiers
from gpu_worker.kv_tiers.scheduling import TieredScheduler
from gpu_worker.kv_tiers.tier_sizes import check_tier_sizes


def build_kv_tiers(engine) -> KVTiers:
    """The lower tiers an engine's config asks for (gpu_worker.engine.Engine, after its runner's
    KV cache and block manager exist). With tensor parallelism the sizes are the whole worker's,
    shared evenly by the ranks (each holds its shard of every block), and each rank's files go
    to a subdirectory of its own (gpu_worker/parallel/tp_tiers.py), the shared tier's too
    (shared_tier.py: each rank bounds its subdirectory to its share)."""
    from gpu_worker.kv_transfer.layout import layout_of
    cfg = engine.config
    check_tier_sizes(cfg, block_bytes_of(engine.runner.kv_caches))   # before any allocation
    tp, disk_dir, mirror = cfg.tensor_parallel_size, cfg.kv_offload_dir, None
    if tp > 1:
        from gpu_worker.parallel.tp_tiers import TPTierMirror, rank_dir
        mirror = TPTierMirror(engine.runner, disk_dir)
        disk_dir = rank_dir(disk_dir, 0) if disk_dir else None
    return KVTiers(engine.block_manager, engine.runner.kv_caches, layout_of(engine),
                   cpu_bytes=int(cfg.kv_offload_cpu_gb * GIB) // tp, disk_dir=disk_dir,
                   disk_bytes=int(cfg.kv_offload_disk_gb * GIB) // tp, policy=cfg.kv_load_policy, mirror=mirror,
                   shared_dir=cfg.kv_offload_shared_dir, shared_bytes=int(cfg.kv_offload_shared_gb * GIB) // tp,
                   shared_key=cfg.kv_offload_shared_key)


__all__ = ["KVTiers", "TieredScheduler", "build_kv_tiers"]
