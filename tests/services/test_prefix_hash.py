"""The block hash is part of the wire contract (KV events, Redis): pin its bytes."""
import pytest

from services.prefix_hash import block_hash, chain_hashes


def test_digest_is_pinned_across_processes():
    first = block_hash(None, "m", "", [1, 2, 3, 4])
    assert first.hex() == "71fe2f6f35594126a80d60060c5742dc"
    assert block_hash(first, "m", "t", [5, 6, 7, 8]).hex() == "c3283f7b203d908680f8781da8ea0e34"


def test_every_input_changes_the_digest():
    base = block_hash(None, "m", "", [1, 2, 3, 4])
    assert len(base) == 16
    assert block_hash(None, "m2", "", [1, 2, 3, 4]) != base
    assert block_hash(None, "m", "tenant", [1, 2, 3, 4]) != base
    assert block_hash(None, "m", "", [1, 2, 3, 5]) != base
    assert block_hash(b"\0" * 16, "m", "", [1, 2, 3, 4]) != base
    # packing is unambiguous: moving bytes between model_id and salt changes the digest
    assert block_hash(None, "ab", "c", [1]) != block_hash(None, "a", "bc", [1])


def test_chain_covers_full_blocks_only():
    hashes = chain_hashes(None, "m", "", list(range(10)), 4)
    assert len(hashes) == 2
    assert hashes[0] == block_hash(None, "m", "", [0, 1, 2, 3])
    assert hashes[1] == block_hash(hashes[0], "m", "", [4, 5, 6, 7])


def test_bad_parent_rejected():
    with pytest.raises(ValueError, match="parent"):
        block_hash(b"short", "m", "", [1])
