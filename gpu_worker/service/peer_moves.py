"""Peer moves: a drain that moves decoding requests to other workers with their KV, on the
prefill/decode hand-off (handoff.py, kv_transfer/). WorkerCore has these methods; they use its
engine, its request tables (`requests`, `awaiting`) and its hand-off queues (`_handoffs`,
`_cancels`, `_sending`), and the state __init__ sets here.

    draining worker W   hand_back(): each decoding request (each sample still going running,
                        every token but the last computed; n > 1 as one group, its shared prompt
                        blocks once: kv_transfer/group.py; constrained or speculating too, only
                        final KV: hold_for_move's docstring) whose KV is predicted to move faster than the peer would
                        recompute it (move_cost.py) is held with its KV (engine.hold_for_move), listed in
                        `kv_held` beside `handed_back`, for the hand-off lease -> MoveKV(rid, to)
                        from the scheduler: its KV goes to that peer through the hand-off sender,
                        if the client's tokens are the ones computed (else the peer is told to
                        give up: cancel) -> handoff_done() releases the blocks. An Abort, or no
                        MoveKV within the lease, releases them.
    peer worker D       Dispatch(resume_output, kv_from): opens the stream (as any moved request)
                        and awaits the KV like a decode worker; admitted, it decodes on from the
                        received blocks (a grammar's matcher rebuilt from the output, a draft
                        model's KV computed, MTP's pending row taken: admit_imported); refused,
                        failed, cancelled or not offered within the lease, it recomputes the
                        request from resume_output (the Dispatch without kv_from).

Either role with both KV endpoints (mixed, decode) is both W and D; WorkerCore.hand_back() and
adopt_imports() call in here.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from gpu_worker.kv_transfer import group
from gpu_worker.outputs import RequestError
from gpu_worker.sequence import SequenceStatus
from gpu_worker.service.move_cost import MoveCosts
from gpu_worker.service.request_state import Req
from services import metrics
from services.envelope import Envelope
from services.protocol.messages import Abort, Dispatch, MoveKV, RequestFailed

log = logging.getLogger("kvmesh.worker")


class PeerMoves:
    """WorkerCore's part for peer moves (module docstring). Of the core it uses: the engine, its
    epoch, `imports` (handoff.AwaitedImports), `requests` and `awaiting`, the hand-off queues
    `_handoffs`, `_cancels` and `_sending`, the `_finished` reports and `_open` (a StreamOpen)."""

    engine: Any
    epoch: int
    imports: Any
    awaiting: dict[str, Req]
    requests: dict[str, Req]

    def _init_peer_moves(self) -> None:
        self.moves_kv = False                          # both KV endpoints: drains move KV to peers
        self.move_lease_s = 5.0                        # --handoff-lease-ms: how long held KV waits
        self.held: dict[str, float] = {}               # W: request -> monotonic() its held KV is freed
        self._peer_moves: dict[str, Dispatch] = {}     # D: KV awaited from a drained worker
        self.move_costs: MoveCosts | None = None       # W: None moves every request it can with its KV

    def _hold_for_peer(self, rid: str) -> bool:
        """W, handing back: hold rid's KV for a peer (True), or let the peer recompute it. Held
        when moves are on, it is not being sent already, moving its KV is predicted to be the
        faster way (move_cost.py) and the engine can hold it."""
        if not self.moves_kv or rid in self._sending:
            return False
        ereq = self.engine.requests.get(rid)
        live = [] if ereq is None else [q for q in ereq.seqs if q.status is not SequenceStatus.FINISHED]
        if self.move_costs is not None and live:
            # every sample's computed tokens are recomputed at the peer; its KV is the group's blocks
            shared = group.num_shared_blocks(live, self.move_costs.block_size)
            choice = self.move_costs.choose_blocks(sum(q.num_computed_tokens for q in live),
                                                   len(group.flat_table(live, shared)))
            if choice.way == "recompute":
                log.debug("request %s: recomputed at the peer (KV %.1f ms, recompute %.1f ms)", rid,
                          1e3 * choice.transfer_s, 1e3 * (choice.recompute_s or 0.0))
                return False
        return self.engine.hold_for_move(rid)

    def _log_drain_ways(self, num_kv: int, num_recompute: int) -> None:
        metrics.DRAIN_WAYS.labels("kv").inc(num_kv)
        metrics.DRAIN_WAYS.labels("recompute").inc(num_recompute)
        if num_kv + num_recompute == 0:
            return
        if not self.moves_kv:
            log.info("drain: running requests handed back: %d, recomputed where they move (no KV moves: "
                     "--drain-kv-to-peers off, or this worker cannot send KV)", num_recompute)
            return
        how = self.move_costs.describe() if self.move_costs is not None else "every one that can move"
        log.info("drain: running requests handed back: %d move to peers with their KV, %d are recomputed "
                 "there (%s)", num_kv, num_recompute, how)

    def _await_peer(self, msg: Dispatch, out: list[Envelope], received: float) -> None:
        """D: a moved request whose KV a drained worker sends: its stream is ours from now on."""
        rid = msg.request_id
        self.awaiting[rid] = Req(msg.detok_addr, msg.reply_addr, msg.params.n, received, run=msg.run,
                                 prompt_tokens=len(msg.prompt_token_ids), done=set(msg.resume_ended))
        self._peer_moves[rid] = msg
        self.imports.await_request(rid, max_wait_s=self.move_lease_s,
                                   expect=(list(msg.prompt_token_ids), _live(msg.resume_output, msg.resume_ended)))
        self.num_requests += 1
        out.append(Envelope(msg.detok_addr, self._open(msg)))

    def _peer_sample_ended(self, msg: Abort) -> bool:
        """D: one sample of a moved n > 1 request ended by its client (a stop string) while its KV
        is awaited: it leaves the import if that has begun, else it is ended once the request is
        admitted or recomputed (its KV still comes: W's Offer lists it). False: the whole request
        ends (no index, or that was its last sample going)."""
        req = self.awaiting.get(msg.request_id)
        if req is None or msg.index is None:
            return False
        req.done.add(msg.index)
        if len(req.done) >= req.n:
            return False
        self.engine.abort_request(msg.request_id, msg.index)
        return True

    def _peer_admitted(self, rid: str) -> None:
        msg = self._peer_moves.pop(rid, None)
        if msg is not None:
            metrics.PEER_MOVES.labels("peer").inc()
            log.info("request %s: moved here from worker %s with its KV (%d tokens reused)", rid, msg.kv_from,
                     _num_tokens(msg) - 1)
            # samples stopped before their KV came: the Offer still carried them
            for index in sorted(self.requests[rid].done - set(msg.resume_ended)):
                self.engine.abort_request(rid, index)

    def _peer_fallback(self, rid: str, out: list[Envelope]) -> None:
        """D: the KV did not come (refused, failed, cancelled, late): recompute from the tokens."""
        msg = self._peer_moves.pop(rid)
        req = self.awaiting.pop(rid)
        metrics.PEER_MOVES.labels("recompute").inc()
        log.info("request %s: no KV from worker %s; recomputing its %d tokens", rid, msg.kv_from,
                 _num_tokens(msg))
        try:
            self.engine.add_request(rid, msg.prompt_token_ids, msg.params, priority=msg.priority,
                                    cache_salt=msg.cache_salt, resume_output=msg.resume_output,
                                    resume_ended=sorted(req.done))    # resume_ended and samples stopped since
        except RequestError as exc:
            out.append(Envelope(msg.reply_addr, RequestFailed(
                request_id=rid, status=400, code="invalid_request", message=str(exc))))
            out.append(Envelope(msg.detok_addr, Abort(request_id=rid, reason="invalid_request")))
            self._finished.append((rid, msg.run))
            return
        self.requests[rid] = req
        if self._sees_scheduling:
            self._unscheduled[rid] = req

    def _move_kv(self, msg: MoveKV) -> None:
        """W: send a held request's KV to the peer awaiting it, if the client's tokens are the ones
        computed; else tell the peer to give up (it recomputes) and free the blocks."""
        rid = msg.request_id
        if msg.epoch != self.epoch or self.held.pop(rid, None) is None:
            # freed past the lease (or another incarnation's): the peer need not wait for it
            log.info("request %s: no KV held for a move (epoch %d, serving %d); the peer recomputes it", rid,
                     msg.epoch, self.epoch)
            self._cancels.append((rid, msg.to))
            return
        held = self.engine.held_outputs(rid)
        client = (_live(msg.sample_outputs, msg.ended) if msg.sample_outputs else {0: msg.output_token_ids})
        if held != client:
            log.info("request %s: its client has other tokens than its held KV; the peer recomputes", rid)
            self.engine.release_export(rid)
            self._cancels.append((rid, msg.to))
            return
        log.info("request %s: sending its KV (%d output tokens) to %s", rid, sum(map(len, held.values())), msg.to)
        self._handoffs.append((rid, msg.to))       # the sender's; handoff_done releases the blocks

    def _expire_held(self) -> None:
        now = time.monotonic()
        for rid in [r for r, deadline in self.held.items() if now > deadline]:
            del self.held[rid]
            log.info("request %s: no move of its held KV within the lease; freeing it", rid)
            self.engine.release_export(rid)

    def has_moves(self) -> bool:
        """W: KV still held for, or being sent to, a peer (the drain waits for it, bounded)."""
        return bool(self.held or self._sending or self._handoffs)


def _live(outputs: list[list[int]], ended: list[int]) -> dict[int, list[int]]:
    """Sample index -> the tokens its client has, of the samples that have not ended."""
    return {i: list(out) for i, out in enumerate(outputs) if i not in set(ended)}


def _num_tokens(msg: Dispatch) -> int:
    """A moved request's tokens: its prompt and its live samples' output."""
    return len(msg.prompt_token_ids) + sum(map(len, _live(msg.resume_output, msg.resume_ended).values()))


def peer_fits(msg: Dispatch) -> bool:
    """D: can a Dispatch with kv_from go on from KV: a sample still going, each with tokens."""
    live = _live(msg.resume_output, msg.resume_ended)
    return len(msg.resume_output) == msg.params.n and bool(live) and all(live.values())
