"""KV events and prefix-cache queries: workers -> prefix_cache_svc (ZMQ) and scheduler -> prefix_cache_svc (gRPC).

One schema for both carriers: frozen msgspec Structs encoded as msgpack, each with a
tag and a `version`. The full protocol (ordering, gaps, epochs, snapshots, Redis keys) is in
docs/kv_events.md; the rules in one paragraph:

    worker W, incarnation `epoch`:   batch seq=0, 1, 2, ...   (one KVEventBatch per engine step
                                                               that changed the cache; an idle
                                                               worker repeats its last seq with
                                                               no events as a heartbeat)
    index: seq == last+1 -> apply;  seq <= last -> duplicate, drop;  seq > last+1 -> gap;
           epoch > known -> W restarted: forget W, then seq 0 applies, anything else is a gap;
           epoch < known -> stale, drop;  gap -> SnapshotRequest, the Snapshot replaces W's blocks.

Block identity is the engine's chained content hash `H(parent, model_id, cache_salt, tokens)`
(services/prefix_hash.py); this module never computes it.
"""
from __future__ import annotations

import sys
from array import array
from typing import Literal, Union

import msgspec

KV_EVENTS_VERSION = 1
PREFIX_GRPC_SERVICE = "kvmesh.PrefixCache"  # gRPC service of prefix_cache_svc; method "Match"

Tier = Literal["gpu", "cpu", "disk", "shared"]
TIERS: tuple[str, ...] = ("gpu", "cpu", "disk")  # a worker's own tiers, fastest first
# The node's shared KV tier (kv_offload_shared_dir): its blocks belong to the directory, not to the
# worker whose batch reports them. The index files them under the shared-tier id the worker
# announces (registry info SHARED_TIER_INFO) and credits them to every live worker announcing it.
SHARED_TIER = "shared"
SHARED_TIER_INFO = "kv_shared_tier"
_SHARED_TIER_ID_CHARS = frozenset("0123456789abcdef")


def shared_tier_id(value) -> str | None:
    """A registry record's shared-tier id (32 lowercase hex digits), or None when absent or malformed."""
    if isinstance(value, str) and len(value) == 32 and _SHARED_TIER_ID_CHARS.issuperset(value):
        return value
    return None


class BlockStored(msgspec.Struct, tag="stored", frozen=True, array_like=True, gc=False):
    """A full block became reusable on the worker, in `tier`."""

    block_hash: bytes
    parent_hash: bytes | None  # None: the first block of a sequence
    token_ids: list[int]  # exactly block_size ids: the index verifies matches on them
    tier: Tier = "gpu"


class BlockRemoved(msgspec.Struct, tag="removed", frozen=True, array_like=True, gc=False):
    """The worker no longer holds the block in `tier` (evicted, or moved: a Stored in the new tier follows).

    `missing`: not a removal the worker made but a lookup that found no file (tier "shared" only:
    a credit the index may hold from a removal lost in a gap); the index drops the block only if
    it credits it there, and tells Redis only then. A trailing field of an array-like struct: an
    older reader ignores it (and treats the event as a removal), a newer one reads an older
    sender's events as `missing=False`, so the version stays.
    """

    block_hash: bytes
    tier: Tier = "gpu"
    missing: bool = False


class AllCleared(msgspec.Struct, tag="cleared", frozen=True, array_like=True, gc=False):
    """The worker dropped every block of `tier` (all tiers when None), e.g. a cache reset."""

    tier: Tier | None = None


KVEvent = Union[BlockStored, BlockRemoved, AllCleared]


class KVEventBatch(msgspec.Struct, tag="kv_batch", frozen=True, kw_only=True, gc=False):
    """Every cache change of one engine step, in order. Empty `events`: heartbeat (seq not advanced)."""

    worker_id: str
    epoch: int  # changes every time the worker (its engine) starts; a fencing token
    seq: int  # 0, 1, 2, ... within an epoch; one per non-empty batch
    ts: float  # wall-clock seconds when the batch was flushed
    events: list[KVEvent] = []
    version: int = KV_EVENTS_VERSION


class SnapshotRequest(msgspec.Struct, tag="snapshot_req", frozen=True, kw_only=True):
    """Ask a worker for every block it holds (sent by the index on a gap or a new epoch)."""

    request_id: str
    version: int = KV_EVENTS_VERSION


class SnapshotBlock(msgspec.Struct, frozen=True, array_like=True, gc=False):
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: list[int]
    tier: Tier = "gpu"


class Snapshot(msgspec.Struct, tag="snapshot", frozen=True, kw_only=True, gc=False):
    """The worker's whole cache after batch `seq` of `epoch` (taken between engine steps).

    The index replaces the worker's blocks with `blocks`, then applies batches with seq > `seq`.
    `error` is set (and `blocks` empty) when the worker could not answer, e.g. an unknown version.
    """

    request_id: str
    worker_id: str
    epoch: int
    seq: int  # last batch seq reflected; -1 when nothing was published yet in this epoch
    block_size: int
    blocks: list[SnapshotBlock] = []
    error: str = ""
    version: int = KV_EVENTS_VERSION


