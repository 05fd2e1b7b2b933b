"""The KV tiers' operations as int64 records, for rank 0's commands to the followers.

A step's operations travel as one TIERS command (tp_protocol.py): a flat int64 payload of
records, each its kind then its fields, replayed in order before the command that follows:

    OFFLOAD     [1, n, block ids (n), slots (n)]
    DISK_WRITE  [2, source kind, source index, hash (2), has parent, parent (2), n, token ids (n)]
    DISK_FORGET [3, hash (2)]
    DISK_CLEAR  [4]
    SCATTER     [5, load id, n, block ids (n)]
    RELEASE     [6, load id]
    SHARED_WRITE [7, as DISK_WRITE's fields]        (the shared tier's file of the block)
    READ_FILES  [8, load id, n, sources (4 each)]   (a load beside the step: stage its host slots,
                                                     start its file reads on the reader threads)

A block hash (16 bytes) is two int64s. STAGE (sources of one load) is a command of its own,
since every rank votes on how many blocks it staged:

    STAGE payload   per source: [kind, slot or -1, hash (2)]      (a hash for file kinds only)

READ_FILES needs no vote when it starts: the vote on what every rank read is the TIER_LAND
command, at a later schedule (tp_file_reads.py).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import msgspec
import torch

from gpu_worker.kv_tiers.disk_tier import DiskBlock
from gpu_worker.kv_tiers.mirror import FILE_KINDS, BlockSource
from gpu_worker.kv_transfer.layout import KVLayout

OFFLOAD, DISK_WRITE, DISK_FORGET, DISK_CLEAR, SCATTER, RELEASE, SHARED_WRITE, READ_FILES = 1, 2, 3, 4, 5, 6, 7, 8
HASH_BYTES = 16
_NO_HASH = [0, 0]


def hash_ints(block_hash: bytes) -> list[int]:
    if len(block_hash) != HASH_BYTES:
        raise ValueError(f"a block hash is {HASH_BYTES} bytes, got {len(block_hash)}")
    return [int.from_bytes(block_hash[:8], "little", signed=True), int.from_bytes(block_hash[8:], "little", signed=True)]


def ints_hash(lo: int, hi: int) -> bytes:
    return lo.to_bytes(8, "little", signed=True) + hi.to_bytes(8, "little", signed=True)


# ---- rank 0: encode ------------------------------------------------------------------------
def offload(block_ids: list[int], slots: list[int]) -> list[int]:
    return [OFFLOAD, len(block_ids), *block_ids, *slots]


def disk_write(source: BlockSource, block_hash: bytes, block: DiskBlock, kind: int = DISK_WRITE) -> list[int]:
    parent = [1, *hash_ints(block.parent)] if block.parent is not None else [0, *_NO_HASH]
    return [kind, source.kind, source.index, *hash_ints(block_hash), *parent,
            len(block.token_ids), *block.token_ids]


def shared_write(source: BlockSource, block_hash: bytes, block: DiskBlock) -> list[int]:
    return disk_write(source, block_hash, block, SHARED_WRITE)


def disk_forget(block_hash: bytes) -> list[int]:
    return [DISK_FORGET, *hash_ints(block_hash)]


def disk_clear() -> list[int]:
    return [DISK_CLEAR]


def scatter(load_id: int, block_ids: list[int]) -> list[int]:
    return [SCATTER, load_id, len(block_ids), *block_ids]


def release(load_id: int) -> list[int]:
    return [RELEASE, load_id]


def read_files(load_id: int, sources: list[BlockSource]) -> list[int]:
    return [READ_FILES, load_id, len(sources), *_source_ints(sources)]


def _source_ints(sources: list[BlockSource]) -> list[int]:
    return [x for s in sources
            for x in (s.kind, s.index, *(hash_ints(s.block_hash) if s.kind in FILE_KINDS else _NO_HASH))]


def stage_sources(sources: list[BlockSource]) -> torch.Tensor:
    return torch.tensor(_source_ints(sources), dtype=torch.int64)


# ---- followers: decode ---------------------------------------------------------------------
class Record(NamedTuple):
    kind: int
    ids: list[int]                       # OFFLOAD / SCATTER: block ids
    slots: list[int]                     # OFFLOAD: host slots
    load_id: int                         # SCATTER / RELEASE
    source: BlockSource | None           # DISK_WRITE / SHARED_WRITE
    block_hash: bytes | None             # DISK_WRITE / SHARED_WRITE / DISK_FORGET
    block: DiskBlock | None              # DISK_WRITE / SHARED_WRITE
    sources: list[BlockSource] | None = None     # READ_FILES


def decode(payload: list[int]) -> Iterator[Record]:
    i = 0
    while i < len(payload):
        kind = payload[i]
        if kind == OFFLOAD:
            n = payload[i + 1]
            yield Record(kind, payload[i + 2:i + 2 + n], payload[i + 2 + n:i + 2 + 2 * n], -1, None, None, None)
            i += 2 + 2 * n
        elif kind in (DISK_WRITE, SHARED_WRITE):
            src_kind, src_index, h0, h1, has_parent, p0, p1, n = payload[i + 1:i + 9]
            parent = ints_hash(p0, p1) if has_parent else None
            block = DiskBlock(parent, tuple(payload[i + 9:i + 9 + n]))
            yield Record(kind, [], [], -1, BlockSource(src_kind, src_index), ints_hash(h0, h1), block)
            i += 9 + n
        elif kind == DISK_FORGET:
            yield Record(kind, [], [], -1, None, ints_hash(payload[i + 1], payload[i + 2]), None)
            i += 3
        elif kind == DISK_CLEAR:
            yield Record(kind, [], [], -1, None, None, None)
            i += 1
        elif kind == SCATTER:
            n = payload[i + 2]
            yield Record(kind, payload[i + 3:i + 3 + n], [], payload[i + 1], None, None, None)
            i += 3 + n
        elif kind == RELEASE:
            yield Record(kind, [], [], payload[i + 1], None, None, None)
            i += 2
        elif kind == READ_FILES:
            n = payload[i + 2]
            sources = _decode_sources(payload[i + 3:i + 3 + 4 * n])
            yield Record(kind, [], [], payload[i + 1], None, None, None, sources)
            i += 3 + 4 * n
        else:
            raise RuntimeError(f"unknown KV tier record {kind}")


def decode_sources(payload: torch.Tensor) -> list[BlockSource]:
    return _decode_sources(payload.tolist())


def _decode_sources(ints: list[int]) -> list[BlockSource]:
    return [BlockSource(kind, index, ints_hash(h0, h1) if kind in FILE_KINDS else None)
            for kind, index, h0, h1 in zip(ints[0::4], ints[1::4], ints[2::4], ints[3::4])]


class TierInit(msgspec.Struct, frozen=True, tag="tier_init"):
    """What a follower needs to build its tiers: rank 0's sizes, so slots and files line up.
    The shared tier's key is not a field (a struct's repr shows every field): it follows this
    in the TIER_INIT payload (tp_tiers.py)."""
    version: int
    host_slots: int
    disk_dir: str | None                 # the disk tier's directory (each rank: a subdirectory)
    disk_max_blocks: int
    block_bytes: int                     # one block's bytes on one rank
    layout: KVLayout
    shared_dir: str | None = None        # the shared tier's root (each rank: a subdirectory of its own)
    shared_max_bytes: int = 0            # each rank's bound: its share of kv_offload_shared_gb

    def encode(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(msgspec.json.encode(self)), dtype=torch.uint8).to(torch.int64)

    @staticmethod
    def decode(payload: torch.Tensor) -> "TierInit":
        return msgspec.json.decode(bytes(payload.to(torch.uint8).tolist()), type=TierInit)


TIER_INIT_VERSION = 2
