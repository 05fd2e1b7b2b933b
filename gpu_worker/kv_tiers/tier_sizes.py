"""The tier sizes an engine's config asks for, checked against what one KV block takes and what
the machine has, before anything is allocated: a tier too small for one block would otherwise be
silently absent (the user asked for it and gets none), a host tier larger than the machine's
memory would fail deep in the allocator instead of naming its flag, and a disk bound larger than
its filesystem would only show when the disk fills and the tier turns off. A file tier's directory
on a filesystem that stores nothing (/proc, /sys) or takes no writes is refused as that, before its
bound is compared with a size of 0."""
from __future__ import annotations

import logging
import os

from gpu_worker.kv_tiers import shared_file, tier_file

GIB = 1 << 30
log = logging.getLogger("kvmesh.kv_tiers")


def _bad(name: str, why: str) -> ValueError:
    return ValueError(f"invalid engine argument {name}: {why}")


def physical_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _nearest_existing(directory: str) -> str:
    """`directory`, or its nearest existing parent (the directory is created later)."""
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def filesystem_bytes(directory: str) -> tuple[int, int] | None:
    """(size, free bytes) of the filesystem that holds `directory`, or of its nearest existing
    parent (the directory is created later); None where that cannot be read."""
    try:
        st = os.statvfs(_nearest_existing(directory))
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def directory_problem(directory: str) -> str | None:
    """Why no file tier can keep its files under `directory`, or None: the filesystem holding it
    (or its nearest existing parent) stores nothing (a pseudo-filesystem such as /proc or /sys
    reports 0 blocks) or is mounted read-only, or that parent takes no new directory. The checks
    of an existing directory (ours, not a link) are disk_tier.owned_directory's."""
    path = _nearest_existing(directory)
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    if st.f_blocks == 0:
        return (f"{directory!r} is on a pseudo-filesystem with no storage (such as /proc or /sys: it reports "
                "0 blocks); give a directory on a disk")
    if st.f_flag & os.ST_RDONLY:
        return f"{directory!r} is on a read-only filesystem; give a writable directory"
    if path != os.path.abspath(directory) and not os.access(path, os.W_OK | os.X_OK):
        return f"{directory!r} cannot be created: {path!r} is not writable by this user; give a writable directory"
    return None


def _check_file_tier(dir_name: str, name: str, gib: float, directory: str) -> None:
    """A file tier's directory that can hold no files is refused naming `dir_name`; its bound
    larger than its filesystem is refused naming `name`; larger than the free space, a warning:
    once the disk fills, the disk tier's writes go off for back-offs (write_backoff.py; the shared
    tier's writes fail one by one), rather than the bound's LRU keeping it within the disk."""
    if (why := directory_problem(directory)) is not None:
        raise _bad(dir_name, why)
    fs = filesystem_bytes(directory)
    if fs is None:
        return
    size, free = fs
    if gib * GIB > size:
        raise _bad(name, f"{gib:g} GiB is more than the whole filesystem of {directory!r} ({size / GIB:.1f} GiB); "
                         "give a bound that fits the disk")
    if gib * GIB > free:
        log.warning("%s=%g GiB is more than the %.1f GiB free under %r: the tier will fill the disk before its "
                    "bound (once it is full, writes fail and their blocks are recomputed)", name, gib, free / GIB, directory)


def check_tier_sizes(cfg, block_bytes: int) -> None:
    """Raise a ValueError naming the field when a configured tier cannot hold one block of this
    engine (sizes are the whole worker's, shared by its tensor-parallel ranks), a file tier's
    directory can hold no files or its bound exceeds its filesystem, or the host tier exceeds the machine's memory; warn when a file
    tier's bound exceeds the free space."""
    tp = cfg.tensor_parallel_size
    file_bytes = block_bytes + tier_file.file_overhead(cfg.block_size)
    wanted = [("kv_offload_cpu_gb", cfg.kv_offload_cpu_gb, block_bytes, "host"),
              ("kv_offload_disk_gb", cfg.kv_offload_disk_gb if cfg.kv_offload_dir else 0.0, file_bytes, "disk"),
              ("kv_offload_shared_gb", cfg.kv_offload_shared_gb if cfg.kv_offload_shared_dir else 0.0,
               file_bytes + shared_file.MAC_BYTES, "shared")]
    for name, gib, need, tier in wanted:
        if 0 < gib and int(gib * GIB) // tp < need:
            raise _bad(name, f"{gib:g} GiB holds no KV block of this model (a {tier}-tier block takes {need} "
                             f"bytes{' per rank' if tp > 1 else ''}): give at least {need * tp / GIB:.6g} GiB, "
                             f"or 0 for no {tier} tier")
    if cfg.kv_offload_dir:
        _check_file_tier("kv_offload_dir", "kv_offload_disk_gb", cfg.kv_offload_disk_gb, cfg.kv_offload_dir)
    if cfg.kv_offload_shared_dir:
        _check_file_tier("kv_offload_shared_dir", "kv_offload_shared_gb", cfg.kv_offload_shared_gb,
                         cfg.kv_offload_shared_dir)
    memory = physical_memory_bytes()
    if memory is not None and cfg.kv_offload_cpu_gb * GIB > memory:
        raise _bad("kv_offload_cpu_gb", f"{cfg.kv_offload_cpu_gb:g} GiB is more than this machine's memory "
                                        f"({memory / GIB:.1f} GiB); give a host tier that fits beside the worker")
