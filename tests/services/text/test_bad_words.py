"""bad_words -> token sequences, by vLLM's rule (SamplingParams.update_from_tokenizer)."""
from __future__ import annotations

import pytest

from services.text.requests import TokenizeError, bad_words_token_ids


def test_a_word_encodes_bare_and_with_a_leading_space(tok):
    bare, spaced = tok.encode("hello", add_special_tokens=False), tok.encode(" hello", add_special_tokens=False)
    got = bad_words_token_ids(tok, ["hello", "  hello"])       # leading spaces are stripped first
    expected = [bare, spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [bare]
    assert got == expected * 2


def test_the_spaced_form_is_kept_only_when_it_has_as_many_tokens_with_another_first():
    class Tok:
        def encode(self, text, add_special_tokens=False):
            return {"ab": [1, 2], " ab": [3, 2], "cd": [4], " cd": [5, 4], "ef": [6], " ef": [6]}[text]
    assert bad_words_token_ids(Tok(), ["ab", "cd", "ef"]) == [[1, 2], [3, 2], [4], [6]]


def test_bounded(tok):
    with pytest.raises(TokenizeError, match="bad_words"):
        bad_words_token_ids(tok, ["x"] * 65)
    with pytest.raises(TokenizeError, match="bad_words"):
        bad_words_token_ids(tok, [" "])
