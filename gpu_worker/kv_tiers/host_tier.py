"""The host-memory tier: a fixed pool of block slots with an LRU of the blocks it holds.

    free     slot holds nothing                        -> taken first
    cached   slot holds a block's KV, keyed by hash    -> the LRU one is demoted (disk) or
                                                          dropped when a slot is needed

A slot is never shared, and no slot is held across engine steps (a load copies the slots it
reads to the device before anything may overwrite them), so free + cached == total always.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class HostBlock:
    slot: int
    parent: bytes | None
    token_ids: tuple[int, ...]
    offloaded: "torch.cuda.Event | None"     # the D2H copy filling the slot (None: done)


class HostTier:
    def __init__(self, data: torch.Tensor) -> None:
        self.data = data                         # (num_slots, L, 2, bs, n_kv, hd)
        self.num_slots = int(data.shape[0])
        self._free: deque[int] = deque(range(self.num_slots))
        self._blocks: OrderedDict[bytes, HostBlock] = OrderedDict()   # LRU first

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def get(self, block_hash: bytes) -> HostBlock | None:
        """The block, marked most recently used; None when not held."""
        block = self._blocks.get(block_hash)
        if block is not None:
            self._blocks.move_to_end(block_hash)
        return block

    def free_slot(self) -> int | None:
        """A free slot (removed from the free list), or None when every slot is cached."""
        return self._free.popleft() if self._free else None

    def put(self, block_hash: bytes, block: HostBlock) -> None:
        self._blocks[block_hash] = block

    def pop_lru(self) -> tuple[bytes, HostBlock]:
        """The least recently used block, forgotten: its slot passes to the caller."""
        return self._blocks.popitem(last=False)

    def clear(self) -> list[bytes]:
        """Forget every block; returns their hashes."""
        gone = list(self._blocks)
        for block in self._blocks.values():
            self._free.append(block.slot)
        self._blocks.clear()
        return gone

    def hashes(self) -> list[tuple[bytes, HostBlock]]:
        return list(self._blocks.items())

    def check_integrity(self) -> None:
        """free + cached == total, every slot in exactly one place."""
        slots = [b.slot for b in self._blocks.values()]
        assert len(self._free) + len(slots) == self.num_slots, (
            f"host tier: free {len(self._free)} + cached {len(slots)} != {self.num_slots}")
        assert len(set(slots) | set(self._free)) == self.num_slots, "host tier: a slot is in two places"
