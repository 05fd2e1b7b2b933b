"""The on-disk format of one offloaded KV block, and its checks.

    u32 little-endian  header length H (at most max_header_bytes(block_size))
    H bytes            TierFileHeader, msgpack (msgspec; never pickle): the block's hash, its
                       parent's hash and token ids (what a restarted worker announces), layout
                       and payload checksum
    payload            the block's K and V: (num_layers, 2, block_size, num_kv_heads, head_dim)
                       in the layout's kv_dtype, C order

A file is accepted only when the magic and version match, the header names the block hash the
reader asked for and the reader's exact KV layout (the weights' digest included), holds one
block's token ids, the payload is exactly `payload_len` bytes, and its xxh3-64 equals `checksum`.
`decode_header` makes the checks that need no payload (a start-up scan reads only headers; the
checksum is checked at the read). Anything else (a torn write, a flipped byte, a file of another
model, engine or weights) is a TierFileError (ForeignLayout for a sound file of another layout or
format version): the caller drops the file and recomputes the block.
"""
from __future__ import annotations

import struct

import msgspec
import xxhash

from gpu_worker.kv_transfer.layout import KVLayout

MAGIC = "kvmesh-kv-block"
VERSION = 3     # 3: the layout carries the weights' digest (2's files, of unknown weights, are dropped)
_LEN = struct.Struct("<I")
LEN_BYTES = _LEN.size


def max_header_bytes(block_size: int) -> int:
    """The largest header of a block of `block_size` tokens: hashes and layout in 1 KiB, then at
    most 9 msgpack bytes per token id."""
    return 1024 + 9 * block_size


def file_overhead(block_size: int) -> int:
    """A file's bytes beyond its payload, at most."""
    return LEN_BYTES + max_header_bytes(block_size)


class TierFileHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    magic: str
    version: int
    block_hash: bytes
    layout: KVLayout
    payload_len: int
    checksum: int           # xxh3-64 of the payload
    parent: bytes | None = None
    token_ids: list[int] = []


class TierFileError(ValueError):
    """The file is not a valid copy of the requested block for this engine's layout."""


class ForeignLayout(TierFileError):
    """A sound file of another engine's KV layout or weights, or of another version of this format
    (not damage: a start-up scan counts these in one line)."""

    def __init__(self, layout: KVLayout, version: int) -> None:
        super().__init__(f"foreign KV layout {layout}" if version == VERSION else f"a version-{version} file")
        self.layout, self.version = layout, version


_decoder = msgspec.msgpack.Decoder(TierFileHeader)


def encode(block_hash: bytes, layout: KVLayout, payload: bytes | memoryview, parent: bytes | None = None,
           token_ids: tuple[int, ...] | list[int] = ()) -> list[bytes | memoryview]:
    """The file's contents as parts to write in order (the payload is not copied)."""
    header = msgspec.msgpack.encode(TierFileHeader(MAGIC, VERSION, block_hash, layout, len(payload),
                                                   xxhash.xxh3_64_intdigest(payload), parent, list(token_ids)))
    return [_LEN.pack(len(header)), header, payload]


def header_length(prefix: bytes | memoryview, layout: KVLayout) -> int:
    """The header length a file's first LEN_BYTES bytes announce; raises TierFileError."""
    if len(prefix) < LEN_BYTES:
        raise TierFileError("truncated before the header length")
    (header_len,) = _LEN.unpack_from(prefix)
    if header_len > max_header_bytes(layout.block_size):
        raise TierFileError(f"bad header length {header_len}")
    return header_len


def decode_header(raw: bytes | memoryview, block_hash: bytes, layout: KVLayout, payload_len: int) -> TierFileHeader:
    """The checks of a header's bytes `raw` that need no payload; raises TierFileError."""
    try:
        header = _decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise TierFileError(f"unreadable header: {e}") from None
    if header.magic != MAGIC:
        raise TierFileError("not a kvmesh block file")
    if header.block_hash != block_hash:
        raise TierFileError("the file holds another block")
    if header.layout != layout or header.version != VERSION:
        raise ForeignLayout(header.layout, header.version)
    if header.payload_len != payload_len:
        raise TierFileError(f"payload of {header.payload_len} bytes, expected {payload_len}")
    if len(header.token_ids) != layout.block_size or header.parent == block_hash:
        raise TierFileError("not one block's token ids")
    return header


def decode(data: bytes | memoryview, block_hash: bytes, layout: KVLayout, payload_len: int) -> memoryview:
    """The payload of a file's contents `data`, after every check; raises TierFileError."""
    view = memoryview(data)
    header_len = header_length(view, layout)
    if LEN_BYTES + header_len > len(view):
        raise TierFileError(f"bad header length {header_len}")
    header = decode_header(view[LEN_BYTES:LEN_BYTES + header_len], block_hash, layout, payload_len)
    payload = view[LEN_BYTES + header_len:]
    if len(payload) != payload_len:
        raise TierFileError(f"payload of {len(payload)} bytes, expected {payload_len}")
    if xxhash.xxh3_64_intdigest(payload) != header.checksum:
        raise TierFileError("checksum mismatch")
    return payload
