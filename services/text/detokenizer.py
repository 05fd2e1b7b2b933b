"""Incremental detokenization: token ids in, newly final text out.

Decoding one token at a time is wrong in two ways: a byte-level BPE token can hold part of a
UTF-8 character (a CJK character or an emoji split over 2-4 tokens), and SentencePiece-style
decoders drop or keep a token's leading space depending on what precedes it. So we decode a
short window of previous tokens and diff (the prefix/read offset technique):

    window:  | prefix ids (already sent) | unread ids |
             ^0                          ^read_offset ^len

    full  = decode(window)                 # the prefix ids give the left context
    delta = full[emitted:]                 # emitted = chars of `full` already sent

If `full` ends in U+FFFD the last ids stop inside a character: only the text before the
trailing U+FFFD run is sent and the ids stay unread. Otherwise everything is sent and the
window slides (the unread ids become the prefix, older ids are dropped), so each push costs
O(window), not O(sequence).
"""
from __future__ import annotations

from typing import Protocol, Sequence

REPLACEMENT = "\ufffd"
# Past this many unread ids with no clean token boundary, stop waiting for one and slide the
# window anyway (only a pathological tokenizer or invalid UTF-8 from the model gets here);
# this is what bounds the work per token.
_MAX_UNREAD = 64
# Prompt tokens kept as left context for the first generated token (vLLM uses 5 too).
_PROMPT_CONTEXT = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """`push(ids)` returns only the text that became final; `flush()` returns the rest at the end.

    Concatenating every push and the flush equals decoding the generated ids in one go (given
    the same left context), and no push contains a half character.
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_token_ids or ())[-_PROMPT_CONTEXT:]
        self._ids: list[int] = context     # the window: prefix ids, then unread ids
        self._read_offset = len(context)
        self._emitted = len(self._decode(context))  # chars of decode(window) already sent
        self.num_tokens = 0                # generated ids pushed so far

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add generated ids; return the newly finalized text (may be empty)."""
        if not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        self.num_tokens += len(new_token_ids)
        full = self._decode(self._ids)
        if not full.endswith(REPLACEMENT) or len(self._ids) - self._read_offset > _MAX_UNREAD:
            return self._slide(full)
        # The ids end inside a character. Text before the trailing U+FFFD run cannot change
        # any more (UTF-8 resynchronizes), so send it now; the run waits for more bytes.
        stable = full.rstrip(REPLACEMENT)
        if len(stable) <= self._emitted:
            return ""
        delta, self._emitted = stable[self._emitted:], len(stable)
        return delta

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character decodes to U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        return self._slide(self._decode(self._ids))

    def _slide(self, full: str) -> str:
        """Send the unsent part of `full` (= decode(window)); the unread ids become the prefix."""
        delta = full[self._emitted:]
        prefix_text = self._decode(self._ids[self._read_offset:])
        # A prefix that decodes to nothing (skipped special tokens) gives no left context, and a
        # SentencePiece decoder would then strip the next word's leading space: keep the older
        # prefix too (window starts stay on clean boundaries), within the size bound.
        if prefix_text or len(self._ids) > _MAX_UNREAD:
            del self._ids[:self._read_offset]
        else:
            prefix_text = full
        self._read_offset = len(self._ids)
        self._emitted = len(prefix_text)
        return delta
