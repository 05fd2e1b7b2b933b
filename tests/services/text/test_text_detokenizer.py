"""Incremental detokenization equals a full decode, never emits half characters, stays O(window)."""
from __future__ import annotations

import random

import pytest
from text_fixtures import CORPUS, build_sentencepiece_style

from services.text.detokenizer import IncrementalDetokenizer
from services.text.tokenizer import TextTokenizer

PIECES = ["机器学习", "你好", "😀", "🎉", "👍🏽", "🇯🇵", "👨‍👩‍👧", "café", " hello", " world", "\n", "  ", "東京",
          "한국어", "…", "“q”", "1234", "!?", " the", "ñ"]


@pytest.fixture(scope="module")
def sp_tok():
    return TextTokenizer(build_sentencepiece_style(), special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


def _stream(tokenizer, ids, rng, prompt=None, skip=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt, skip_special_tokens=skip)
    out, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 7])
        out.append(detok.push(ids[i:i + n]))
        i += n
    out.append(detok.flush())
    return out


def _random_text(rng):
    return "".join(rng.choice(PIECES + [rng.choice(CORPUS)[:12]]) for _ in range(rng.randint(1, 30)))


@pytest.mark.parametrize("which", ["bpe", "sp"])
def test_valid_text_streams(tok, sp_tok, which):
    tokenizer = tok if which == "bpe" else sp_tok
    rng = random.Random(0)
    for _ in range(300):
        text = _random_text(rng)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text or which == "sp"  # SP strips one leading space
        pieces = _stream(tokenizer, ids, rng)
        assert "".join(pieces) == tokenizer.decode(ids)
        assert not any("\ufffd" in p for p in pieces), pieces


def test_split_characters_are_held_back(tok):
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # the emoji really is split over several byte tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "😀"
    assert detok.flush() == ""


def test_incomplete_character_at_end_is_flushed(tok):
    ids = tok.encode("ab😀", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tok)
    text = detok.push(ids)
    assert text + detok.flush() == tok.decode(ids)
    assert "\ufffd" not in text


@pytest.mark.parametrize("which", ["bpe", "sp"])
def test_prompt_context_matches_decoding_the_whole_sequence(tok, sp_tok, which):
    tokenizer = tok if which == "bpe" else sp_tok
    rng = random.Random(1)
    for _ in range(100):
        prompt = tokenizer.encode(_random_text(rng), add_special_tokens=False)
        out = tokenizer.encode(_random_text(rng), add_special_tokens=False)
        got = "".join(_stream(tokenizer, out, rng, prompt=prompt))
        assert got == tokenizer.decode(prompt + out)[len(tokenizer.decode(prompt)):]


def test_sentencepiece_leading_spaces(sp_tok):
    ids = sp_tok.encode("Hello world and you", add_special_tokens=False)
    detok = IncrementalDetokenizer(sp_tok)
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == "Hello world and you"
    assert any(p.startswith(" ") for p in pieces)


@pytest.mark.parametrize("skip", [True, False])
def test_random_id_streams_equal_full_decode(tok, sp_tok, skip):
    # Arbitrary ids (invalid UTF-8, special tokens): still exactly what a full decode gives.
    # SentencePiece byte fallback is excluded from the arbitrary-bytes case: it turns a whole
    # run of <0xNN> tokens into U+FFFDs when any byte in it is invalid, so later ids change
    # earlier text there (no incremental decoder can match that; valid text is covered above).
    rng = random.Random(2)
    sp_ids = [i for i in range(sp_tok.vocab_size) if not sp_tok.id_to_token(i).startswith("<0x")]
    for tokenizer, vocab in ((tok, range(tok.vocab_size)), (sp_tok, sp_ids)):
        for _ in range(300):
            ids = [rng.choice(vocab) for _ in range(rng.randint(1, 60))]
            want = tokenizer.decode(ids, skip_special_tokens=skip)
            assert "".join(_stream(tokenizer, ids, rng, skip=skip)) == want


def test_special_tokens(tok):
    ids = tok.encode("hi", add_special_tokens=False) + [tok.token_to_id("<|im_end|>")]
    for skip, want in ((True, "hi"), (False, "hi<|im_end|>")):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        assert "".join(detok.push([i]) for i in ids) + detok.flush() == want


class CountingTokenizer:
    def __init__(self, inner):
        self.inner, self.decoded = inner, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens)


def test_work_per_token_is_bounded(tok):
    # Long streams, including a long run of invalid bytes: decode work grows linearly.
    counting = CountingTokenizer(tok)
    byte_ids = [tok.token_to_id(t) for t in ("Ģ", "ģ", "Ĥ")]  # lone UTF-8 continuation bytes
    text_ids = tok.encode(" hello 你好 😀", add_special_tokens=False)
    ids = (text_ids * 200) + byte_ids * 300 + text_ids * 200
    detok = IncrementalDetokenizer(counting)
    out = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert out == tok.decode(ids)
    assert counting.decoded < 40 * len(ids)
    assert len(detok._ids) < 20
