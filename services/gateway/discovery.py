"""What the gateway finds in the registry (Redis), every heartbeat: the scheduler to submit to,
the tokenizer services (when they make its text) and the workers ready to serve (its model
catalog and readiness). A record missing for less than two heartbeats is kept, and for a lease
after Redis lost its data (registry.Membership)."""
from __future__ import annotations

import time
from typing import NamedTuple

from services.registry import Membership, Registry, ServiceRecord


class Members(NamedTuple):
    scheduler_addr: str               # "" when none is registered
    scheduler_key: str                # its address and registry record (id, epoch): a restart on the
                                      # same address is another scheduler; "" when none
    tokenizers: list[ServiceRecord]
    workers: list[ServiceRecord]      # not draining


class Discovery:
    def __init__(self, registry: Registry, heartbeat_ms: int, scheduler_addr: str, with_tokenizers: bool,
                 lease_ms: int = 0) -> None:
        self.registry = registry
        self.fixed_scheduler = scheduler_addr     # --scheduler-addr: this one, not the registry's
        self.kinds = ("scheduler", "worker", *(("tokenizer",) if with_tokenizers else ()))
        grace = 2 * heartbeat_ms / 1000           # vanished records kept this long
        self.members = {kind: Membership(grace, rejoin_s=lease_ms / 1000) for kind in self.kinds}

    async def read(self) -> Members:
        """Raises RedisError / OSError when the registry cannot be read."""
        now = time.monotonic()
        live = {}
        for kind in self.kinds:
            fresh = await self.registry.list(kind)
            live[kind] = self.members[kind].update(fresh, now, self.registry.incarnation)
        scheduler = self.fixed_scheduler or next(
            (r.addrs["zmq"] for r in live["scheduler"] if "zmq" in r.addrs), "")
        record = next((r for r in live["scheduler"] if r.addrs.get("zmq") == scheduler), None)
        key = f"{scheduler}|{record.id}#{record.epoch}" if record is not None else scheduler
        workers = [w for w in live["worker"] if not w.info.get("draining")]
        return Members(scheduler, key, live.get("tokenizer", []), workers)
