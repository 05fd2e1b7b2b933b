"""Deterministic, chained content hash of a full KV block (docs/kv_events.md, "Block identity").

    H(parent, model_id, cache_salt, tokens) = blake2b(digest_size=16) over

    b"kvmesh-block-v1"                         domain tag (bump the version to change the format)
    u8  has_parent | parent (16 bytes, or nothing when has_parent == 0)
    u32 len(model_id utf-8) | model_id utf-8
    u32 len(cache_salt utf-8) | cache_salt utf-8
    u32 len(tokens) | tokens as u32 each        all integers little-endian

Every process and every restart computes the same digest (never Python's `hash()`), and two
tenants (different cache_salt) never share a block unless they share the salt.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DIGEST_SIZE = 16
_TAG = b"kvmesh-block-v1"


def _packed_str(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<I", len(data)) + data


def block_hash(parent: bytes | None, model_id: str, cache_salt: str, tokens: Sequence[int]) -> bytes:
    """16-byte digest of one full block chained from its parent block's digest (None for the first).
    Raises ValueError for a token id outside [0, 2**32)."""
    if parent is not None and len(parent) != DIGEST_SIZE:
        raise ValueError(f"parent hash must be {DIGEST_SIZE} bytes, got {len(parent)}")
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    h.update(_TAG)
    h.update(b"\x01" + parent if parent is not None else b"\x00")
    h.update(_packed_str(model_id))
    h.update(_packed_str(cache_salt))
    try:
        h.update(struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens))
    except struct.error:    # an id no vocabulary has (a peer's message): a ValueError callers handle
        raise ValueError("token ids must be integers in [0, 2**32)") from None
    return h.digest()


def chain_hashes(parent: bytes | None, model_id: str, cache_salt: str,
                 tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Digests of every full block of `tokens` (a trailing partial block gets none), chained from `parent`."""
    out: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, model_id, cache_salt, tokens[start:start + block_size])
        out.append(parent)
    return out
