"""What a proposer with a model of its own (draft_model.py, mtp.py) plugs into the engine's step,
and the draw of one draft position that both share.

    engine step:  propose placeholders -> schedule -> copy_blocks -> propose() (draw the drafts)
                  -> forward(runner, batch, scheduled) (the target's logits) -> sample / verify
                  -> settle() (the step's tokens are final)
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.sampler import SampleRequest, Sampler
from gpu_worker.scheduler import ScheduledSeq
from gpu_worker.sequence import Sequence
from gpu_worker.spec_decode.rejection import draft_seed, processed_probs, wants_rejection

# A draft position before the proposer has drawn its token: any valid id (the scheduler and the
# block accounting never read token values past the computed tokens).
PLACEHOLDER = 0

RequestAt = Callable[[int, Sequence, int], SampleRequest]


class DraftProposal(NamedTuple):
    """The draws of one propose(): per sequence that samples randomly, q_j for each draft."""
    q: dict[Sequence, torch.Tensor]        # (k_seq, V) float32 probabilities, one row per draft


class ModelProposer:
    """Defaults: the target's forward as it is, nothing to settle, every sequence may propose."""
    # True: every target forward also returns its pre-norm states (ModelRunner.forward_with_prenorm),
    # so the target captures decode graphs that keep them and no prefill or piecewise graphs
    reads_prenorm = False

    def forward(self, runner: Any, batch: ForwardBatch, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """The target's forward of the step -> its logits rows."""
        return runner.forward(batch)

    def settle(self) -> None:
        """After the step's tokens are appended or verified (drafts rolled back, finishes done)."""

    def can_propose(self, seq: Sequence) -> bool:
        return True

    def catch_up(self, seq: Sequence, first: int, chunk: int) -> None:
        """seq's computed positions first.. hold KV that arrived from another engine (a P/D
        hand-off), which carries the target's layers only (but handoff_caches()): the proposer
        computes its own KV there (at most `chunk` tokens per forward) before seq first
        proposes. Default: nothing."""

    # ---- a P/D hand-off (gpu_worker/kv_transfer/layout.py: handoff_caches) --------------------
    def handoff_caches(self) -> list:
        """The (K, V) caches of its own that a hand-off moves with the target's, under the same
        block ids (mtp: its layer's, written on the prefill engine). Default: none."""
        return []

    def resume_state(self, hidden: torch.Tensor) -> Any:
        """The prefill engine's last prompt hidden state (H,) on the host, checked and moved
        for resume() (raises RequestError when it does not fit). Default: not needed, None."""
        return None

    def resume(self, seq: Sequence, state: Any) -> None:
        """seq's prompt was prefilled elsewhere (with handoff_caches()): take up drafting from
        its first step as if this engine had prefilled it. Default: nothing."""

    def hold(self, seq: Sequence) -> None:
        """seq, decoding, is held to move to a peer engine with its target's KV (and
        handoff_caches()): leave what the peer needs to go on drafting on its request, as for a
        prefill's hand-off; forget seq. Default: nothing (a draft model's own KV stays behind,
        freed with the blocks; the peer computes its own: catch_up)."""

    def propose(self, drafts: dict[Sequence, list[int]], request_at: RequestAt) -> DraftProposal:
        raise NotImplementedError

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        raise NotImplementedError

    def warmup(self, max_num_seqs: int, max_query_len: int) -> None:
        """Compile the proposer's eager kernels before serving (CUDA)."""

    def close(self) -> None:
        """Free its device memory."""


def draw_position(sampler: Sampler, logits: torch.Tensor, active: list[tuple[Sequence, list[int]]], j: int,
                  request_at: RequestAt, q: dict[Sequence, list[torch.Tensor]]) -> None:
    """Draft j of each (seq, draft) of `active` from its row of `logits` (A, V), processed with the
    request's sampling parameters as the target's draw at that position is (its key salted
    apart): written into the draft and into seq.token_ids; random samplers' rows of q_j are
    appended to q[seq] (rejection.py verifies against them)."""
    requests = [request_at(i, seq, seq.num_tokens - len(draft) + j) for i, (seq, draft) in enumerate(active)]
    draws = [r._replace(seed=draft_seed(r.seed), params=_no_logprobs(r.params)) for r in requests]
    tokens = [res.token_id for res in sampler(logits, draws)]
    random_rows = [i for i, r in enumerate(requests) if wants_rejection(r.params)]
    if random_rows:
        probs = processed_probs(logits, [requests[i] for i in random_rows])   # (R, V)
        for k, i in enumerate(random_rows):
            q.setdefault(active[i][0], []).append(probs[k])
    for (seq, draft), token in zip(active, tokens):
        draft[j] = token
        seq.token_ids[seq.num_tokens - len(draft) + j] = token


def _no_logprobs(params: Any) -> Any:
    """The draft's own draw reports nothing: its logprobs are never shown."""
    if params.logprobs is None:
        return params
    import msgspec
    return msgspec.structs.replace(params, logprobs=None)
