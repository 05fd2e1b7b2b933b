"""Encode one long prompt on several cores: cut it where the pre-tokenizer cuts anyway.

Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen 2) first split text into words with a regex,
then merge each word on its own, so a prompt cut between two words encodes to the same ids as
the whole: the `tokenizers` library encodes the pieces in parallel (`encode_batch_fast`, its
Rust thread pool) and we join them. A fresh 512-token prompt of `kvmesh bench serve --dataset-name
random` took 2.15 ms whole and 0.70 ms in 6 pieces on the H200 host's 16 cores; the gateway's
tokenize stage of the serving run went from 2.23 to 1.06 ms of a 16-18 ms time to first token.

    |... word| word word| word ...|      cut only before a space that sits between two letters
             ^ cut                       (`a| b`): no split pattern here joins a non-space to the
                                         space after it, and none looks behind, so both sides
                                         split exactly as the whole text did

Only tokenizers whose every step is known to be cut-safe at such a point are cut (`cut_safe`):
no normalizer (or NFC), a byte-level pre-tokenizer with one of the known split patterns and no
prefix space, a BPE model, added tokens with no whitespace in them and no strip or single-word
rule, no truncation or padding. Everything else encodes whole, as before. The special tokens
(bos...) are added once, by the tokenizer's own post-processor over the joined encoding.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

from tokenizers import Encoding, Tokenizer

from services.text.prompt_bounds import check_count
from services.text.split_patterns import LLAMA3_SPLIT, QWEN2_SPLIT

# the split patterns known to be cut-safe (module docstring); GPT-2's is ByteLevel's own (use_regex)
KNOWN_SPLITS = frozenset({LLAMA3_SPLIT, QWEN2_SPLIT})

MIN_PIECE_CHARS = 512   # a piece shorter than this costs more to hand to a thread than it saves
MAX_PIECES = 8
# a space between two letters ([^\W\d_]: a word character that is no digit or underscore; it also
# takes the few numerals that are not decimal digits, e.g. "½", which are as safe on either side)
_CUT = re.compile(r"(?<=[^\W\d_]) (?=[^\W\d_])")


def cut_safe(tokenizer: Tokenizer) -> str | None:
    """None when a text cut as the module docstring draws encodes exactly as the whole text with
    this tokenizer; else why not (for the log)."""
    norm = _state(tokenizer.normalizer)
    if norm is not None and norm.get("type") != "NFC":
        return f"normalizer {norm.get('type')}"
    if not _pretokenizer_safe(_state(tokenizer.pre_tokenizer)):
        return "pre-tokenizer is not a byte-level split with a known pattern"
    if type(tokenizer.model).__name__ != "BPE":
        return f"model {type(tokenizer.model).__name__}"
    for tok in tokenizer.get_added_tokens_decoder().values():
        if tok.lstrip or tok.rstrip or tok.single_word or any(c.isspace() for c in tok.content):
            return f"added token {tok.content!r} strips or holds whitespace"
    if tokenizer.truncation or tokenizer.padding:
        return "truncation or padding is set"
    return None


def _state(component: Any) -> dict[str, Any] | None:
    """A normalizer's or pre-tokenizer's tokenizer.json entry."""
    return None if component is None else json.loads(component.__getstate__())


def _pretokenizer_safe(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return False
    if pre.get("type") == "ByteLevel":        # GPT-2's own pattern
        return pre.get("use_regex", True) and not pre.get("add_prefix_space", False)
    if pre.get("type") != "Sequence":
        return False
    steps = pre.get("pretokenizers") or []
    if len(steps) != 2:
        return False
    split, byte_level = steps
    return (split.get("type") == "Split" and (split.get("pattern") or {}).get("Regex") in KNOWN_SPLITS
            and split.get("behavior") == "Isolated" and not split.get("invert", False)
            and byte_level.get("type") == "ByteLevel" and not byte_level.get("use_regex", True)
            and not byte_level.get("add_prefix_space", False))


def cut_points(text: str, pieces: int) -> list[int]:
    """Up to pieces - 1 increasing cut offsets, each at a space between two letters, at or after
    the even split; fewer where the text has no such space (the scans cover the text once)."""
    n = len(text)
    points: list[int] = []
    for j in range(1, pieces):
        m = _CUT.search(text, max(j * n // pieces, points[-1] + 1 if points else 1))
        if m is None:
            break
        points.append(m.start())
    return points


def default_pieces() -> int:
    """The most pieces worth cutting: the cores this process may use (at most MAX_PIECES), 1 where
    the library's thread pool is off (TOKENIZERS_PARALLELISM=false)."""
    if os.environ.get("TOKENIZERS_PARALLELISM", "").lower() in ("0", "false", "no", "off"):
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_PIECES, cores))


class ParallelEncoder:
    """encode(text, add_special_tokens) -> ids, the same as the whole text's, cut when it pays."""

    def __init__(self, tokenizer: Tokenizer, max_pieces: int | None = None) -> None:
        self._tok = tokenizer
        self.max_pieces = default_pieces() if max_pieces is None else max(1, max_pieces)
        self._special_ends = special_ends(tokenizer)

    def pieces_for(self, text: str) -> int:
        return min(self.max_pieces, len(text) // MIN_PIECE_CHARS)

    def encode(self, text: str, add_special_tokens: bool, max_tokens: int = 0) -> list[int]:
        """The ids; TooManyTokens, before they are made, when there are more than max_tokens (0: any)."""
        points = cut_points(text, self.pieces_for(text))
        if not points:
            whole = self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
            check_count(len(whole), max_tokens)
            return whole.ids
        bounds = [0, *points, len(text)]
        encodings = self._tok.encode_batch_fast([text[a:b] for a, b in zip(bounds, bounds[1:])],
                                                add_special_tokens=False)
        head, tail = (self._special_ends or ((), ())) if add_special_tokens else ((), ())
        check_count(len(head) + sum(map(len, encodings)) + len(tail), max_tokens)
        if add_special_tokens and self._special_ends is None:
            return self._tok.post_process(Encoding.merge(encodings), add_special_tokens=True).ids
        # bos/eos once, where the post-processor puts them; joining id lists instead of merging
        # Encodings matters off the event loop: merge and post_process hold the GIL (0.9 s for a
        # 3.7M-token prompt, the gateway's loop stalled with it), encode_batch_fast does not
        ids: list[int] = list(head)
        for enc in encodings:
            ids += enc.ids
        ids += tail
        return ids


def special_ends(tokenizer: Tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The ids the post-processor puts before and after one text (e.g. ((bos,), ())), found by
    post-processing a probe; None where the probe's own ids do not come through unchanged."""
    probe = tokenizer.encode_batch_fast(["a"], add_special_tokens=False)[0]
    body, full = probe.ids, tokenizer.post_process(probe, add_special_tokens=True).ids
    for start in range(len(full) - len(body) + 1):
        if full[start:start + len(body)] == body:
            return tuple(full[:start]), tuple(full[start + len(body):])
    return None
