"""The cluster-wide prefix index: which worker holds which KV block, in which tier.

A hash-chain trie laid out for a fast longest-prefix walk (no per-node containers, worker sets
as integer bitmasks, mostly pointer chasing):

    by_hash : block_hash -> Node                     events name blocks by hash
    by_edge : parent_hash + packed tokens -> Node    a prompt follows child links by its tokens
    Node    : hash, key (= parent_hash + tokens, or tokens alone for a first block),
              masks = (gpu, cpu, disk, shared) int bitmasks (bit s: owner slot s holds it in that
              tier; a worker's slot is set in the first three only, a shared-tier id's in the
              last only), hot = the child stored or walked to last

    prompt   | blk0 | blk1 | blk2 | ... | partial |      (full blocks only; the tail is ignored)
    walk       H(blk0) -> by_hash[h0]
               node.hot if its key ends with blk1, else by_edge[h0 + blk1] -> node1
               ...                                     until a miss
    per worker: the walk ANDs the bitmasks; a worker's match ends where its bit drops out.

Shared tier: a node's `shared` mask names shared-tier ids (kv_offload_shared_dir), not workers.
A walk reads it through `readers` (set_readers: worker -> the id it announces), so a block in a
shared tier counts for every worker that reads that tier, and for no other (match_walk.py).

Only the first block is hashed on a token walk (its hash carries model id and tenant salt);
every later step is verified on tokens by construction (a child's key is its parent's hash +
its tokens). With caller-supplied hashes the walk checks each node's key against the prompt's
tokens as well, so a match is never trusted on hashes alone. Along an unbranched chain the walk
follows `hot` and compares 64 bytes per block: ~0.3 ms for 2048 blocks among a million
(bench_match.py).

Capacity: beyond `max_blocks` the oldest-inserted block without known children is dropped from
the index (not from Redis); the count of such evictions is in `stats()`.

Token ids are users' prompts and answers: a block's tokens live exactly as long as some worker
holds the block. A node that leaves the index drops its key at once (a stale eviction-queue entry
may outlive it, holding no tokens), and the queue is compacted when stale entries outnumber live
ones, so churn without capacity pressure cannot grow it.
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

import msgspec

from prefix_cache_svc.hashing import block_hash as compute_block_hash
from prefix_cache_svc.match_walk import Walk
from services.protocol.kv_events import SHARED_TIER, TIERS, WorkerMatch
from services.protocol.kv_events import pack_token_ids as pack_tokens
from services.protocol.kv_events import unpack_token_ids as unpack_tokens

TIER_BIT = {"gpu": 1, "cpu": 2, "disk": 4, SHARED_TIER: 8}
WORKER_TIERS = 7   # a worker's own tiers
ALL_TIERS = 15
_EVICT_SCAN = 64  # nodes with children skipped per eviction before one is evicted anyway


class _Node(msgspec.Struct, gc=False):
    """One block. gc=False: a million nodes must not be walked by every full garbage collection.
    Nodes hold bytes, ints, tuples of ints and a reference to one child (`hot`, always cleared
    when that child leaves the index), so they never form a cycle."""

    hash: bytes
    key: bytes                     # parent hash + packed tokens; packed tokens alone for a first block
    masks: tuple = (0, 0, 0, 0)    # (gpu, cpu, disk, shared) owner bitmasks, interned: see RadixIndex._set_masks
    nchild: int = 0                # children inserted while this node existed (best effort)
    hot: "_Node | None" = None     # the child stored or walked to last: a walk tries it before by_edge
    # (a cycle of hot links would need a cycle of parent hashes: a blake2b preimage, or a worker
    #  sending made-up hashes; a block naming itself as parent is refused)
    evict_skips: int = 0           # stale entries of this node in the eviction queue

    @property
    def owners(self) -> int:
        g, c, d, s = self.masks
        return g | c | d | s


_NO_OWNERS = (0, 0, 0, 0)
_TIER_INDEX = {1: 0, 2: 1, 4: 2, 8: 3}
_MASK_POOL_LIMIT = 1 << 16


class MatchResult(NamedTuple):
    query_blocks: int              # full blocks in the prompt
    workers: list[WorkerMatch]     # non-empty matches, longest first


class IndexRecord(msgspec.Struct, array_like=True, frozen=True):
    """One block with its owners, for snapshot/restore of the whole index."""

    block_hash: bytes
    parent_hash: bytes | None
    tokens: bytes                   # packed uint32
    owners: list[tuple[str, int]]   # (worker_id, tier bitmask); (shared-tier id, TIER_BIT["shared"])


class IndexSnapshot(msgspec.Struct, frozen=True):
    block_size: int
    records: list[IndexRecord]


class IndexStats(NamedTuple):
    blocks: int
    ownerships: int
    workers: int
    evictions: int
    rejected: int


def _owner_key(owner: str, tier: str) -> str | tuple[str, str]:
    """A slot's key: the worker id, or (SHARED_TIER, id) for a shared tier (a worker may be
    called anything, so the two never share a namespace)."""
    return (SHARED_TIER, owner) if tier == SHARED_TIER else owner


class RadixIndex:
    def __init__(self, block_size: int, max_blocks: int | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._tok_bytes = 4 * block_size
        self._by_hash: dict[bytes, _Node] = {}
        self._by_edge: dict[bytes, _Node] = {}
        self._slot_of: dict[str | tuple[str, str], int] = {}
        self._worker_at: list[str | tuple[str, str] | None] = []   # slot -> owner key (_owner_key)
        self._readers: dict[str, str] = {}           # worker id -> shared-tier id it reads
        self._expand: dict[int, int] = {}            # shared mask -> its readers' slots (memo)
        self._blocks_of: list[set[bytes]] = []      # slot -> hashes it holds (any tier)
        self._fifo: deque[_Node] = deque()           # insertion order, for capacity eviction
        self._stale = 0                              # entries of unlinked nodes in _fifo
        self._mask_pool: dict[tuple[int, int, int], tuple[int, int, int]] = {_NO_OWNERS: _NO_OWNERS}
        self.evictions = 0
        self.rejected = 0                            # inconsistent inserts refused

    # ---- sizes -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def workers(self) -> list[str]:
        """Workers with a slot (blocks in their own tiers, or a shared tier they read)."""
        return [w for w in self._worker_at if isinstance(w, str)]

    def shared_tiers(self) -> list[str]:
        """Shared-tier ids that hold blocks."""
        return [k[1] for k in self._worker_at if isinstance(k, tuple)]

    def num_blocks_of(self, worker_id: str, tier: str = "gpu") -> int:
        """Blocks a worker holds (any tier of its own); with tier="shared": a shared tier's."""
        slot = self._slot_of.get(_owner_key(worker_id, tier))
        return 0 if slot is None else len(self._blocks_of[slot])

    def stats(self) -> IndexStats:
        owned = sum(len(s) for s in self._blocks_of)
        return IndexStats(len(self._by_hash), owned, len(self.workers()), self.evictions, self.rejected)

    def blocks_of(self, owner: str, tier: str = "gpu") -> dict[bytes, int]:
        """Every block a worker holds -> tier bitmask (TIER_BIT); with tier="shared": a shared tier's."""
        slot = self._slot_of.get(_owner_key(owner, tier))
        if slot is None:
            return {}
        return {h: _tiers_of(self._by_hash[h], slot) for h in self._blocks_of[slot]}

    def set_readers(self, readers: dict[str, str]) -> None:
        """Which live workers read which shared tier (worker id -> shared-tier id); a worker left
        out reads none. A reader gets a slot even before it holds a block of its own: a new
        worker on the node is credited with the shared tier at once."""
        if readers == self._readers:
            return
        # the new readers first: remove_worker re-slots a worker that is still a reader
        left, self._readers = self._readers.keys() - readers.keys(), dict(readers)
        for worker_id in left:
            slot = self._slot_of.get(worker_id)
            if slot is not None and not self._blocks_of[slot]:
                self.remove_worker(worker_id)
        for worker_id in readers:
            self._slot(worker_id)
        self._expand = {}

    def parent_and_tokens(self, block_hash: bytes) -> tuple[bytes | None, bytes]:
        """(parent hash or None, packed tokens) of an indexed block."""
        key = self._by_hash[block_hash].key
        return key[:-self._tok_bytes] or None, key[-self._tok_bytes:]

    # ---- updates -----------------------------------------------------------------------
    def insert(self, worker_id: str, block_hash: bytes, parent_hash: bytes | None,
               token_ids, tier: str = "gpu") -> bool:
        """Record that the worker holds the block in `tier`. False when it already did, or when
        the block contradicts what the index knows (wrong size, same hash with other tokens or
        parent, or another hash for the same parent and tokens): counted in `rejected`."""
        tokens = token_ids if isinstance(token_ids, bytes) else pack_tokens(token_ids)
        if len(tokens) != self._tok_bytes or parent_hash == block_hash:
            self.rejected += 1
            return False
        key = tokens if parent_hash is None else parent_hash + tokens
        node = self._by_hash.get(block_hash)
        if node is None:
            if parent_hash is not None and key in self._by_edge:  # same parent + tokens, other hash
                self.rejected += 1
                return False
            node = self._new_node(block_hash, key, parent_hash)
        elif node.key != key:
            self.rejected += 1
            return False
        slot = self._slot(_owner_key(worker_id, tier))
        bit, t = 1 << slot, _TIER_INDEX[TIER_BIT[tier]]
        if node.masks[t] & bit:
            return False
        masks = list(node.masks)
        masks[t] |= bit
        self._set_masks(node, masks)
        self._blocks_of[slot].add(block_hash)
        return True

    def remove(self, worker_id: str, block_hash: bytes, tier: str = "gpu") -> bool:
        """Forget the worker's (or shared tier's) copy of the block in `tier`. False when it had none."""
        slot = self._slot_of.get(_owner_key(worker_id, tier))
        node = self._by_hash.get(block_hash)
        if slot is None or node is None:
            return False
        dropped = self._drop(node, slot, TIER_BIT[tier])
        self._compact_fifo()
        return dropped

    def clear(self, worker_id: str, tier: str | None = None) -> int:
        """Forget the worker's blocks in `tier` (all its own tiers when None; "shared": every block
        of the shared tier `worker_id` names); returns copies dropped."""
        slot = self._slot_of.get(_owner_key(worker_id, tier or "gpu"))
        if slot is None:
            return 0
        tier_bits = WORKER_TIERS if tier is None else TIER_BIT[tier]
        dropped = 0
        for h in list(self._blocks_of[slot]):
            dropped += self._drop(self._by_hash[h], slot, tier_bits)
        self._compact_fifo()
        return dropped

    def remove_worker(self, worker_id: str) -> int:
        """Purge every block of the worker and free its slot; returns the blocks it held. The
        shared tier it read keeps its blocks (the files outlive the worker)."""
        return self._free(worker_id, None)

    def remove_shared_tier(self, shared_id: str) -> int:
        """Purge every block of a shared tier and free its slot."""
        return self._free((SHARED_TIER, shared_id), SHARED_TIER)

    def _free(self, key, tier: str | None) -> int:
        slot = self._slot_of.get(key)
        if slot is None:
            return 0
        held = len(self._blocks_of[slot])
        self.clear(key if tier is None else key[1], tier)
        del self._slot_of[key]
        self._worker_at[slot] = None
        self._expand = {}
        if tier is None and key in self._readers:   # still a live reader: it keeps a slot
            self._slot(key)
        return held

    def _slot(self, key) -> int:
        slot = self._slot_of.get(key)
        if slot is not None:
            return slot
        try:
            slot = self._worker_at.index(None)
            self._worker_at[slot] = key
        except ValueError:
            slot = len(self._worker_at)
            self._worker_at.append(key)
            self._blocks_of.append(set())
        self._slot_of[key] = slot
        self._expand = {}
        return slot

    def _readers_of(self, shared_mask: int) -> int:
        """The worker slots that read any shared tier in `shared_mask` (memoized per mask)."""
        slots = self._expand.get(shared_mask)
        if slots is None:
            slots = 0
            for worker_id, shared_id in self._readers.items():
                tier_slot = self._slot_of.get((SHARED_TIER, shared_id))
                if tier_slot is not None and shared_mask >> tier_slot & 1:
                    slots |= 1 << self._slot_of[worker_id]
            self._expand[shared_mask] = slots
        return slots

    def _new_node(self, block_hash: bytes, key: bytes, parent_hash: bytes | None) -> _Node:
        if self.max_blocks is not None and len(self._by_hash) >= self.max_blocks:
            self._evict_one()
        node = _Node(block_hash, key)
        self._by_hash[block_hash] = node
        if parent_hash is not None:
            self._by_edge[key] = node
            parent = self._by_hash.get(parent_hash)
            if parent is not None:
                parent.nchild += 1
                parent.hot = node
        self._fifo.append(node)
        return node

    def _drop(self, node: _Node, slot: int, tier_bits: int) -> int:
        """Clear the slot's bit in the given tiers; unlink the node when nobody holds it."""
        bit, dropped = 1 << slot, 0
        masks = list(node.masks)
        for tier_bit, t in _TIER_INDEX.items():
            if tier_bits & tier_bit and masks[t] & bit:
                masks[t] &= ~bit
                dropped += 1
        if dropped:
            self._set_masks(node, masks)
        if dropped and not node.owners & bit:
            self._blocks_of[slot].discard(node.hash)
        if dropped and not node.owners:
            self._unlink(node)
        return dropped

    def _set_masks(self, node: _Node, masks: list[int]) -> None:
        """Store the (gpu, cpu, disk, shared) masks as one pooled tuple: equal masks are the same object,
        so a match walk notices a change of owners with one identity test per block."""
        key = tuple(masks)
        pooled = self._mask_pool.get(key)
        if pooled is None:
            if len(self._mask_pool) >= _MASK_POOL_LIMIT:
                self._mask_pool.clear()  # old nodes keep their tuples; walks just compare more
            pooled = self._mask_pool[key] = key
        node.masks = pooled

    def _unlink(self, node: _Node) -> None:
        del self._by_hash[node.hash]
        if len(node.key) > self._tok_bytes:
            del self._by_edge[node.key]
            parent = self._by_hash.get(node.key[:-self._tok_bytes])
            if parent is not None:
                parent.nchild = max(0, parent.nchild - 1)
                if parent.hot is node:
                    parent.hot = None
        node.hot = None
        node.key = b""         # the tokens go with the block (its queue entry may stay a while)
        node.evict_skips += 1  # its queue entry is stale now
        self._stale += 1

    def _compact_fifo(self) -> None:
        """Drop the queue entries of unlinked nodes once they outnumber the live ones (insertion
        order kept, so eviction order holds). Called after removals, never inside _evict_one."""
        if self._stale <= len(self._by_hash) + 1024:
            return
        self._fifo = deque(n for n in self._fifo if self._by_hash.get(n.hash) is n)
        for node in self._fifo:
            node.evict_skips = 0   # a live node's only entry is its own
        self._stale = 0

    def _evict_one(self) -> None:
        """Drop the oldest block, preferring ones without children (a root would orphan a chain)."""
        scanned = 0
        while self._fifo:
            node = self._fifo.popleft()
            if node.evict_skips:
                node.evict_skips -= 1
                self._stale -= 1
                continue
            if node.nchild and scanned < _EVICT_SCAN:
                scanned += 1
                self._fifo.append(node)
                continue
            owners = node.owners
            for slot, _ in enumerate(self._worker_at):
                if owners >> slot & 1:
                    self._drop(node, slot, ALL_TIERS)
            node.evict_skips -= 1  # _unlink marked the entry we just popped as stale
            self._stale -= 1
            self.evictions += 1
            return

    # ---- queries -----------------------------------------------------------------------
    def match_tokens(self, tokens: bytes, model_id: str, cache_salt: str = "") -> MatchResult:
        """Longest cached prefix per worker of a prompt given as packed uint32 (`pack_tokens`);
        only the first block is hashed, later blocks are followed by parent hash + tokens."""
        step = self._tok_bytes
        n = len(tokens) // step
        if n == 0:
            return MatchResult(0, [])
        first = compute_block_hash(None, model_id, cache_salt, unpack_tokens(tokens[:step]))
        node = self._by_hash.get(first)
        if node is None or node.key != tokens[:step]:
            return MatchResult(n, [])
        walk = Walk(node.masks, self._readers_of)
        get = self._by_edge.get
        prev = node.masks
        end = n * step
        for start in range(step, end, step):  # the hot loop: mostly pointer chasing along `hot`
            chunk = tokens[start:start + step]
            child = node.hot
            if child is None or not child.key.endswith(chunk):
                child = get(node.hash + chunk)
                if child is None:
                    end = start
                    break
                node.hot = child
            node = child
            if node.masks is not prev:
                prev = node.masks
                if not walk.advance(prev, start // step):
                    end = start
                    break
        return MatchResult(n, walk.result(end // step, self._worker_at))

    def match_hashes(self, block_hashes: list[bytes], tokens: bytes) -> MatchResult:
        """Longest prefix per worker of a chain of caller-computed hashes, verified on tokens."""
        step = self._tok_bytes
        n = len(tokens) // step
        m = min(n, len(block_hashes))
        if m == 0:
            return MatchResult(n, [])
        node = self._by_hash.get(block_hashes[0])
        if node is None or node.key != tokens[:step]:
            return MatchResult(n, [])
        walk = Walk(node.masks, self._readers_of)
        get = self._by_hash.get
        prev = node.masks
        length = m
        for i in range(1, m):
            chunk = tokens[i * step:(i + 1) * step]
            child = node.hot
            if child is None or child.hash != block_hashes[i] or not child.key.endswith(chunk):
                child = get(block_hashes[i])
                if child is None or child.key != node.hash + chunk:
                    length = i
                    break
                node.hot = child
            node = child
            if node.masks is not prev:
                prev = node.masks
                if not walk.advance(prev, i):
                    length = i
                    break
        return MatchResult(n, walk.result(length, self._worker_at))

    # ---- snapshot / restore ------------------------------------------------------------
    def snapshot(self) -> IndexSnapshot:
        records = []
        for node in self._by_hash.values():
            owners = [(k if isinstance(k, str) else k[1], tiers) for k in self._worker_at
                      if k is not None and (tiers := _tiers_of(node, self._slot_of[k]))]
            parent = node.key[:-self._tok_bytes] or None
            records.append(IndexRecord(node.hash, parent, node.key[-self._tok_bytes:], owners))
        return IndexSnapshot(self.block_size, records)

    @classmethod
    def restore(cls, snap: IndexSnapshot, max_blocks: int | None = None) -> "RadixIndex":
        index = cls(snap.block_size, max_blocks)
        for rec in snap.records:
            for worker_id, tiers in rec.owners:
                for tier in (*TIERS, SHARED_TIER):
                    if tiers & TIER_BIT[tier]:
                        index.insert(worker_id, rec.block_hash, rec.parent_hash, rec.tokens, tier)
        return index

    # ---- checks ------------------------------------------------------------------------
    def _shared_slots(self) -> int:
        return sum(1 << s for s, k in enumerate(self._worker_at) if isinstance(k, tuple))

    def check_integrity(self) -> None:
        """Both maps agree, every node is owned, per-worker sets equal the bitmasks."""
        live = sum(1 << s for s, w in enumerate(self._worker_at) if w is not None)
        edges = 0
        counts = [0] * len(self._worker_at)
        for h, node in self._by_hash.items():
            assert node.hash == h, "by_hash maps a hash to another node"
            assert node.owners, f"block {h.hex()} is indexed but nobody holds it"
            assert not node.owners & ~live, f"block {h.hex()} names a freed worker slot"
            assert len(node.key) in (self._tok_bytes, self._tok_bytes + 16), "bad node key length"
            if len(node.key) > self._tok_bytes:
                assert self._by_edge.get(node.key) is node, f"block {h.hex()} missing from by_edge"
                edges += 1
            if node.hot is not None:
                assert node.hot.key[:16] == h and self._by_hash.get(node.hot.hash) is node.hot, \
                    f"block {h.hex()}: its hot child is not a live child"
            g, c, d, s = node.masks
            assert not (g | c | d) & self._shared_slots(), f"block {h.hex()}: a shared tier in a worker's tier"
            assert not s & ~self._shared_slots(), f"block {h.hex()}: a worker in the shared tier's mask"
            for slot in range(len(counts)):
                if node.owners >> slot & 1:
                    counts[slot] += 1
                    assert h in self._blocks_of[slot], f"slot {slot} holds {h.hex()} but its set does not"
        assert edges == len(self._by_edge), f"by_edge has {len(self._by_edge)} entries, {edges} expected"
        for slot, worker in enumerate(self._worker_at):
            assert counts[slot] == len(self._blocks_of[slot]), f"worker {worker}: set and bitmasks differ"
            assert worker is None or self._slot_of[worker] == slot, "slot table inconsistent"
            assert worker is not None or not self._blocks_of[slot], "freed slot still holds blocks"
        assert len(self._slot_of) == sum(w is not None for w in self._worker_at)
        assert all(w in self._slot_of for w in self._readers), "a reader of a shared tier has no slot"
        assert self.max_blocks is None or len(self._by_hash) <= self.max_blocks, "over capacity"
        unlinked = [n for n in self._fifo if self._by_hash.get(n.hash) is not n]
        assert not any(n.key for n in unlinked), "a block that left the index still holds its tokens"
        assert len(unlinked) == self._stale <= len(self._by_hash) + 1024, "eviction queue holds too many stale entries"


def _tiers_of(node: _Node, slot: int) -> int:
    g, c, d, s = node.masks
    return (g >> slot & 1) | (c >> slot & 1) << 1 | (d >> slot & 1) << 2 | (s >> slot & 1) << 3
