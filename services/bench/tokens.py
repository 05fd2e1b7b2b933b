"""Token counting and length-exact prompt building with one tokenizer: a local tokenizer.json
(`--tokenizer DIR`), the server's own (`/tokenize`, server_tokenizer.py), or a plain word count
(the mock server's tokenizer; tests).

A prompt's length is what the endpoint will count (`usage.prompt_tokens`): on the completions
endpoint that includes the special tokens the tokenizer adds (bos), as the server adds them; chat
messages are counted without them (the chat template adds its own fixed tokens, which vLLM's
benchmark leaves out too). Random prompts are built to a target length and counted once more
when done; the measured length is what gets recorded.

    local tokenizer:  random ordinary vocabulary ids -> decode -> re-encode, trim or top up
    server / words:   common English words whose cost (" word" alone) was measured once; the
                      finished text is counted and words are dropped or added until it fits
"""
from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

# Common English words that are single tokens (with their leading space) in GPT-2, Llama-3 and
# Qwen vocabularies; smaller vocabularies split some of them, which the measured costs account for.
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
# Rounds of "count, then drop or add words" before a prompt is taken at its measured length.
_FIT_ROUNDS = 8


def approx_token_count(text: str) -> int:
    """Words plus punctuation marks: the word-count tokenizer's count."""
    return len(_TOKEN_RE.findall(text))


class Tokenizer(Protocol):
    name: str  # how the benchmark's output names it

    def count(self, text: str, add_special_tokens: bool) -> int: ...


class WordCount:
    """One word or punctuation mark = one token, no special tokens: the mock server's tokenizer."""

    name = "word count (one word or punctuation mark = one token)"

    def count(self, text: str, add_special_tokens: bool) -> int:
        return approx_token_count(text)


class LocalTokenizer:
    """A Hugging Face tokenizer.json, loaded with the `tokenizers` library."""

    def __init__(self, tokenizer_dir: str | Path):
        self._tok, path = _load_tokenizer(tokenizer_dir)
        self.name = f"{path} (--tokenizer)"

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def count(self, text: str, add_special_tokens: bool) -> int:
        return len(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def random_ids(self, n: int, rng: np.random.Generator) -> list[int]:
        """n random ids from the ordinary vocabulary."""
        return rng.choice(self._pool, size=n).tolist()

    def random_text(self, n: int, rng: np.random.Generator) -> str:
        """Decode n random ids, then trim or pad until the text re-encodes to n tokens (a few rounds)."""
        ids = self.random_ids(n, rng)
        for _ in range(10):
            text = self._tok.decode(ids, skip_special_tokens=True)
            ids = self._tok.encode(text, add_special_tokens=False).ids
            if len(ids) == n:
                return text
            # Re-encoding merged or split tokens: cut back or top up with fresh random ids.
            ids = ids[:n] if len(ids) > n else ids + self.random_ids(n - len(ids), rng)
        return self._tok.decode(ids, skip_special_tokens=True)

    @cached_property
    def _pool(self) -> np.ndarray:
        return _clean_ids(self._tok)


class TokenCounter:
    """Counts tokens and builds prompts of a requested length with one tokenizer.

    `tokenizer`: a Tokenizer, a tokenizer directory (str or Path), or None for the word count.
    `chat`: prompts go to the chat endpoint (their length leaves the special tokens out).
    """

    def __init__(self, tokenizer: Tokenizer | str | Path | None = None, *, chat: bool = False):
        if tokenizer is None:
            tokenizer = WordCount()
        elif isinstance(tokenizer, (str, Path)):
            tokenizer = LocalTokenizer(tokenizer)
        self.tokenizer = tokenizer
        self._prompt_specials = not chat
        self._head_lens: dict[str, int] = {}

    @property
    def name(self) -> str:
        return self.tokenizer.name

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.tokenizer, "vocab_size", None)

    def count(self, text: str) -> int:
        """Tokens of the text alone (no special tokens): generated text, chat messages."""
        return self.tokenizer.count(text, False)

    def prompt_len(self, text: str) -> int:
        """Tokens the endpoint will count for this prompt (usage.prompt_tokens)."""
        return self.tokenizer.count(text, self._prompt_specials)

    def random_ids(self, n: int, rng: np.random.Generator) -> list[int]:
        """n random ids from the ordinary vocabulary; needs a local tokenizer."""
        if not isinstance(self.tokenizer, LocalTokenizer):
            raise ValueError("token-id prompts need --tokenizer DIR (the vocabulary to draw from)")
        return self.tokenizer.random_ids(n, rng)

    def random_text(self, n: int, rng: np.random.Generator) -> str:
        """Text of n tokens on its own (no special tokens): shared prefixes, system prompts."""
        if n <= 0:
            return ""
        if isinstance(self.tokenizer, LocalTokenizer):
            return self.tokenizer.random_text(n, rng)
        return self._filler.fit(self._filler.pick(n, rng), " ".join, self.count, n, rng)[0]

    def random_prompt(self, head: str, n: int, rng: np.random.Generator) -> tuple[str, int]:
        """`head` followed by random text: n tokens more than the head alone, as the endpoint counts
        them (the special tokens are among the n); returns the text and its measured length."""
        target = self._head_len(head) + n
        need = n - self._special_len
        if isinstance(self.tokenizer, LocalTokenizer):
            return self._redraw_to_fit(head, need, target, rng)
        render = lambda words: _join(head, " ".join(words))  # noqa: E731
        return self._filler.fit(self._filler.pick(need, rng), render, self.prompt_len, target, rng)

    def _redraw_to_fit(self, head: str, need: int, target: int, rng) -> tuple[str, int]:
        """Vocabulary text is exact on its own; where it joins the head (or the bos) a token may
        merge or split: draw again with the length corrected by what the count found."""
        for _ in range(_FIT_ROUNDS):
            text = _join(head, self.tokenizer.random_text(max(need, 1), rng))
            got = self.prompt_len(text)
            if got == target:
                break
            need -= got - target
        return text, got

    def _head_len(self, head: str) -> int:
        if head not in self._head_lens:
            if len(self._head_lens) > 4096:  # a few distinct heads per dataset; bound it anyway
                self._head_lens.clear()
            self._head_lens[head] = self.count(head) if head else 0
        return self._head_lens[head]

    @cached_property
    def _special_len(self) -> int:
        return self.prompt_len("hello") - self.count("hello")

    @cached_property
    def _filler(self) -> "_WordFiller":
        return _WordFiller(self.count)


