"""Process groups for one worker's tensor/expert-parallel ranks, and the collectives used.

Rendezvous is a torch TCPStore that rank 0 opens on 127.0.0.1 (an OS-chosen port); the
children get host and port on their command line. Two groups: the default group carries the
model's collectives (NCCL on CUDA, gloo on CPU; its timeout bounds a hung collective), and a
gloo control group carries rank 0's commands and batch metadata, with no practical timeout, so
followers can wait through idle periods.

Only tensor collectives are used: no object collectives (they pickle).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Multicast/NVLS paths are off on the lent machines (see the device notes): set them before
# NCCL starts, in this process and, through os.environ, in every child it spawns.
NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DEFAULT_TIMEOUT_S = 600.0
# Followers wait for rank 0's next command on a gloo group of its own, with no practical time
# limit: an idle worker (no requests for an hour) must not time its ranks out. A rank that dies
# still fails the wait at once (gloo sees the connection close).
CONTROL_TIMEOUT = timedelta(days=365)
# torch 2.13 renamed all_gather_into_tensor; the GPU image may carry an older torch.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class ParallelContext:
    """Where this process sits in its worker's parallel group. world_size 1 = no communication."""
    rank: int = 0
    world_size: int = 1
    expert_parallel: bool = False   # MoE experts sharded over ranks (else each expert TP-sharded)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def shard(self, n: int, what: str) -> tuple[int, int]:
        """[start, stop) of this rank's equal share of n items; n must divide evenly."""
        if n % self.world_size:
            raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({self.world_size})")
        size = n // self.world_size
        return self.rank * size, (self.rank + 1) * size


SINGLE = ParallelContext()


def backend_for(device: torch.device) -> str:
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def open_store(world_size: int, host: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port (read it back from `store.port`)."""
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def connect_store(host: str, port: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


def init_parallel(rank: int, world_size: int, device: torch.device, store: dist.TCPStore,
                  expert_parallel: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelContext:
    """Join the worker's group (blocks until every rank has joined)."""
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed group already exists in this process; one worker "
                           "process can drive only one tensor-parallel group at a time")
    if device.type == "cuda":
        os.environ.update(NCCL_SAFE_ENV)
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return ParallelContext(rank, world_size, expert_parallel)


def new_control_group():
    """The command channel (gloo, CPU tensors); every rank must call this, in the same order."""
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def shutdown_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- collectives (no-ops for a single rank) ------------------------------------------------
def all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sum over ranks, in place."""
    if ctx.enabled:
        dist.all_reduce(x)
    return x


def all_gather_rows(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """(n, ...) on every rank -> (world * n, ...), rank r's rows at [r*n, (r+1)*n)."""
    if not ctx.enabled:
        return x
    out = x.new_empty((ctx.world_size * x.shape[0],) + tuple(x.shape[1:]))
    _all_gather_single(out, x.contiguous())
    return out


def all_gather_last_dim(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """(S, n) per rank -> (S, world * n): rank r's columns at [r*n, (r+1)*n)."""
    if not ctx.enabled:
        return x
    rows = all_gather_rows(x.t().contiguous(), ctx)   # (world*n, S)
    return rows.t()


def all_to_all_rows(x: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                    ctx: ParallelContext) -> torch.Tensor:
    """Send x's consecutive row ranges (send_counts[r] rows to rank r); receive recv_counts[r]
    rows from each rank r, concatenated in rank order."""
    out = x.new_empty((sum(recv_counts),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts)
    return out
