"""The draft model of `{"method": "draft_model"}`: a smaller model with the target's tokenizer,
loaded beside the target (same device, dtype, block size), with a KV cache of its own layers
addressed by the target's block ids:

    block id b:   target K/V of its layers at [b]  |  draft K/V of its layers at [b]
    one block table per sequence, one BlockManager: allocation, rollback, copy-on-write and the
    prefix cache account for both models at once (each block costs both models' bytes)

Two invariants keep the draft's KV true wherever the target's is:
  - follow(batch): every target forward is followed by a draft forward of the same batch (same
    tokens, positions, slots), so the draft's KV holds exactly the tokens the target's does, a
    prefix-cache hit included (the block was written by both when it was computed);
  - copy_blocks: copy-on-write copies both caches.
KV that arrives from outside holds the target's layers only. A P/D hand-off's prompt is caught
up (catch_up: the draft prefills the imported positions over its own layers before the sequence
first proposes, so an imported sequence accepts what it would on one engine); a KV tier's load is
not: the draft's slots there stay stale, which costs acceptance, never correctness (the target
verifies every draft).

propose(): k autoregressive decode steps of the draft on the sequences' draft positions:

    token_ids:  | ... computed (c) ... | x | d0 d1 .. dk-1 |   d_j placeholders until drawn
    draft step j:  input token_ids[c + j] at position c + j (its KV lands in the target's slot
    for that position, rewritten by follow() later) -> logits -> d_j drawn from the draft's
    distribution q_j, processed with the request's sampling parameters as the target's is
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, NamedTuple

import torch

from gpu_worker.batch_builder import BatchBuilder
from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.sampler import Sampler
from gpu_worker.sequence import Sequence
from gpu_worker.spec_decode.proposer import DraftProposal, ModelProposer, RequestAt, draw_position

log = logging.getLogger(__name__)

class _DraftView(NamedTuple):
    """What BatchBuilder reads of a sequence, for one draft decode step of it."""
    token_ids: list[int]         # up to and including the step's input token
    num_computed_tokens: int     # the step's position
    block_table: list[int]


def _tokenizer_vocab(model_dir: str) -> Any:
    """The token -> id part of tokenizer.json (its model and added tokens), or None without one."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    tok = json.loads(path.read_text(encoding="utf-8"))
    model = tok.get("model") or {}
    return model.get("vocab"), model.get("merges"), [(a.get("id"), a.get("content")) for a in tok.get("added_tokens") or []]


def check_draft_matches(target_config: Any, target_dir: str, draft_config: Any, draft_dir: str,
                        max_model_len: int) -> None:
    """Raises ValueError when the draft cannot propose tokens of the target's vocabulary."""
    if int(draft_config.vocab_size) != int(target_config.vocab_size):
        raise ValueError(f"invalid speculative_config: model {draft_dir!r} has a vocabulary of "
                         f"{draft_config.vocab_size} tokens but the target has {target_config.vocab_size}; "
                         "a draft model must share the target's tokenizer")
    target_vocab, draft_vocab = _tokenizer_vocab(target_dir), _tokenizer_vocab(draft_dir)
    if target_vocab is not None and draft_vocab is not None and target_vocab != draft_vocab:
        raise ValueError(f"invalid speculative_config: model {draft_dir!r} has another tokenizer than the "
                         "target (tokenizer.json differs); a draft model must share the target's tokenizer")
    if int(draft_config.max_position_embeddings) < max_model_len:
        raise ValueError(f"invalid speculative_config: model {draft_dir!r} supports "
                         f"{draft_config.max_position_embeddings} positions, fewer than max_model_len "
                         f"({max_model_len}); lower max_model_len")


def load_draft_runner(draft_dir: str, target_config: Any, target_dir: str, *, device: torch.device,
                      dtype: torch.dtype, attention_backend: str, kv_cache_dtype: torch.dtype | None,
                      seed: int, tuning: Any, max_model_len: int) -> Any:
    """The draft's ModelRunner on the target's device, in the target's dtype; checked first."""
    from gpu_worker.model_config import ModelConfig
    from gpu_worker.model_runner import ModelRunner
    try:
        draft_config = ModelConfig.from_dir(draft_dir)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"invalid speculative_config: model {draft_dir!r} is not a loadable model "
                         f"directory ({e})") from None
    check_draft_matches(target_config, target_dir, draft_config, draft_dir, max_model_len)
    runner = ModelRunner(draft_config, draft_dir, device=device, dtype=dtype, attention_backend=attention_backend,
                         seed=seed, kv_cache_dtype=kv_cache_dtype, tuning=tuning)
    log.info("draft model %s loaded (%d layers)", draft_dir, draft_config.num_layers)
    return runner


class DraftModel(ModelProposer):
    def __init__(self, runner: Any, block_size: int, device: torch.device) -> None:
        self.runner = runner
        self.builder = BatchBuilder(block_size, device)
        self.sampler = Sampler()

    def forward(self, runner: Any, batch: ForwardBatch, scheduled: list) -> torch.Tensor:
        logits = runner.forward(batch)
        self.follow(batch)
        return logits

    @torch.inference_mode()
    def follow(self, batch: ForwardBatch) -> None:
        """The draft writes its KV for the target's batch (its logits are not needed)."""
        self.runner.run_model(self.runner.prepare_inputs(batch))

    def catch_up(self, seq: Sequence, first: int, chunk: int) -> None:
        """The draft's KV for seq's imported positions first .. num_computed_tokens - 1:

            token_ids:  | D's prefix hits (draft KV true) | imported (target KV only) | x |
                        0                                first                    c
            follow():                                     | chunk | chunk | ...  |   no logits
        """
        end = seq.num_computed_tokens
        for start in range(first, end, chunk):
            n = min(chunk, end - start)
            self.follow(self.builder.build([(_DraftView(seq.token_ids[:start + n], start, seq.block_table), n)]))

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.runner.copy_blocks(src, dst)

    def warmup(self, max_num_seqs: int, max_query_len: int) -> None:
        self.runner.warmup(max_num_seqs, max_query_len)

    def close(self) -> None:
        self.runner.close()

    def propose(self, drafts: dict[Sequence, list[int]], request_at: RequestAt) -> DraftProposal:
        """Draw every draft (placeholders in `drafts` and in the sequences' token_ids replaced).
        request_at(row, seq, num_tokens): the target's draw after token_ids[:num_tokens]."""
        q: dict[Sequence, list[torch.Tensor]] = {}
        for j in range(max(map(len, drafts.values()), default=0)):
            active = [(seq, draft) for seq, draft in drafts.items() if len(draft) > j]
            views = []
            for seq, draft in active:
                at = seq.num_tokens - len(draft) - 1 + j              # c + j: this step's input
                views.append((_DraftView(seq.token_ids[:at + 1], at, seq.block_table), 1))
            logits = self.runner.forward(self.builder.build(views))   # (A, V)
            draw_position(self.sampler, logits, active, j, request_at, q)
        return DraftProposal({seq: torch.stack(rows) for seq, rows in q.items()})
