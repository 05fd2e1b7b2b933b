"""The rank processes of a tensor-parallel worker: rank 0 drives, ranks 1..N-1 follow.

    worker process (engine)                          child process, rank r (python -m this module)
    TPModelRunner.forward(batch)                     follower loop
      broadcast header [op, sizes...]   ---control------>  header        (gloo, waits forever)
      broadcast packed int64 payload    ---control------>  payload -> ForwardBatch
      rank-0 TPRankRunner.forward       <===NCCL/gloo===>  TPRankRunner.forward (same collectives)
      -> logits (S, V)                                      (logits dropped)

Commands are int64 tensors only (no pickle): FORWARD, ALLOCATE_KV, COPY_BLOCKS, PROFILE,
SHUTDOWN, and the KV tiers' (tp_tiers.py): their records go out batched before the next command. A child that loses its parent exits; the driver checks its children are alive before
every command, so a dead rank is an error rather than a hang.
"""
from __future__ import annotations

import argparse
import atexit
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.model_config import ModelConfig
from gpu_worker.parallel.state import (DEFAULT_TIMEOUT_S, NCCL_SAFE_ENV, connect_store, init_parallel,
                                       new_control_group, open_store, shutdown_parallel)
from gpu_worker.parallel.tp_protocol import (DTYPES, HEADER_LEN, OP_ALLOCATE_KV, OP_CAPTURE, OP_COPY_BLOCKS,
                                             OP_FORWARD, OP_PROFILE, OP_SHUTDOWN, OP_TIER_CHECK, OP_TIER_INIT,
                                             OP_TIER_LAND, OP_TIER_STAGE, OP_TIERS, OP_WARMUP, all_min, all_min_each,
                                             make_header, pack_batch, payload_len, unpack_batch)
from gpu_worker.parallel.tp_tiers import follower_command
from gpu_worker.parallel.tp_runner import TPRankRunner
from gpu_worker.tuning import KernelTuning

log = logging.getLogger(__name__)
# Starting a rank imports torch and the model code: on a loaded host that alone can outlast a short
# collective timeout. A rank that dies while starting fails the wait at once (_check_children), so
# a long bound here costs nothing but the wait for a rank that hangs.
START_TIMEOUT_S = 120.0


