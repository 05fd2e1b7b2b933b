"""The on-disk format of one offloaded KV block, and its checks.

    u32 little-endian  header length H (at most MAX_HEADER_BYTES)
    H bytes            TierFileHeader, msgpack (msgspec; never pickle)
    payload            the block's K and V: (num_layers, 2, block_size, num_kv_heads, head_dim)
                       in the layout's kv_dtype, C order

A file is accepted only when the magic and version match, the header names the block hash the
reader asked for and the reader's exact KV layout, the payload is exactly `payload_len` bytes,
and its xxh3-64 equals `checksum`. Anything else (a torn write, a flipped byte, a file of
another model or engine) is a TierFileError: the caller drops the file and recomputes the block.
"""
from __future__ import annotations

import struct

import msgspec
import xxhash

from gpu_worker.kv_transfer.layout import KVLayout

MAGIC = "kvmesh-kv-block"
VERSION = 1
MAX_HEADER_BYTES = 4096
_LEN = struct.Struct("<I")


class TierFileHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    magic: str
    version: int
    block_hash: bytes
    layout: KVLayout
    payload_len: int
    checksum: int           # xxh3-64 of the payload


class TierFileError(ValueError):
    """The file is not a valid copy of the requested block for this engine's layout."""


_decoder = msgspec.msgpack.Decoder(TierFileHeader)


def encode(block_hash: bytes, layout: KVLayout, payload: bytes | memoryview) -> list[bytes | memoryview]:
    """The file's contents as parts to write in order (the payload is not copied)."""
    header = msgspec.msgpack.encode(TierFileHeader(MAGIC, VERSION, block_hash, layout, len(payload),
                                                   xxhash.xxh3_64_intdigest(payload)))
    return [_LEN.pack(len(header)), header, payload]


def decode(data: bytes | memoryview, block_hash: bytes, layout: KVLayout, payload_len: int) -> memoryview:
    """The payload of a file's contents `data`, after every check; raises TierFileError."""
    view = memoryview(data)
    if len(view) < _LEN.size:
        raise TierFileError("truncated before the header length")
    (header_len,) = _LEN.unpack_from(view)
    if header_len > MAX_HEADER_BYTES or _LEN.size + header_len > len(view):
        raise TierFileError(f"bad header length {header_len}")
    try:
        header = _decoder.decode(view[_LEN.size:_LEN.size + header_len])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise TierFileError(f"unreadable header: {e}") from None
    if header.magic != MAGIC or header.version != VERSION:
        raise TierFileError(f"not a version-{VERSION} kvmesh block file")
    if header.block_hash != block_hash:
        raise TierFileError("the file holds another block")
    if header.layout != layout:
        raise TierFileError(f"foreign KV layout {header.layout}")
    payload = view[_LEN.size + header_len:]
    if header.payload_len != payload_len or len(payload) != payload_len:
        raise TierFileError(f"payload of {len(payload)} bytes, expected {payload_len}")
    if xxhash.xxh3_64_intdigest(payload) != header.checksum:
        raise TierFileError("checksum mismatch")
    return payload
