"""The paged KV block pool: ref counts, free list, prefix-cache hash map, LRU eviction, COW.

Every block is in exactly one of three states:

    free    ref_count == 0, no hash      -> handed out first
    cached  ref_count == 0, hashed       -> reusable by a prefix hit; evicted LRU-first when
                                            the free list is empty
    used    ref_count  > 0               -> in one or more sequences' block tables

Only FULL blocks whose KV is computed get a hash (`register_computed_blocks`); a block is
never written after it is full, so sharing full blocks needs no copy. Samples of one request
(n > 1) also share the prompt's partial last block; the first sample to write into a shared
block gets a private copy (`allocate_slots` returns the (src, dst) pairs for runner.copy_blocks).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from services.prefix_hash import chain_hashes
from gpu_worker.sequence import Sequence


class KVEventListener(Protocol):
    """Told about every change of the set of cached (hashed) blocks, in order. The block manager
    reports the device's blocks (tier "gpu", the default); lower KV tiers (gpu_worker/kv_tiers)
    report theirs through the same listeners with tier "cpu", "disk" or "shared", and the shared
    tier's lookups that found no file with on_missing (a hint: the index drops only a block it
    credits)."""

    def on_stored(self, block_hash: bytes, parent: bytes | None, token_ids: list[int]) -> None: ...
    def on_removed(self, block_hash: bytes) -> None: ...
    def on_missing(self, block_hash: bytes, tier: str) -> None: ...
    def on_cleared(self) -> None: ...


class LowerTiers(Protocol):
    """Where evicted cached blocks go (gpu_worker/kv_tiers.KVTiers)."""

    def on_evict(self, block_id: int, block_hash: bytes, parent: bytes | None,
                 token_ids: tuple[int, ...]) -> None: ...
    def snapshot(self) -> list[tuple[bytes, bytes | None, list[int], str]]: ...
    def clear(self) -> None: ...


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None          # set only while registered in the hash map
    parent: bytes | None = None
    token_ids: tuple[int, ...] = ()


class BlockCopy(NamedTuple):
    src: int
    dst: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, model_id: str,
                 enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_id = model_id
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._by_hash: dict[bytes, int] = {}
        self._holders: dict[int, Sequence] = {}               # id(seq) -> seq holding blocks
        self._listeners: list[KVEventListener] = []
        self.lower_tiers: LowerTiers | None = None           # told of every eviction
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- sizes -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free + evictable cached)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ------------------------------------------------------------------
    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding seq's longest cached prefix (no side effects).

        The block holding the last token is never reused, so at least one token is always
        computed (its logits are needed): a full-prompt hit still recomputes the last block.
        """
        return self._cached_prefix(seq, (seq.num_tokens - 1) // self.block_size)

    def lookup_full_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks holding seq's longest cached prefix of FULL prompt blocks, the last one
        included: a sequence whose KV arrives from a prefill engine computes no prompt token here."""
        return self._cached_prefix(seq, seq.num_prompt_tokens // self.block_size)

    def _cached_prefix(self, seq: Sequence, limit: int) -> list[int]:
        """Cached blocks of seq's longest cached prefix among its first `limit` blocks."""
        if not self.enable_prefix_caching:
            return []
        self._ensure_hashes(seq, limit)
        hits: list[int] = []
        for h in seq.block_hashes[:limit]:
            block_id = self._by_hash.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate_prefill(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        """Give a sequence without blocks the cached `hits` plus room for num_new_tokens after them.

        Returns False (and changes nothing) when the pool cannot supply the blocks.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0, "sequence already holds blocks"
        num_cached = len(hits) * self.block_size
        need = self.blocks_for(num_cached + num_new_tokens) - len(hits)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if need > self.num_free_blocks - revived:
            return False
        for block_id in hits:
            self._ref(block_id)
        seq.block_table = list(hits)
        seq.num_computed_tokens = num_cached
        seq.num_registered_blocks = len(hits)
        self.prefix_query_tokens += seq.num_tokens
        self.prefix_hit_tokens += num_cached
        self._holders[id(seq)] = seq
        seq.block_table.extend(self._take() for _ in range(need))
        return True

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Hash and publish the full blocks whose KV is now computed."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        self._ensure_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            h = seq.block_hashes[i]
            if block.hash is None and h not in self._by_hash:
                block.hash, block.parent = h, seq.block_hashes[i - 1] if i else None
                block.token_ids = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
                self._by_hash[h] = block.block_id
                for listener in self._listeners:
                    listener.on_stored(h, block.parent, list(block.token_ids))
        seq.num_registered_blocks = num_full

    def _ensure_hashes(self, seq: Sequence, num_full: int) -> None:
        have = len(seq.block_hashes)
        if have >= num_full:
            return
        bs = self.block_size
        parent = seq.block_hashes[-1] if have else None
        seq.block_hashes.extend(chain_hashes(parent, self.model_id, seq.request.cache_salt,
                                             seq.token_ids[have * bs:num_full * bs], bs))

    # ---- slots and copy-on-write -------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[BlockCopy] | None:
        """Room for num_new_tokens more tokens of a sequence that already holds blocks.

        Returns the copy-on-write copies the runner must do before this step's forward, or None
        (and changes nothing) when the pool cannot supply the blocks.
        """
        table = seq.block_table
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(table)
        write_idx = seq.num_computed_tokens // self.block_size   # block receiving the next token
        shared = write_idx < len(table) and self.blocks[table[write_idx]].ref_count > 1
        if max(need, 0) + shared > self.num_free_blocks:
            return None
        copies: list[BlockCopy] = []
        if shared:
            old, new = table[write_idx], self._take()
            self.blocks[old].ref_count -= 1      # still > 0: another sample holds it
            table[write_idx] = new
            copies.append(BlockCopy(old, new))
        table.extend(self._take() for _ in range(max(need, 0)))
        self._holders[id(seq)] = seq
        return copies

    def release_uncomputed(self, seq: Sequence) -> None:
        """Free the blocks past seq's computed tokens (slots of rejected draft tokens). They
        were allocated this step, so they are private and unhashed: back to the free list."""
        keep = self.blocks_for(seq.num_computed_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.hash is None, "a released slot's block is shared or cached"
            block.ref_count = 0
            self._free.append(block_id)
        del seq.block_table[keep:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every block of parent (child.block_table is a copy of parent's)."""
        for block_id in child.block_table:
            self._ref(block_id)
        self._holders[id(child)] = child

    def free(self, seq: Sequence) -> None:
        """Drop a sequence's blocks: unhashed ones return to the free list, hashed ones to the
        LRU cache. Tail blocks are released first so they are evicted before the prefix."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self._cached[block_id] = None
                else:
                    self._free.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        self._holders.pop(id(seq), None)

    # ---- pool internals ----------------------------------------------------------------
    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._cached.pop(block_id)
        block.ref_count += 1

    def _take(self) -> int:
        """A block with ref_count 1: from the free list, else by evicting the LRU cached block."""
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._cached.popitem(last=False)
            block = self.blocks[block_id]
            if self.lower_tiers is not None:
                self.lower_tiers.on_evict(block_id, block.hash, block.parent, block.token_ids)
            self._unregister(block)
        self.blocks[block_id].ref_count = 1
        return block_id

    def _unregister(self, block: Block) -> None:
        h = block.hash
        assert h is not None
        del self._by_hash[h]
        block.hash, block.parent, block.token_ids = None, None, ()
        for listener in self._listeners:
            listener.on_removed(h)

    # ---- events, maintenance, checks ---------------------------------------------------
    def add_listener(self, listener: KVEventListener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: KVEventListener) -> None:
        self._listeners.remove(listener)

    @property
    def listeners(self) -> tuple[KVEventListener, ...]:
        return tuple(self._listeners)

    def attach_lower_tiers(self, tiers: LowerTiers) -> None:
        """Evicted cached blocks are reported to `tiers` (their KV is intact until the next
        write into the block), and the cache's snapshot and reset cover them."""
        self.lower_tiers = tiers

    def lower_tier_block_hashes(self) -> list[tuple[bytes, bytes | None, list[int], str]]:
        """Every block the lower tiers hold, as (hash, parent, token_ids, tier)."""
        return self.lower_tiers.snapshot() if self.lower_tiers is not None else []

    def blocks_newest_first(self) -> list[Block]:
        """Every hashed block: those in use, then the cached ones most recently used first."""
        used = [self.blocks[b] for b in self._by_hash.values() if self.blocks[b].ref_count]
        return used + [self.blocks[b] for b in reversed(self._cached)]

    def cached_block_hashes(self) -> list[tuple[bytes, bytes | None, list[int]]]:
        """Snapshot of every hashed block (used or cached) as (hash, parent, token_ids), in the
        order they were stored, so a parent comes before its children."""
        return [(h, self.blocks[b].parent, list(self.blocks[b].token_ids)) for h, b in self._by_hash.items()]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, lower tiers included (emits on_cleared). Refused (False)
        while blocks are in use."""
        if self.num_used_blocks:
            return False
        if self.lower_tiers is not None:
            self.lower_tiers.clear()
        for block_id in list(self._cached):
            block = self.blocks[block_id]
            block.hash, block.parent, block.token_ids = None, None, ()
            self._free.append(block_id)
        self._cached.clear()
        self._by_hash.clear()
        for listener in self._listeners:
            listener.on_cleared()
        return True

    def check_integrity(self) -> None:
        """free + cached + used == total, and ref counts match the holders' block tables."""
        used = [b for b in self.blocks if b.ref_count > 0]
        assert len(self._free) + len(self._cached) + len(used) == self.num_blocks, (
            f"free {len(self._free)} + cached {len(self._cached)} + used {len(used)} != {self.num_blocks}")
        assert all(self.blocks[b].ref_count == 0 and self.blocks[b].hash is None for b in self._free)
        assert all(self.blocks[b].ref_count == 0 and self.blocks[b].hash is not None for b in self._cached)
        assert len(set(self._free)) == len(self._free) and not set(self._free) & set(self._cached)
        for h, block_id in self._by_hash.items():
            assert self.blocks[block_id].hash == h, f"hash map points block {block_id} at a stale hash"
        assert sum(b.hash is not None for b in self.blocks) == len(self._by_hash)
        expected = [0] * self.num_blocks
        for seq in self._holders.values():
            for block_id in seq.block_table:
                expected[block_id] += 1
        actual = [b.ref_count for b in self.blocks]
        assert expected == actual, "ref counts differ from the block tables that hold them"
