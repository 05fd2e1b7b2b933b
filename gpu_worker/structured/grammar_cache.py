"""GrammarCache: compiled grammars by constraint digest, bounded in bytes, least recently used out.

The pool keeps its own cache rather than xgrammar's so that a hit is known at submission: a
cached constraint's job is settled at once on the engine thread (a dict lookup), never queued
behind other compiles, and its request draws in its prefill step. The bound counts each grammar's
`memory_size_bytes`; an insertion evicts from the least recently used end until the total is
back under the bound (a grammar larger than the whole bound is not kept).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any


class GrammarCache:
    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._entries: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()   # digest -> (grammar, bytes)
        self._bytes = 0
        self._lock = threading.Lock()     # compile threads insert, the engine thread looks up

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def get(self, key: bytes) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: bytes, compiled: Any) -> None:
        size = int(compiled.memory_size_bytes)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (compiled, size)
            self._bytes += size
            while self._bytes > self.limit_bytes and self._entries:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted
