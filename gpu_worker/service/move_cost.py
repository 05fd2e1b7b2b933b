"""A drain's choice per running request: move it to a peer with its KV, or let the peer recompute.

Moving the KV of T computed tokens (B bytes: its blocks) is predicted to take B / bw, where bw is
this worker's measured rate of whole KV sends on the path the next one will likely use;
recomputing them on the peer, T / prefill_rate, the draining worker's own measured prefill rate
(gpu_worker/prefill_rate.py, the estimate the KV tiers' `auto` policy prices recomputes with;
workers of one pool run the same model on the same hardware). The request moves with its KV when

    B / bw  <=  MARGIN * T / prefill_rate

MARGIN > 1 leans towards moving the KV: a recompute also takes the peer's prefill away from
the streams it decodes (they stall for it), and waits for a slot in its batch; a copy does not.

Paths, and their rates before anything was measured (a measurement replaces them):

    cache    the peer reads our cache itself (cuda_ipc, kv_transfer/cuda_ipc.py): device to device
    shm      frames whose payloads go through a shared-memory ring (a peer on this host)
    frames   CURVE-encrypted ZMQ frames (a peer on another host)
    nixl     NIXL reads (prefill/decode hand-offs only; a drain never sends with it)

The defaults are below what the paths reach on an H100 host (host-staged frames measured about
0.55 GB/s), so a worker that has measured nothing yet errs towards recomputing long requests
over frames. A send measures its path only from MIN_SAMPLE_BYTES on: a small one's time is
mostly the Offer/Accept round trip, and its rate would make a long request's copy look slow. Until a prefill step has been measured, every request moves with its KV (as `auto`
loads before it has a prefill rate): there is nothing to weigh the transfer against.
"""
from __future__ import annotations

from typing import NamedTuple

from gpu_worker.prefill_rate import PrefillRate, ewma
from services import metrics

MARGIN = 1.5
MIN_SAMPLE_BYTES = 32 << 20     # ~240 tokens of an 8B model: the copy outweighs the round trips
DEFAULT_BYTES_PER_S = {"cache": 10e9, "shm": 0.4e9, "frames": 0.4e9, "nixl": 1e9}
PATHS = tuple(DEFAULT_BYTES_PER_S)


class MoveChoice(NamedTuple):
    way: str                   # "kv" (move with its KV) or "recompute"
    transfer_s: float          # predicted time of sending its KV
    recompute_s: float | None  # predicted time of recomputing it on the peer; None: no prefill measured


def choose_way(num_tokens: int, num_bytes: int, bytes_per_s: float, tokens_per_s: float | None,
               margin: float = MARGIN) -> MoveChoice:
    """The module docstring's rule for one request."""
    transfer_s = num_bytes / bytes_per_s
    if not tokens_per_s:
        return MoveChoice("kv", transfer_s, None)
    recompute_s = num_tokens / tokens_per_s
    return MoveChoice("kv" if transfer_s <= margin * recompute_s else "recompute", transfer_s, recompute_s)


class TransferRates:
    """The measured rate of whole KV sends per path (exponential moving averages). Written by the
    sender's peer threads, read by the engine thread: single float stores, atomic under the GIL."""

    def __init__(self, preferred: str, min_bytes: int = MIN_SAMPLE_BYTES) -> None:
        assert preferred in PATHS, preferred
        self.min_bytes = min_bytes
        self.measured: dict[str, float] = {}
        self.last = preferred          # the path of the last send: the next one likely takes it too

    def observe(self, path: str, num_bytes: int, seconds: float) -> None:
        if num_bytes >= max(1, self.min_bytes) and seconds > 0:
            self.measured[path] = rate = ewma(self.measured.get(path), num_bytes / seconds)
            self.last = path
            metrics.KV_SEND_RATE.labels(path).set(rate)

    def expected(self) -> tuple[str, float]:
        """(path, bytes per second) of the next send."""
        return self.last, self.measured.get(self.last) or DEFAULT_BYTES_PER_S[self.last]


class MoveCosts:
    """A draining worker's estimates: its sender's transfer rates and its engine's prefill rate."""

    def __init__(self, rates: TransferRates, prefill: PrefillRate, block_bytes: int, block_size: int,
                 margin: float = MARGIN) -> None:
        self.rates, self.prefill = rates, prefill
        self.block_bytes, self.block_size, self.margin = block_bytes, block_size, margin

    def choose(self, num_tokens: int) -> MoveChoice:
        """num_tokens: the request's computed positions (their KV would move, or be recomputed)."""
        return self.choose_blocks(num_tokens, -(-num_tokens // self.block_size))

    def choose_blocks(self, num_tokens: int, num_blocks: int) -> MoveChoice:
        """A request whose KV is num_blocks blocks and whose recompute is num_tokens tokens: an
        n > 1 request's samples share their prompt's full blocks, which move once, while a
        recompute computes every sample's prompt and output (kv_transfer/group.py)."""
        return choose_way(num_tokens, num_blocks * self.block_bytes, self.rates.expected()[1], self.prefill.rate,
                          self.margin)

    def describe(self) -> str:
        """The estimates, for the drain's log line."""
        path, rate = self.rates.expected()
        measured = "measured" if path in self.rates.measured else "default"
        prefill = f"{self.prefill.rate:.0f} tokens/s" if self.prefill.rate else "not measured yet"
        return f"KV over {path} at {rate / 1e9:.2f} GB/s ({measured}), prefill {prefill}, margin {self.margin:g}"
