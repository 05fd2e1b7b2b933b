"""Per-sequence back-off from speculation that does not pay.

Under async scheduling a step launches one step ahead of reading the previous step's tokens, but
drafts continue from the last token: a step that may propose settles the launched step first
(the overlap is lost), and a step that verifies runs synchronously. A sequence whose drafts are
rejected, or that made the engine settle and then found no draft, pays that cost for nothing.
Such a sequence backs off: for its next B steps it is offered no draft and makes no step settle
for it (Speculator.may_propose skips it), so those steps launch ahead as without speculation.

    failure (in a row):  1st  2nd  3rd  ...  7th  8th ...
    steps backed off:     1    2    4   ...  64   64  ...    (2 ** failures, at most max_steps)

A failure is
  - a verification that accepted no draft while the sequence's acceptance (accepted / proposed)
    over its last WINDOW verifications is below MIN_ACCEPTANCE, or
  - a step that settled for its drafts (may_propose said "maybe" for it) in which it found none
    (a miss; the others that found none cost nothing: the step settled for it).
A verification that accepts a draft resets the schedule to 1. So a sequence whose drafts are
accepted at MIN_ACCEPTANCE or more over its last WINDOW verifications never backs off; one whose
drafts keep failing verifies about once per max_steps steps. Drafts are only skipped, never
changed: output is exactly as without back-off.

The clock is the sequence's own token count (the in-flight placeholder included), which grows by
one per step without drafts and never shrinks, so a back-off holds through preemption and
both kinds of step alike.
"""
from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

WINDOW = 4               # verifications whose acceptance judges a sequence
MIN_ACCEPTANCE = 0.25    # below this over the window, a verification without an accepted draft fails


@dataclass
class _State:
    resume_at: int = 0      # the sequence may draft again once it holds this many tokens
    failures: int = 0       # failures since its last accepted draft
    window: deque = field(default_factory=lambda: deque(maxlen=WINDOW))   # (proposed, accepted)


class BackedOff(NamedTuple):
    """A back-off just taken: how many steps the sequence goes without drafts."""
    steps: int


class Backoff:
    """The schedule of every sequence (weakly keyed: a finished sequence's state goes with it).
    max_steps 0: never back off."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def waiting(self, seq) -> bool:
        """seq is backing off: no drafts for it this step."""
        state = self._states.get(seq)
        return state is not None and seq.num_tokens < state.resume_at

    def verified(self, seq, proposed: int, accepted: int, next_tokens: int) -> BackedOff | None:
        """seq verified `proposed` drafts and accepted the first `accepted`; its next step
        proposes after `next_tokens` tokens."""
        if self.max_steps == 0:
            return None
        state = self._states.setdefault(seq, _State())
        state.window.append((proposed, accepted))
        if accepted > 0:
            state.failures = 0
            return None
        tried = sum(p for p, _ in state.window)
        if sum(a for _, a in state.window) >= MIN_ACCEPTANCE * tried:
            return None
        return self._back_off(state, next_tokens)

    def missed(self, seq) -> BackedOff | None:
        """The step settled for drafts and seq found none; this step computes its last token,
        so the back-off starts at its next step."""
        if self.max_steps == 0:
            return None
        return self._back_off(self._states.setdefault(seq, _State()), seq.num_tokens + 1)

    def _back_off(self, state: _State, first_skipped: int) -> BackedOff:
        steps = min(1 << min(state.failures, self.max_steps.bit_length()), self.max_steps)
        state.failures += 1
        state.resume_at = first_skipped + steps
        return BackedOff(steps)
