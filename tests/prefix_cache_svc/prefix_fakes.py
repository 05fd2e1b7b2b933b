"""Test helpers: a stand-in for the engine's BlockManager (the listener + snapshot contract only),
pumping a publisher / following it from an index over real sockets, and the CURVE planes of both
ends (`planes()`: the worker and prefix-cache roles of one trust directory per pytest process)."""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

from prefix_cache_svc.channels import fetch_snapshot
from prefix_cache_svc.core import Outcome
from prefix_cache_svc.hashing import block_hash
from services.security import bundle
from services.security.curve import Plane


class Planes(NamedTuple):
    worker: Plane
    index: Plane
    trust_dir: Path


@functools.cache
def planes() -> Planes:
    root = Path(tempfile.mkdtemp(prefix="kvmesh-test-trust-"))
    atexit.register(shutil.rmtree, root, True)
    trust = bundle.generate(root / "trust").root
    return Planes(Plane.load(str(trust), "worker"), Plane.load(str(trust), "prefix-cache"), trust)


class FakeBlockManager:
    def __init__(self, block_size: int, model_id: str = "m") -> None:
        self.block_size = block_size
        self.model_id = model_id
        self._blocks: dict[bytes, tuple[bytes | None, list[int]]] = {}
        self._listeners: list = []

    def add_listener(self, listener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener) -> None:
        self._listeners.remove(listener)

    def cached_block_hashes(self):
        return [(h, parent, list(tokens)) for h, (parent, tokens) in self._blocks.items()]

    def store_prompt(self, tokens: list[int], salt: str = "") -> list[bytes]:
        """Register every full block of `tokens` (as the engine does after prefill)."""
        hashes, parent = [], None
        for i in range(0, len(tokens) - self.block_size + 1, self.block_size):
            chunk = tokens[i:i + self.block_size]
            h = block_hash(parent, self.model_id, salt, chunk)
            if h not in self._blocks:
                self._blocks[h] = (parent, chunk)
                for listener in self._listeners:
                    listener.on_stored(h, parent, list(chunk))
            hashes.append(h)
            parent = h
        return hashes

    def evict(self, h: bytes) -> None:
        del self._blocks[h]
        for listener in self._listeners:
            listener.on_removed(h)

    def reset(self) -> None:
        self._blocks.clear()
        for listener in self._listeners:
            listener.on_cleared()


@contextlib.asynccontextmanager
async def pumped(pub: KVEventPublisher):
    """Call pub.flush() every 5 ms, as a worker's loop would between steps."""
    async def pump():
        while True:
            pub.flush()
            await asyncio.sleep(0.005)
    task = asyncio.create_task(pump())
    try:
        yield
    finally:
        task.cancel()


async def follow(core: PrefixCore, sub: EventSubscriber, pub: KVEventPublisher, until) -> None:
    """Apply batches (fetching snapshots on gaps) until `until()` holds; at most 5 s."""
    async def loop():
        while not until():
            batch = await sub.recv()
            if core.on_batch(batch, 0.0) is Outcome.NEED_SNAPSHOT:
                snap = await fetch_snapshot(pub.snapshot_addr, "req", timeout_s=2.0, plane=planes().index)
                assert snap is not None and snap.request_id == "req"
                core.on_snapshot(snap)
    await asyncio.wait_for(loop(), 5.0)