# ---- rank 0: the driver the engine holds ----------------------------------------------------
class TPModelRunner:
    """ModelRunner's interface over `tensor_parallel_size` ranks; rank 0 runs in this process."""

    def __init__(self, config: ModelConfig, model_dir: str, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, attention_backend: str = "torch", seed: int = 0,
                 tensor_parallel_size: int = 2, enable_expert_parallel: bool = False,
                 timeout_s: float = DEFAULT_TIMEOUT_S, tuning: KernelTuning = KernelTuning()):
        n = tensor_parallel_size
        device = torch.device(device)
        devices = _rank_devices(device, n)
        self.world_size, self.children, self._closed, self._ready = n, [], False, False
        self._tier_records: list[int] = []     # the KV tiers' records not sent yet (tp_tiers.py)
        store = open_store(n, timeout_s=timeout_s)
        dtype_name = next(k for k, v in DTYPES.items() if v == dtype)
        for rank in range(1, n):
            argv = [sys.executable, "-m", "gpu_worker.parallel.tp_worker", "--rank", str(rank),
                    "--world-size", str(n), "--port", str(store.port), "--model-dir", str(model_dir),
                    "--device", str(devices[rank]), "--dtype", dtype_name, "--attention-backend",
                    attention_backend, "--seed", str(seed), "--timeout-s", str(timeout_s),
                    "--parent-pid", str(os.getpid()), "--tuning", tuning.to_json()] + (["--expert-parallel"] if enable_expert_parallel else [])
            self.children.append(subprocess.Popen(argv, env=_child_env()))
        atexit.register(self.close)
        try:
            self._wait_joined(store, max(timeout_s, START_TIMEOUT_S))
            self.ctx = init_parallel(0, n, devices[0], store, enable_expert_parallel, timeout_s)
            self.control = new_control_group()
            self.rank0 = self._build_rank0(config, model_dir, devices[0], dtype, attention_backend, seed, tuning)
            self._ready = True
        except BaseException:
            self.close()
            raise

    def _wait_joined(self, store, timeout_s: float) -> None:
        """Children announce themselves in the store before the group forms, so one that dies
        while starting (bad import, bad device) fails here, not after a long collective timeout."""
        deadline = time.monotonic() + timeout_s
        keys = [f"joined/{r}" for r in range(1, self.world_size)]
        while not store.check(keys):
            self._check_children()
            if time.monotonic() > deadline:
                raise TimeoutError("tensor-parallel ranks did not start in time")
            time.sleep(0.05)

    def _build_rank0(self, config, model_dir, device, dtype, backend, seed, tuning) -> TPRankRunner:
        error = None
        try:
            runner = TPRankRunner(config, model_dir, self.ctx, device, dtype, backend, seed, tuning)
        except Exception as e:           # still take part in the READY vote, then raise
            error = e
        if all_min(0 if error else 1, self.control) == 0:
            raise error or RuntimeError("a tensor-parallel rank failed to load the model (see its log)")
        return runner

    # ---- what the engine calls -----------------------------------------------------------
    @property
    def config(self) -> ModelConfig:
        return self.rank0.full_config

    @property
    def vocab_size(self) -> int:
        return self.rank0.vocab_size

    @property
    def num_layers(self) -> int:
        return self.rank0.num_layers

    @property
    def num_blocks(self) -> int:
        return self.rank0.num_blocks

    @property
    def device(self) -> torch.device:
        return self.rank0.device

    @property
    def kv_caches(self):
        """Rank 0's shard of the KV cache (the KV tiers copy rank 0's; followers repeat on theirs)."""
        return self.rank0.kv_caches

    def queue_tier_records(self, records: list[int]) -> None:
        """KV tier records (tp_tier_records.py), sent as one TIERS command before the next command."""
        self._tier_records += records

    def tier_command(self, header: torch.Tensor, payload: torch.Tensor | None, mine: torch.Tensor) -> torch.Tensor:
        """A KV tier command every rank answers: -> the MIN over the ranks of each value of `mine`."""
        self._send(header, payload)
        return all_min_each(mine, self.control)

    @property
    def dtype(self) -> torch.dtype:
        return self.rank0.dtype

    def block_size_bytes(self, block_size: int) -> int:
        """KV bytes per block on one GPU (each rank holds its own KV heads)."""
        return self.rank0.block_size_bytes(block_size)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._send(make_header(OP_ALLOCATE_KV, num_blocks, block_size))
        self.rank0.allocate_kv_cache(num_blocks, block_size)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        if not src:
            return
        if len(src) != len(dst):
            raise ValueError("copy_blocks: src and dst must have the same length")
        self._send(make_header(OP_COPY_BLOCKS, len(src)), torch.tensor(src + dst, dtype=torch.int64))
        self.rank0.copy_blocks(src, dst)

    def profile_num_blocks(self, block_size: int, gpu_memory_utilization: float,
                           max_num_batched_tokens: int = 4096, max_num_seqs: int = 0) -> int:
        """The fewest blocks that fit on any rank's GPU (every rank runs the dummy draw: its head
        gathers the vocabulary shards)."""
        self._send(make_header(OP_PROFILE, block_size, round(gpu_memory_utilization * 1e6), max_num_batched_tokens,
                               max_num_seqs))
        return all_min(self.rank0.profile_num_blocks(block_size, gpu_memory_utilization, max_num_batched_tokens,
                                                     max_num_seqs), self.control)

    def warmup(self, max_num_seqs: int, max_query_len: int = 0) -> None:
        """ModelRunner.warmup on every rank (its warm-up forwards hold collectives)."""
        self._send(make_header(OP_WARMUP, max_num_seqs, max_query_len))
        self.rank0.warmup(max_num_seqs, max_query_len)

    def capture_cuda_graphs(self, max_batch_size: int, max_context_len: int) -> None:
        """Every rank captures the same decode graphs (NCCL collectives inside them), so replays
        line up as eager steps do. Not with expert parallelism: its all-to-all sizes are read on
        the host each step, which capture forbids; those models stay eager."""
        if self.rank0.has_expert_parallel_layers():
            log.info("expert-parallel MoE layers: decode steps run eagerly (no CUDA graphs)")
            return
        self._send(make_header(OP_CAPTURE, max_batch_size, max_context_len))
        self.rank0.capture_cuda_graphs(max_batch_size, max_context_len)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> (S, vocab) float32 logits, as ModelRunner.forward."""
        if not self.rank0.kv_caches:
            raise RuntimeError("allocate_kv_cache must be called before forward")
        header, payload = pack_batch(batch)
        self._send(header, payload)
        return self.rank0.forward(batch)

    def close(self) -> None:
        """Stop the child ranks and leave the process group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._ready and dist.is_initialized() and all(p.poll() is None for p in self.children):
            try:
                self._send_tier_records()          # e.g. a drain to disk's writes
                dist.broadcast(make_header(OP_SHUTDOWN), src=0, group=self.control)
            except RuntimeError:
                pass
        for p in self.children:
            if not self._ready:
                p.terminate()        # a rank that never joined, or a group that never formed
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutdown_parallel()
        atexit.unregister(self.close)
        if getattr(self, "rank0", None) is not None:   # None when rank 0 failed to build
            self.rank0.close()

    # ---- internals ----------------------------------------------------------------------
    def _send(self, header: torch.Tensor, payload: torch.Tensor | None = None) -> None:
        self._check_children()
        self._send_tier_records()
        dist.broadcast(header, src=0, group=self.control)
        if payload is not None:
            dist.broadcast(payload, src=0, group=self.control)

    def _send_tier_records(self) -> None:
        """The KV tiers' queued records go first: rank 0 ran them before what follows."""
        if self._tier_records:
            records, self._tier_records = torch.tensor(self._tier_records, dtype=torch.int64), []
            dist.broadcast(make_header(OP_TIERS, len(records)), src=0, group=self.control)
            dist.broadcast(records, src=0, group=self.control)

    def _check_children(self) -> None:
        if self._closed:
            raise RuntimeError("the tensor-parallel runner is closed")
        dead = [(i + 1, p.returncode) for i, p in enumerate(self.children) if p.poll() is not None]
        if dead:
            raise RuntimeError(f"tensor-parallel rank(s) exited: {dead} (rank, exit code); see their log")


