"""A peer move of an n > 1 request: its live samples' blocks as one transfer table.

Samples of one request share their prompt's leading full blocks (forked copy-on-write); after the
fork each writes blocks of its own. A hand-off moves one list of blocks, so a group is laid out

    | shared: S blocks every sample holds | sample a's own blocks | sample b's own blocks | ...
      S = the samples' common leading blocks, at most the prompt's full ones

in sample-index order: P lists its held samples' blocks so (flat_table), D reserves the same shape
(reserve) and frames land block for block, each shared block once. The prompt's partial last
block goes with each sample: every sample that wrote past the prompt holds its own copy of it.
"""
from __future__ import annotations

from gpu_worker.sequence import Sequence


def num_shared_blocks(seqs: list[Sequence], block_size: int) -> int:
    """S: the leading blocks every sample's table holds (the same block ids), at most the full
    prompt blocks (a sample recomputed after a preemption may hold copies of its own)."""
    limit = seqs[0].num_prompt_tokens // block_size
    shared = 0
    while shared < limit and all(shared < len(s.block_table) and s.block_table[shared] == seqs[0].block_table[shared]
                                 for s in seqs):
        shared += 1
    return shared


def flat_table(seqs: list[Sequence], shared: int) -> list[int]:
    """The module docstring's transfer table of samples in index order."""
    return [*seqs[0].block_table[:shared], *(b for s in seqs for b in s.block_table[shared:])]


def own_blocks(num_tokens: int, shared: int, block_size: int) -> int:
    """Blocks of a sample's num_tokens computed tokens past the shared ones."""
    return -(-num_tokens // block_size) - shared


def reserve(bm, seqs: list[Sequence], shared: int) -> int | None:
    """D: blocks for a moved group (seqs: its live samples, each at the tokens whose KV comes,
    holding no blocks): S shared blocks, the leading ones from this pool's prefix cache where it
    has them, then each sample's own. Returns the number of leading blocks found cached (they do
    not move), or None when the pool lacks free blocks now (nothing reserved)."""
    bs = bm.block_size
    hits = bm.lookup_full_blocks(seqs[0])[:shared]
    need = shared - len(hits) + sum(own_blocks(s.num_tokens, shared, bs) for s in seqs)
    revived = sum(1 for b in hits if bm.blocks[b].ref_count == 0)
    if need > bm.num_free_blocks - revived:
        return None
    first = seqs[0]
    reserved = bm.allocate_prefill(first, hits, (shared - len(hits)) * bs)
    for seq in seqs[1:]:                  # forks of the first: the shared blocks once, ref counted
        seq.block_table = list(first.block_table)
        bm.fork(first, seq)
    for seq in seqs:
        seq.num_computed_tokens = shared * bs
        reserved = reserved and bm.allocate_slots(seq, seq.num_tokens - shared * bs) == []  # no copy: own
    assert reserved, "the pool had the blocks counted above"
    return len(hits)
