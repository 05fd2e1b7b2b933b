"""RadixIndex: insert, match (by tokens and by hashes, verified on tokens), remove, remove_worker,
clear, eviction, snapshot/restore; every test ends with check_integrity()."""
from __future__ import annotations

import random

import pytest

from prefix_cache_svc.hashing import block_hash
from prefix_cache_svc.radix_index import RadixIndex, pack_tokens
from services.protocol.kv_events import cache_salt_for

BS = 4
MODEL = "m"


def chain(tokens: list[int], salt: str = "", model: str = MODEL) -> list[tuple[bytes, bytes | None, list[int]]]:
    """(hash, parent, block tokens) of every full block, as the engine computes them."""
    out, parent = [], None
    for i in range(0, len(tokens) - BS + 1, BS):
        h = block_hash(parent, model, salt, tokens[i:i + BS])
        out.append((h, parent, tokens[i:i + BS]))
        parent = h
    return out


def store(index: RadixIndex, worker: str, blocks, tier: str = "gpu") -> None:
    for h, parent, toks in blocks:
        index.insert(worker, h, parent, toks, tier)


def match(index: RadixIndex, tokens: list[int], salt: str = "") -> dict[str, tuple[int, int, int]]:
    res = index.match_tokens(pack_tokens(tokens), MODEL, salt)
    by_hashes = index.match_hashes([h for h, _, _ in chain(tokens, salt)], pack_tokens(tokens))
    assert by_hashes == res, "walking by hashes and by tokens must agree"
    return {m.worker_id: (m.matched_blocks, m.gpu_blocks, m.gpu_cpu_blocks) for m in res.workers}


PROMPT = list(range(100, 120))  # 5 full blocks


def test_insert_and_match_longest_prefix_per_worker():
    index = RadixIndex(BS)
    blocks = chain(PROMPT)
    store(index, "a", blocks)          # all 5
    store(index, "b", blocks[:2])      # first 2
    assert match(index, PROMPT + [1, 2]) == {"a": (5, 5, 5), "b": (2, 2, 2)}
    assert index.match_tokens(pack_tokens(PROMPT + [1, 2]), MODEL).query_blocks == 5
    assert match(index, PROMPT[:8] + [0] * 8) == {"a": (2, 2, 2), "b": (2, 2, 2)}
    assert match(index, [7] * 20) == {}
    assert match(index, PROMPT[:3]) == {}  # no full block
    index.check_integrity()


def test_worker_without_parent_block_does_not_match_its_children():
    index = RadixIndex(BS)
    blocks = chain(PROMPT)
    store(index, "a", blocks[:1])
    store(index, "b", blocks[1:])      # holds children but not the first block
    assert match(index, PROMPT) == {"a": (1, 1, 1)}
    index.check_integrity()


def test_tiers_report_gpu_and_gpu_or_cpu_prefixes():
    index = RadixIndex(BS)
    blocks = chain(PROMPT)
    store(index, "a", blocks[:2], "gpu")
    store(index, "a", blocks[2:4], "cpu")
    store(index, "a", blocks[4:], "disk")
    store(index, "b", blocks[:1], "cpu")
    assert match(index, PROMPT) == {"a": (5, 2, 4), "b": (1, 0, 1)}
    index.insert("a", blocks[2][0], blocks[2][1], blocks[2][2], "gpu")  # also on GPU now
    assert match(index, PROMPT)["a"] == (5, 3, 4)
    assert index.blocks_of("a")[blocks[2][0]] == 0b011
    index.check_integrity()


def test_salt_and_model_separate_tenants():
    index = RadixIndex(BS)
    salt = cache_salt_for("tenant-1", "")
    store(index, "a", chain(PROMPT, salt))
    assert match(index, PROMPT, salt) == {"a": (5, 5, 5)}
    assert match(index, PROMPT, "") == {}
    assert match(index, PROMPT, cache_salt_for("tenant-2", "")) == {}
    assert index.match_tokens(pack_tokens(PROMPT), "other-model", salt).workers == []
    index.check_integrity()


def test_match_is_verified_on_tokens_not_hashes_alone():
    index = RadixIndex(BS)
    blocks = chain(PROMPT)
    store(index, "a", blocks)
    hashes = [h for h, _, _ in blocks]
    forged = PROMPT[:8] + [9, 9, 9, 9] + PROMPT[12:]
    res = index.match_hashes(hashes, pack_tokens(forged))
    assert [(m.worker_id, m.matched_blocks) for m in res.workers] == [("a", 2)]
    # a same-hash insert with other tokens is refused and changes nothing
    assert not index.insert("b", blocks[0][0], None, [0, 0, 0, 0])
    assert index.rejected == 1 and match(index, PROMPT) == {"a": (5, 5, 5)}
    assert not index.insert("b", b"x" * 16, None, [1, 2, 3])  # wrong block size
    # another hash for the same parent + tokens (a buggy worker): refused, never corrupts the maps
    assert not index.insert("b", b"y" * 16, blocks[0][0], blocks[1][2])
    assert index.rejected == 3
    index.check_integrity()


def test_remove_one_copy_then_the_last():
    index = RadixIndex(BS)
    blocks = chain(PROMPT)
    store(index, "a", blocks)
    store(index, "b", blocks)
    assert index.remove("a", blocks[2][0])
    assert not index.remove("a", blocks[2][0])
    assert match(index, PROMPT) == {"b": (5, 5, 5), "a": (2, 2, 2)}
    assert index.remove("b", blocks[2][0])
    assert blocks[2][0] not in index and len(index) == 4
    assert match(index, PROMPT) == {"a": (2, 2, 2), "b": (2, 2, 2)}
    store(index, "a", blocks[2:3])   # re-stored: children reachable again
    assert match(index, PROMPT) == {"a": (5, 5, 5), "b": (2, 2, 2)}
    index.check_integrity()