class _WordFiller:
    """Texts of a token budget made of words whose cost (" word" alone) was counted once.

    Tokenizers split on spaces before merging (BPE and SentencePiece vocabularies do), so costs
    add up; the first word (no leading space) may cost one more or less, which `fit` corrects.
    """

    def __init__(self, count: Callable[[str], int]):
        costs = np.array([count(" " + w) for w in _WORDS])
        keep = costs >= 1
        if not keep.any():
            raise ValueError("the tokenizer gives no tokens for plain English words")
        self.words = np.array(_WORDS)[keep]
        self.costs = costs[keep]
        self._cost_of = dict(zip(self.words.tolist(), self.costs.tolist()))

    def pick(self, budget: int, rng: np.random.Generator) -> list[str]:
        """Random words whose costs add up to budget (at least one word)."""
        draw = rng.integers(0, len(self.words), size=max(budget, 1))  # every word costs >= 1
        total = np.cumsum(self.costs[draw])
        # random words while the rest can surely be finished, then words that fit what is left
        k = int(np.searchsorted(total, budget - self.costs.max(), side="right"))
        chosen, left = list(draw[:k]), budget - (int(total[k - 1]) if k else 0)
        while left > 0:
            fits = np.flatnonzero(self.costs <= left)
            if not fits.size:
                break  # no word this cheap: the measured length will say so
            chosen.append(int(fits[rng.integers(fits.size)]))
            left -= int(self.costs[chosen[-1]])
        if not chosen:  # a budget of 0 or less still makes a prompt: the cheapest word
            chosen.append(int(np.argmin(self.costs)))
        return [str(w) for w in self.words[chosen]]

    def fit(self, words: list[str], render: Callable[[list[str]], str], measure: Callable[[str], int],
            target: int, rng: np.random.Generator) -> tuple[str, int]:
        """Count render(words); drop words from the end or add some until it counts target."""
        text = render(words)
        got = measure(text)
        for _ in range(_FIT_ROUNDS):
            if got == target:
                break
            words = self._resize(words, got - target, rng)
            text = render(words)
            got = measure(text)
        return text, got

    def _resize(self, words: list[str], excess: int, rng) -> list[str]:
        if excess < 0:
            return words + self.pick(-excess, rng)
        words, dropped = list(words), 0
        while len(words) > 1 and dropped < excess:
            dropped += self._cost_of[words.pop()]
        return words + (self.pick(dropped - excess, rng) if dropped > excess else [])


def _join(head: str, text: str) -> str:
    return f"{head} {text}" if head and text else head or text


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


def _load_tokenizer(tokenizer_dir: str | Path):
    from tokenizers import Tokenizer as HfTokenizer

    path = Path(tokenizer_dir)
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"--tokenizer: no tokenizer.json at {path}; pass a Hugging Face tokenizer directory")
    return HfTokenizer.from_file(str(path)), path
