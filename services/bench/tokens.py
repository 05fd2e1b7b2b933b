"""Token counting and length-exact prompt building, with or without a real tokenizer.

With `--tokenizer DIR` (a Hugging Face tokenizer directory holding tokenizer.json) prompts are built
as token-id sequences, decoded to text and checked by re-encoding, so that a prompt asked to be N
tokens long tokenizes to N tokens (or within a token or two where decode/encode is not a bijection;
the measured length is what gets recorded). Without a tokenizer, prompts are made of common English
words that are one token each in GPT-style BPE vocabularies, and lengths are approximate: one word
(or punctuation mark) counts as one token.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

# Common English words that are single tokens (with their leading space) in GPT-2, Llama-3 and
# Qwen vocabularies; a prompt built from them is about one token per word without a tokenizer.
_WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be or "
    "has had one first not their after new who they have her she two been other when there all "
    "during into school time may years more most only over city some world would where later up "
    "such used many can state about national out known university united then made year well "
    "team part also people three between before under game while series through best found film "
    "back music work group home second each early these number since life same both name "
    "several general because high public last end could held four small long great water "
    "house local main member town line river order played club still began based until country"
).split()
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")


def approx_token_count(text: str) -> int:
    """Words plus punctuation marks: close to BPE counts for English, exact for our word prompts."""
    return len(_TOKEN_RE.findall(text))


class TokenCounter:
    """Counts tokens and builds prompts of a requested length; `exact` says whether a real tokenizer backs it."""

    def __init__(self, tokenizer_dir: str | None = None):
        self._tok = None
        self.exact = tokenizer_dir is not None
        if tokenizer_dir is not None:
            self._tok = _load_tokenizer(tokenizer_dir)
            self._pool = _clean_ids(self._tok)

    @property
    def vocab_size(self) -> int | None:
        return None if self._tok is None else self._tok.get_vocab_size(with_added_tokens=True)

    def count(self, text: str) -> int:
        if self._tok is None:
            return approx_token_count(text)
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def random_ids(self, n: int, rng: np.random.Generator) -> list[int]:
        """n random ids from the ordinary vocabulary; needs a tokenizer."""
        if self._tok is None:
            raise ValueError("token-id prompts need --tokenizer DIR (the vocabulary to draw from)")
        return rng.choice(self._pool, size=n).tolist()

    def random_text(self, n: int, rng: np.random.Generator) -> str:
        """Text that tokenizes to n tokens (exactly with a tokenizer, approximately without)."""
        if n <= 0:
            return ""
        if self._tok is None:
            return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=n))
        return self.text_of_length(self.random_ids(n, rng), n, rng)

    def text_of_length(self, ids: list[int], n: int, rng: np.random.Generator) -> str:
        """Decode ids to text, then trim or pad until the text re-encodes to n tokens (a few rounds)."""
        for _ in range(10):
            text = self._tok.decode(ids, skip_special_tokens=True)
            ids = self._tok.encode(text, add_special_tokens=False).ids
            if len(ids) == n:
                return text
            # Re-encoding merged or split tokens: cut back or top up with fresh random ids.
            ids = ids[:n] if len(ids) > n else ids + self.random_ids(n - len(ids), rng)
        return self._tok.decode(ids, skip_special_tokens=True)


def _clean_ids(tok) -> np.ndarray:
    """Ids to draw random prompts from: ordinary (not added/special) tokens that decode on their own
    to printable text and encode back to themselves. Partial UTF-8 bytes and control tokens would
    otherwise re-tokenize into a different number of tokens."""
    special = set(tok.get_added_tokens_decoder().keys())
    texts = tok.decode_batch([[i] for i in range(tok.get_vocab_size(with_added_tokens=False))],
                             skip_special_tokens=False)
    cands = [i for i, text in enumerate(texts)
             if i not in special and text.strip() and "\ufffd" not in text and text.isprintable()]
    encoded = tok.encode_batch([texts[i] for i in cands], add_special_tokens=False)
    ids = [i for i, enc in zip(cands, encoded) if enc.ids == [i]]
    if not ids:
        raise ValueError("--tokenizer: no ordinary printable tokens found in the vocabulary")
    return np.array(ids, dtype=np.int64)


def _load_tokenizer(tokenizer_dir: str):
    from tokenizers import Tokenizer

    path = Path(tokenizer_dir)
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"--tokenizer: no tokenizer.json at {path}; pass a Hugging Face tokenizer directory")
    return Tokenizer.from_file(str(path))