def test_remove_worker_and_clear_tier():
    index = RadixIndex(BS)
    blocks = chain(PROMPT)
    store(index, "a", blocks)
    store(index, "b", blocks[:3])
    store(index, "b", blocks[3:], "cpu")
    assert index.clear("b", "cpu") == 2
    assert match(index, PROMPT)["b"] == (3, 3, 3)
    assert index.remove_worker("a") == 5
    assert index.workers() == ["b"] and len(index) == 3
    assert index.remove_worker("a") == 0
    store(index, "c", blocks)        # reuses a's freed slot
    assert match(index, PROMPT) == {"c": (5, 5, 5), "b": (3, 3, 3)}
    index.check_integrity()


def test_capacity_evicts_leaves_first():
    index = RadixIndex(BS, max_blocks=6)
    first = chain(PROMPT)
    second = chain(list(range(500, 516)))
    store(index, "a", first)         # 5 blocks
    store(index, "a", second)        # +4: three evictions
    assert len(index) == 6 and index.evictions == 3
    assert first[0][0] in index, "the oldest root must outlive its children"
    index.check_integrity()


def test_token_ids_leave_with_their_blocks():
    """Users' token ids live in the index only while a worker holds the block: after removal no
    node anywhere (the eviction queue included) keeps them, and churn does not grow the queue."""
    for max_blocks in (None, 10_000):
        index = RadixIndex(BS, max_blocks=max_blocks)
        for round_ in range(600):                    # 3,000 blocks stored and removed
            prompt = [round_ * 1000 + t for t in range(20)]
            blocks = chain(prompt)
            store(index, "a", blocks)
            for h, _, _ in reversed(blocks):
                assert index.remove("a", h)
        assert len(index) == 0
        packed = [pack_tokens([round_ * 1000 + t for t in range(i, i + BS)]) for i in range(0, 20, BS)]
        assert not any(p in node.key for node in index._fifo for p in packed)
        assert len(index._fifo) <= 1024 + 1
        index.check_integrity()


def test_snapshot_restore_round_trip():
    import msgspec

    index = RadixIndex(BS)
    blocks = chain(PROMPT)
    store(index, "a", blocks)
    store(index, "b", blocks[:2], "cpu")
    wire = msgspec.msgpack.encode(index.snapshot())
    from prefix_cache_svc.radix_index import IndexSnapshot
    again = RadixIndex.restore(msgspec.msgpack.decode(wire, type=IndexSnapshot))
    assert match(again, PROMPT) == match(index, PROMPT) == {"a": (5, 5, 5), "b": (2, 0, 2)}
    assert again.blocks_of("b") == index.blocks_of("b")
    again.check_integrity()


def test_random_operations_against_a_naive_model():
    """Thousands of random inserts/removes on 6 workers; matches equal a brute-force recount."""
    rng = random.Random(7)
    index = RadixIndex(BS)
    prompts = [[rng.randrange(50) for _ in range(BS * 6)] for _ in range(8)]
    for p in prompts[4:]:
        p[:BS * 2] = prompts[0][:BS * 2]       # shared prefixes
    chains = [chain(p) for p in prompts]
    held: dict[str, dict[bytes, set[str]]] = {}
    for _ in range(3000):
        w = f"w{rng.randrange(6)}"
        h, parent, toks = rng.choice(rng.choice(chains))
        tier = rng.choice(["gpu", "cpu", "disk"])
        if rng.random() < 0.6:
            index.insert(w, h, parent, toks, tier)
            held.setdefault(w, {}).setdefault(h, set()).add(tier)
        else:
            index.remove(w, h, tier)
            held.get(w, {}).get(h, set()).discard(tier)
        if rng.random() < 0.01:
            index.remove_worker(w)
            held.pop(w, None)
        if rng.random() < 0.02:   # walks move `hot` links: keep checking while they do
            match(index, rng.choice(prompts))
            index.check_integrity()
    for p, ch in zip(prompts, chains):
        expect = {}
        for w, blocks in held.items():
            def run(tiers):
                n = 0
                for h, _, _ in ch:
                    if not blocks.get(h, set()) & tiers:
                        break
                    n += 1
                return n
            total = run({"gpu", "cpu", "disk"})
            if total:
                expect[w] = (total, run({"gpu"}), run({"gpu", "cpu"}))
        assert match(index, p) == expect
    index.check_integrity()


def test_branching_chains_follow_the_right_child():
    """`hot` points at one child; a walk down a sibling falls back to the edge map and repoints it."""
    index = RadixIndex(BS)
    left = PROMPT[:8] + [1, 1, 1, 1, 2, 2, 2, 2]
    right = PROMPT[:8] + [3, 3, 3, 3]
    store(index, "a", chain(left))
    store(index, "b", chain(right))                 # newest child of block 1: right
    for _ in range(2):
        assert match(index, left) == {"a": (4, 4, 4), "b": (2, 2, 2)}
        assert match(index, right) == {"b": (3, 3, 3), "a": (2, 2, 2)}
    index.remove("b", chain(right)[2][0])           # the hot child leaves: the link is cleared
    assert match(index, right) == {"a": (2, 2, 2), "b": (2, 2, 2)}
    assert match(index, left) == {"a": (4, 4, 4), "b": (2, 2, 2)}
    assert not index.insert("a", b"h" * 16, b"h" * 16, [1, 2, 3, 4])   # its own parent: refused
    index.check_integrity()


def test_integrity_check_catches_corruption():
    index = RadixIndex(BS)
    store(index, "a", chain(PROMPT))
    index._blocks_of[0].pop()
    with pytest.raises(AssertionError):
        index.check_integrity()
