"""Drive a runner the way the engine does: ragged batches over a paged KV cache, greedy decode."""
from __future__ import annotations

import torch

from gpu_worker.forward_batch import ForwardBatch

BLOCK = 4
NUM_BLOCKS = 32


def batch_for(seqs: list[list[int]], computed: list[int], blocks: list[list[int]]) -> ForwardBatch:
    """Schedule every not-yet-computed token of each sequence; logits of each sequence's last row."""
    ids, pos, slots, qlens, clens, last = [], [], [], [], [], []
    for toks, done, table in zip(seqs, computed, blocks):
        for p in range(done, len(toks)):
            ids.append(toks[p])
            pos.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
        qlens.append(len(toks) - done)
        clens.append(len(toks))
        last.append(len(ids) - 1)
    width = max(len(t) for t in blocks)
    return ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.tensor(pos),
        query_lens=torch.tensor(qlens, dtype=torch.int32), context_lens=torch.tensor(clens, dtype=torch.int32),
        query_start_loc=torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in blocks], dtype=torch.int32),
        slot_mapping=torch.tensor(slots), logits_indices=torch.tensor(last),
        max_query_len=max(qlens), max_context_len=max(clens))


def greedy_run(runner, prompts: list[list[int]], steps: int, before_first_step=None
               ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill all prompts in one batch, then `steps` greedy decode steps. -> (generated ids per
    sequence, the (num_seqs, V) logits of every step). `before_first_step(runner)` runs once the
    KV cache exists (e.g. to capture decode graphs)."""
    runner.allocate_kv_cache(NUM_BLOCKS, BLOCK)
    if before_first_step is not None:
        before_first_step(runner)
    # Scattered, interleaved block tables: sequence i owns blocks i, i+n, i+2n, ... (reversed)
    n = len(prompts)
    blocks = [list(range(i, NUM_BLOCKS, n))[::-1] for i in range(n)]
    seqs = [list(p) for p in prompts]
    computed = [0] * n
    out, all_logits = [[] for _ in prompts], []
    for _ in range(steps + 1):
        logits = runner.forward(batch_for(seqs, computed, blocks)).cpu()   # (n, V)
        all_logits.append(logits)
        computed = [len(s) for s in seqs]
        for i, tok in enumerate(logits.argmax(-1).tolist()):
            seqs[i].append(tok)
            out[i].append(tok)
    return out, all_logits
