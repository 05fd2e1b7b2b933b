"""Bounds that refuse a prompt too long for the model's context as early as it can be known.

By its characters, before it is tokenized (`max_token_chars`): a prompt of C characters needs at
least C / K tokens, so one longer than max_model_len x K characters cannot fit, whatever it says.
By its token count, before its ids become a Python list (`check_count`): building the list of a
multi-million-token prompt holds the GIL for most of a second on a busy machine, and the gateway's
event loop with it.

K is the longest vocabulary entry (a byte-level token's entry has one character per byte, at
least as many as the text characters it covers; SentencePiece's "▁" stands for one space),
times what the normalizer can shrink text by. The bound holds only when every character of the
prompt reaches some token; `max_token_chars` is None (no bound: the body cap and the token count
still apply) where a step can drop or merge text:

- normalizers other than Unicode normalization, lowercasing, prepending and same-or-longer
  string replacement (strip, strip-accents, BERT's control-character removal, regexes);
  NFC/NFKC may compose up to 4 characters into one (the longest canonical decomposition);
- pre-tokenizers that drop whitespace or delimiters (Whitespace, BERT, CharDelimiterSplit,
  a Split or Punctuation with behavior Removed);
- models that map unknown text to one token or to none: WordPiece and WordLevel (a whole word),
  BPE with fuse_unk or (no unk token) dropping what its vocabulary lacks unless it falls back to
  bytes or sees only byte-level characters (all 256 in its vocabulary), Unigram without byte
  fallback;
- added tokens that swallow neighbouring whitespace (lstrip/rstrip), and truncation.
"""
from __future__ import annotations

import json
from typing import Any

from tokenizers import Tokenizer, pre_tokenizers

# the longest canonical decomposition (U+1F82...: alpha + 3 marks), what composition can merge
_COMPOSE_FACTOR = 4
_SAFE_PRE = frozenset({"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts", "Sequence"})


class TooManyTokens(ValueError):
    """A text encodes to more tokens than the caller can use; `count` is how many."""

    def __init__(self, count: int, max_tokens: int) -> None:
        super().__init__(f"the text has {count} tokens, more than {max_tokens}")
        self.count, self.max_tokens = count, max_tokens


def check_count(count: int, max_tokens: int) -> None:
    """TooManyTokens when count > max_tokens (0: no bound)."""
    if max_tokens and count > max_tokens:
        raise TooManyTokens(count, max_tokens)


def max_token_chars(tokenizer: Tokenizer) -> int | None:
    """Most prompt characters one token covers, or None where no such bound holds (module docstring)."""
    factor = _normalizer_factor(_state(tokenizer.normalizer))
    pre = _state(tokenizer.pre_tokenizer)
    if factor is None or not _pre_keeps_text(pre):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    byte_level = _has_byte_level(pre) and all(c in vocab for c in pre_tokenizers.ByteLevel.alphabet())
    if not _model_keeps_text(json.loads(tokenizer.model.__getstate__()), byte_level):
        return None
    if tokenizer.truncation:
        return None
    if any(t.lstrip or t.rstrip for t in tokenizer.get_added_tokens_decoder().values()):
        return None
    return max(1, max(map(len, vocab), default=1)) * factor


def _state(component: Any) -> dict[str, Any] | None:
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_factor(norm: dict[str, Any] | None) -> int | None:
    """How many characters of input one normalized character can come from (None: unbounded)."""
    if norm is None:
        return 1
    kind = norm.get("type")
    if kind == "Sequence":
        factor = 1
        for step in norm.get("normalizers") or []:
            f = _normalizer_factor(step)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in ("NFC", "NFKC"):
        return _COMPOSE_FACTOR
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend"):
        return 1
    if kind == "Replace":
        pattern, content = norm.get("pattern") or {}, norm.get("content") or ""
        source = pattern.get("String")
        if source is None or not content:   # a regex, or a deletion
            return None
        return max(1, -(-len(source) // len(content)))
    return None


def _pre_keeps_text(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind not in _SAFE_PRE or pre.get("behavior") == "Removed":
        return False
    return all(_pre_keeps_text(step) for step in pre.get("pretokenizers") or [])


def _has_byte_level(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return False
    return pre.get("type") == "ByteLevel" or any(_has_byte_level(p) for p in pre.get("pretokenizers") or [])


def _model_keeps_text(model: dict[str, Any], byte_level: bool) -> bool:
    """Every character reaches a token of its own: bytes, or one unknown token per character."""
    kind = model.get("type")
    if kind == "BPE":
        if model.get("byte_fallback") or byte_level:
            return True
        return bool(model.get("unk_token")) and not model.get("fuse_unk")
    if kind == "Unigram":
        return bool(model.get("byte_fallback")) or model.get("unk_id") is None
    return False
