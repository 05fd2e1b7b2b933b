"""Which worker served a conversation's last turn: its KV (the history) is there, in some tier.

The gateway turns a request's OpenAI `user` (or the `conversation_id` extension) into a digest of
(tenant, value) and sends it in Submit.conversation; this table keys it by tenant as well, so a
tenant's conversation can only ever be steered by requests of that tenant.

    dispatch of turn k  -> record(key, worker)        the worker that runs it (with P/D: the decode
                                                      worker, which keeps the KV)
    turn k+1 admitted   -> lookup(key, now)           that worker, if the entry is younger than
                                                      ttl_s; routing.route keeps it unless it is
                                                      gone, draining or overloaded
    worker gone/restart -> forget_worker(worker)      its KV went with it

Bounded: at most `max_entries`; when full, the tenant holding the most entries loses its least
recently used one, so one API key naming a new conversation per request evicts its own entries,
not every other key's (one tenant alone: plain LRU). An entry unused for ttl_s expires (the
worker's tiers have likely evicted the history by then).
"""
from __future__ import annotations

from collections import OrderedDict

MAX_CONVERSATIONS = 100_000   # ~300 bytes an entry (two ordered dicts): ~30 MB at most


class ConversationTable:
    def __init__(self, ttl_s: float, max_entries: int = MAX_CONVERSATIONS) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._last: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()  # key -> (worker, used at)
        # each tenant's keys, least recently used first: whom a full table evicts from
        self._of_tenant: dict[str, OrderedDict[tuple[str, str], None]] = {}

    def lookup(self, tenant: str, conversation: str, now: float) -> str | None:
        """The worker of the conversation's last turn, or None (unknown, or older than ttl_s)."""
        key = (tenant, conversation)
        entry = self._last.get(key)
        if entry is None:
            return None
        if now - entry[1] > self.ttl_s:
            self._drop(key)
            return None
        return entry[0]

    def record(self, tenant: str, conversation: str, worker_id: str, now: float) -> None:
        key = (tenant, conversation)
        self._last[key] = (worker_id, now)
        self._last.move_to_end(key)
        keys = self._of_tenant.setdefault(tenant, OrderedDict())
        keys[key] = None
        keys.move_to_end(key)
        while len(self._last) > self.max_entries:
            # tenants are API keys (a handful): the scan is short
            largest = max(self._of_tenant.values(), key=len)
            self._drop(next(iter(largest)))
        self._expire(now)

    def forget_worker(self, worker_id: str) -> None:
        for key in [k for k, (w, _) in self._last.items() if w == worker_id]:
            self._drop(key)

    def _drop(self, key: tuple[str, str]) -> None:
        del self._last[key]
        keys = self._of_tenant[key[0]]
        del keys[key]
        if not keys:
            del self._of_tenant[key[0]]

    def _expire(self, now: float) -> None:
        """Drop the expired entries at the old end (the order is by last use), a few per call."""
        for _ in range(8):
            if not self._last:
                return
            key, (_, used) = next(iter(self._last.items()))
            if now - used <= self.ttl_s:
                return
            self._drop(key)

    def __len__(self) -> int:
        return len(self._last)