# ---------------------------------------------------------------- prefix queries (gRPC Match)

class MatchRequest(msgspec.Struct, tag="match_req", frozen=True, kw_only=True):
    """Which workers hold the longest prefix of these tokens for this model and tenant?

    `tokens` is the prompt as packed little-endian uint32 (`pack_token_ids`): a 32k-token prompt
    decodes in microseconds, where a msgpack list of ints costs over a millisecond of the index's
    single thread. The salt is `cache_salt_for(tenant_salt, cache_salt)`, the same string the
    engine hashes with. `block_hashes` (optional) are the caller's chained hashes of the full
    blocks; without them the index hashes the first block itself and follows the rest by tokens.
    Either way a match is verified on tokens, never on hashes alone.
    """

    model_id: str
    tokens: bytes
    tenant_salt: str = ""
    cache_salt: str = ""
    block_hashes: list[bytes] | None = None
    version: int = KV_EVENTS_VERSION


class WorkerMatch(msgspec.Struct, frozen=True, array_like=True):
    """Longest matched prefix on one worker, in blocks, by the tiers that hold it.

    gpu_blocks <= gpu_cpu_blocks <= matched_blocks: the prefix held on GPU alone, on GPU or CPU,
    and on any of the worker's own tiers. `shared_blocks`: the prefix held on the worker's own
    tiers or in the shared tier it reads (0 when that adds nothing to matched_blocks).
    """

    worker_id: str
    matched_blocks: int
    gpu_blocks: int
    gpu_cpu_blocks: int
    shared_blocks: int = 0

    @property
    def any_blocks(self) -> int:
        """The prefix the worker can load from anywhere: its own tiers or its shared tier."""
        return max(self.matched_blocks, self.shared_blocks)


class MatchResponse(msgspec.Struct, tag="match_resp", frozen=True, kw_only=True):
    """Workers with a non-empty match, best first. `query_blocks`: full blocks in the prompt."""

    block_size: int
    query_blocks: int
    workers: list[WorkerMatch] = []
    available: bool = True  # False: the index was unreachable (client fails open to "no match")
    version: int = KV_EVENTS_VERSION

    @property
    def best_blocks(self) -> int:
        return max((w.any_blocks for w in self.workers), default=0)

    def blocks_for(self, worker_id: str) -> WorkerMatch | None:
        for w in self.workers:
            if w.worker_id == worker_id:
                return w
        return None


def pack_token_ids(token_ids) -> bytes:
    """Token ids as packed little-endian uint32 (ids must be below 2**32)."""
    arr = array("I", token_ids)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def unpack_token_ids(tokens: bytes) -> list[int]:
    arr = array("I")
    arr.frombytes(tokens)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tolist()


def cache_salt_for(tenant_salt: str, cache_salt: str) -> str:
    """The salt the engine hashes with: a tenant's (per API key) salt and the request's cache_salt.

    Length-prefixed so that no two (tenant, request) pairs collide; "" when both are empty, so
    tenants that share cache (no salt) keep the engine's unsalted hashes.
    """
    if not tenant_salt and not cache_salt:
        return ""
    return f"{len(tenant_salt)}:{tenant_salt}{cache_salt}"


def split_salt(salt: str) -> tuple[str, str]:
    """cache_salt_for inverted: (tenant salt, request salt) of "N:<tenant N chars><request salt>";
    a salt not of that form is all the request's."""
    head, sep, rest = salt.partition(":")
    if not sep or not head.isdigit() or int(head) > len(rest):
        return "", salt
    n = int(head)
    return rest[:n], rest[n:]


# Decoders for each channel: a receiver validates with these and drops malformed frames.
KV_EVENT_BATCH_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
SNAPSHOT_REQUEST_DECODER = msgspec.msgpack.Decoder(SnapshotRequest)
SNAPSHOT_DECODER = msgspec.msgpack.Decoder(Snapshot)
MATCH_REQUEST_DECODER = msgspec.msgpack.Decoder(MatchRequest)
MATCH_RESPONSE_DECODER = msgspec.msgpack.Decoder(MatchResponse)
ENCODER = msgspec.msgpack.Encoder()

__all__ = [
    "KV_EVENTS_VERSION", "PREFIX_GRPC_SERVICE", "TIERS", "SHARED_TIER", "SHARED_TIER_INFO", "shared_tier_id", "Tier",
    "BlockStored", "BlockRemoved", "AllCleared", "KVEvent",
    "KVEventBatch", "SnapshotRequest", "SnapshotBlock", "Snapshot", "MatchRequest", "WorkerMatch",
    "MatchResponse", "cache_salt_for", "pack_token_ids", "unpack_token_ids", "ENCODER", "KV_EVENT_BATCH_DECODER",
    "SNAPSHOT_REQUEST_DECODER", "SNAPSHOT_DECODER", "MATCH_REQUEST_DECODER", "MATCH_RESPONSE_DECODER",
]