def _rank_devices(device: torch.device, n: int) -> list[torch.device]:
    if device.type != "cuda":
        return [torch.device("cpu")] * n
    first = device.index or 0
    if torch.cuda.device_count() < first + n:
        raise ValueError(f"tensor_parallel_size {n} needs GPUs {first}..{first + n - 1}, "
                         f"but only {torch.cuda.device_count()} are visible")
    return [torch.device("cuda", first + r) for r in range(n)]


def _child_env() -> dict[str, str]:
    env = dict(os.environ, **NCCL_SAFE_ENV)
    root = str(Path(__file__).resolve().parents[2])     # the repository root: gpu_worker's parent
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# ---- ranks 1..N-1 ---------------------------------------------------------------------------
def follow(runner: TPRankRunner, control) -> None:
    """Execute rank 0's commands until SHUTDOWN."""
    tiers: list = [None]            # the KV tiers' host slots and files, once TIER_INIT made them
    try:
        _follow(runner, control, tiers)
    finally:
        if tiers[0] is not None:
            tiers[0].close()         # the disk tier's queued writes finish


def _follow(runner: TPRankRunner, control, tiers: list) -> None:
    header = torch.empty(HEADER_LEN, dtype=torch.int64)

    def recv(n: int) -> torch.Tensor:
        payload = torch.empty(n, dtype=torch.int64)
        dist.broadcast(payload, src=0, group=control)
        return payload

    while True:
        dist.broadcast(header, src=0, group=control)
        op = int(header[0])
        if op == OP_FORWARD:
            payload = torch.empty(payload_len(header), dtype=torch.int64)
            dist.broadcast(payload, src=0, group=control)
            runner.forward(unpack_batch(header, payload))
        elif op == OP_ALLOCATE_KV:
            runner.allocate_kv_cache(int(header[1]), int(header[2]))
        elif op == OP_COPY_BLOCKS:
            pairs = torch.empty(2 * int(header[1]), dtype=torch.int64)
            dist.broadcast(pairs, src=0, group=control)
            src, dst = pairs.tolist()[: int(header[1])], pairs.tolist()[int(header[1]):]
            runner.copy_blocks(src, dst)
        elif op == OP_WARMUP:
            runner.warmup(int(header[1]), int(header[2]))
        elif op == OP_CAPTURE:
            runner.capture_cuda_graphs(int(header[1]), int(header[2]))
        elif op == OP_PROFILE:
            all_min(runner.profile_num_blocks(int(header[1]), int(header[2]) / 1e6, int(header[3]), int(header[4])),
                    control)
        elif op == OP_TIERS:
            tiers[0].replay(recv(int(header[1])).tolist())
        elif op in (OP_TIER_INIT, OP_TIER_STAGE, OP_TIER_CHECK, OP_TIER_LAND):
            tiers[0] = follower_command(tiers[0], op, header, recv, lambda t: all_min_each(t, control),
                                        runner.kv_caches, runner.ctx.rank)
        elif op == OP_SHUTDOWN:
            return
        else:
            raise RuntimeError(f"unknown tensor-parallel command {op}")


def _watch_parent(parent_pid: int) -> None:
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)      # the driver is gone: nobody will ever send SHUTDOWN
            time.sleep(1.0)
    threading.Thread(target=watch, daemon=True, name="tp-parent-watch").start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="one follower rank of a tensor-parallel kvmesh worker")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--attention-backend", default="torch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    ap.add_argument("--parent-pid", type=int, default=0)
    ap.add_argument("--expert-parallel", action="store_true")
    ap.add_argument("--tuning", default=KernelTuning().to_json(), help="KernelTuning as JSON (rank 0's)")
    args = ap.parse_args(argv)
    if args.parent_pid:
        _watch_parent(args.parent_pid)
    device = torch.device(args.device)
    store = connect_store(args.host, args.port, args.world_size, args.timeout_s)
    store.set(f"joined/{args.rank}", "1")
    ctx = init_parallel(args.rank, args.world_size, device, store, args.expert_parallel, args.timeout_s)
    control = new_control_group()
    runner, error = None, None
    try:
        config = ModelConfig.from_dir(args.model_dir)
        runner = TPRankRunner(config, args.model_dir, ctx, device, DTYPES[args.dtype],
                              args.attention_backend, args.seed, KernelTuning.from_json(args.tuning))
    except Exception as e:
        error = e
    if all_min(0 if error else 1, control) == 0:
        shutdown_parallel()
        if error is not None:
            raise error
        return 1
    try:
        follow(runner, control)
    finally:
        shutdown_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
