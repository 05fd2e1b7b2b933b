"""Stop strings over streamed text, without ever leaking the stop text.

Text arrives in pieces (detokenizer deltas). A stop string may span pieces, so the tail of
the text that could still be the start of a stop string is held back until the next piece
shows whether it is:

    pending = held + piece:   "Hello wor" + "ld<|e"      stop = ["<|end|>"]
                                                 ^^^ held: "<|e" is a prefix of "<|end|>"
    emitted: "Hello world"

On a match, the text before the earliest stop string is emitted and the matcher is finished.
A match must end in the newest piece: held text never matches by itself, so text passed through
`hold()` (made before min_tokens, when stop strings do not count yet) is never a stop, while a
stop string it begins and a later piece ends is.

With `include_stop` (vLLM's include_stop_str_in_output) the stop string stays in the text and
nothing is held back: each piece goes out whole, and on a match the text ends right after the
stop string. The last characters already sent are kept (not held) so a stop string spanning
pieces still matches.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence


class StopResult(NamedTuple):
    emit: str
    """Text that is now safe to send."""
    stopped: bool
    """A stop string matched: `emit` ends right before it and the request should finish."""


class StopStringMatcher:
    """`push(text) -> StopResult`; `flush()` returns the held-back tail at a natural end."""

    def __init__(self, stop: Sequence[str], *, include_stop: bool = False) -> None:
        self.stop = tuple(dict.fromkeys(s for s in stop if s))  # ignore empties, keep order
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1
        self._include = include_stop
        self._held = ""
        self._sent = ""       # include_stop: the tail of the text sent, which a stop may begin in
        self.matched: str | None = None
        """The stop string that matched (for finish_reason / stop_reason), or None."""

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, text: str) -> StopResult:
        if self.matched is not None:
            return StopResult("", True)
        if not self.stop:
            return StopResult(text, False)
        if self._include:
            return self._push_kept(text)
        pending = self._held + text
        hit = self._earliest_match(pending, len(self._held))
        if hit is not None:
            index, stop = hit
            self.matched, self._held = stop, ""
            return StopResult(pending[:index], True)
        return StopResult(self._release(pending), False)

    def _push_kept(self, text: str) -> StopResult:
        """include_stop: all of `text`, or its part up to the end of the stop string it ends."""
        seen = self._sent + text
        hit = self._earliest_match(seen, len(self._sent))
        if hit is not None:
            index, stop = hit
            self.matched = stop
            return StopResult(text[:index + len(stop) - len(self._sent)], True)
        self._keep_tail(seen)
        return StopResult(text, False)

    def _keep_tail(self, seen: str) -> None:
        self._sent = seen[-self._max_hold:] if self._max_hold else ""

    def hold(self, text: str) -> str:
        """Text that cannot stop the sample yet (before min_tokens): the part now safe to send; a
        tail that may begin a stop string stays held, so a later piece can complete it."""
        if self.matched is not None:
            return ""
        if self._include:
            self._keep_tail(self._sent + text)
            return text
        return self._release(self._held + text)

    def _release(self, pending: str) -> str:
        """pending but the tail that may begin a stop string, which is held."""
        keep = self._partial_suffix_len(pending)
        self._held = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep]

    def flush(self) -> str:
        """The held-back text, at a natural end (eos, length): it turned out not to be a stop."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _earliest_match(self, text: str, held: int) -> tuple[int, str] | None:
        """The earliest stop string in `text` that ends past its first `held` characters."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            i = text.find(stop, max(0, held - len(stop) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        return best

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for k in range(min(self._max_hold, len(text)), 0, -1):
            tail = text[-k:]
            if any(stop.startswith(tail) for stop in self.stop):
                return k
        return 0
