"""Block pool unit tests; each ends with an integrity check."""
from gpu_worker.block_manager import BlockManager
from services.prefix_hash import chain_hashes
from gpu_worker.sequence import Request, Sequence
from services.protocol.sampling import SamplingParams

BS = 4


def make_seq(tokens, salt="", rid="r"):
    req = Request(rid, list(tokens), SamplingParams(), 0, salt, 0, 0, 16)
    seq = Sequence(req, 0, list(tokens), len(tokens))
    req.seqs.append(seq)
    return seq


def compute_all(bm, seq):
    """Pretend the forward ran: allocate, mark computed, publish full blocks."""
    hits = bm.lookup_prefix(seq)
    assert bm.allocate_prefill(seq, hits, seq.num_tokens - len(hits) * BS)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed_blocks(seq)
    return hits


class Recorder:
    def __init__(self):
        self.events = []

    def on_stored(self, h, parent, tokens):
        self.events.append(("stored", h, parent, tokens))

    def on_removed(self, h):
        self.events.append(("removed", h))

    def on_cleared(self):
        self.events.append(("cleared",))


def test_allocate_free_accounting():
    bm = BlockManager(8, BS, "m")
    seq = make_seq(range(10))
    compute_all(bm, seq)
    assert len(seq.block_table) == 3 and bm.num_used_blocks == 3
    bm.check_integrity()
    bm.free(seq)
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 2   # 2 full blocks hashed
    bm.check_integrity()


def test_prefix_hit_never_reuses_the_last_token_block():
    bm = BlockManager(16, BS, "m")
    a = make_seq(range(8))
    compute_all(bm, a)
    bm.free(a)
    # identical 8-token prompt: block 2 holds the last token, so only block 1 is reused
    b = make_seq(range(8))
    hits = compute_all(bm, b)
    assert len(hits) == 1 and b.block_table[0] == hits[0]
    # longer prompt with the same prefix reuses both full blocks
    c = make_seq(list(range(8)) + [99])
    assert len(bm.lookup_prefix(c)) == 2
    bm.free(b)
    bm.check_integrity()


def test_salt_separates_tenants():
    bm = BlockManager(16, BS, "m")
    a = make_seq(range(9), salt="t1")
    compute_all(bm, a)
    assert bm.lookup_prefix(make_seq(range(9), salt="t2")) == []
    assert len(bm.lookup_prefix(make_seq(range(9), salt="t1"))) == 2
    bm.free(a)
    bm.check_integrity()


def test_lru_eviction_tail_first_and_events():
    rec = Recorder()
    bm = BlockManager(4, BS, "m")
    bm.add_listener(rec)
    a = make_seq(range(12))                  # 3 full blocks, all hashed (12 tokens computed)
    compute_all(bm, a)
    hashes = chain_hashes(None, "m", "", list(range(12)), BS)
    assert [e[1] for e in rec.events] == hashes
    assert rec.events[1][2] == hashes[0] and rec.events[1][3] == [4, 5, 6, 7]
    assert [h for h, _, _ in bm.cached_block_hashes()] == hashes
    bm.free(a)
    assert bm.num_cached_blocks == 3
    # needs 3 blocks: 1 free + evict 2 cached, tail (youngest in the chain) first
    b = make_seq([50 + i for i in range(12)])
    assert bm.allocate_prefill(b, [], 12)
    removed = [e[1] for e in rec.events if e[0] == "removed"]
    assert removed == [hashes[2], hashes[1]]
    assert [h for h, _, _ in bm.cached_block_hashes()] == [hashes[0]]
    bm.free(b)
    bm.check_integrity()


def test_reset_prefix_cache():
    rec = Recorder()
    bm = BlockManager(8, BS, "m")
    bm.add_listener(rec)
    a = make_seq(range(8))
    compute_all(bm, a)
    assert not bm.reset_prefix_cache()       # refused while blocks are in use
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert rec.events[-1] == ("cleared",) and bm.cached_block_hashes() == []
    assert bm.num_cached_blocks == 0
    bm.check_integrity()


def test_copy_on_write_of_shared_partial_block():
    bm = BlockManager(8, BS, "m")
    parent = make_seq(range(6))              # blocks: [full][2 of 4]
    compute_all(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    bm.check_integrity()
    assert bm.blocks[parent.block_table[1]].ref_count == 2
    parent.token_ids.append(7)
    child.token_ids.append(8)
    copies = bm.allocate_slots(child, 1)     # first writer copies
    assert len(copies) == 1 and copies[0].src == parent.block_table[1] == 1
    assert child.block_table[1] == copies[0].dst and child.block_table[0] == parent.block_table[0]
    assert bm.allocate_slots(parent, 1) == []  # now sole owner: writes in place
    bm.check_integrity()
    bm.free(child)
    bm.free(parent)
    bm.check_integrity()
    assert bm.num_used_blocks == 0


def test_allocation_failure_changes_nothing():
    bm = BlockManager(2, BS, "m")
    seq = make_seq(range(12))
    assert not bm.allocate_prefill(seq, [], 12)
    assert seq.block_table == [] and bm.num_used_blocks == 0
    bm.check_integrity()
