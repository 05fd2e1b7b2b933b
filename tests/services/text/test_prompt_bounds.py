"""prompt_bounds: the character bound holds (no text has more characters than tokens x K) where it
is claimed, is withheld where a tokenizer can drop or merge text, and the token-count bound stops
an encode before its ids are made."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from text_fixtures import CORPUS

from services.protocol.messages import ChatMessage, TokenizeRequest
from services.text.prompt_bounds import TooManyTokens, max_token_chars
from services.text.requests import PromptTooLong, TokenizeError, tokenize


def _texts() -> list[str]:
    rng = random.Random(7)
    alphabet = "".join(CORPUS) + " \n\t" * 20 + "ṩᾇ\u0301\u0313\u0342\u0345" + "  " * 50
    out = [rng.choice(CORPUS) * rng.randint(1, 5) for _ in range(20)]
    out += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000))) for _ in range(60)]
    out += [" " * 5000, "a" * 5000, "\n" * 3000, "-" * 4000]
    return out


def test_no_text_has_more_characters_than_its_tokens_allow(tok):
    k = tok.max_token_chars
    assert k is not None and k >= max(len(t) for t in tok._tok.get_vocab(with_added_tokens=True))
    for text in _texts():
        ids = tok.encode(text, add_special_tokens=False)
        assert len(text) <= len(ids) * k, (len(text), len(ids), k)


def _bpe(**kw) -> Tokenizer:
    return Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "[UNK]": 2}, merges=[], **kw))


@pytest.mark.parametrize("make, why", [
    (lambda: Tokenizer(models.WordPiece(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]")), "a word becomes one [UNK]"),
    (lambda: _bpe(unk_token="[UNK]", fuse_unk=True), "unknown runs fuse into one token"),
    (lambda: _bpe(), "with no unknown token, what the vocabulary lacks is dropped"),
])
def test_no_bound_where_a_model_maps_unknown_text_to_one_token(make, why):
    assert max_token_chars(make()) is None, why


def test_a_bound_where_every_character_reaches_a_token():
    assert max_token_chars(_bpe(unk_token="[UNK]")) == 5          # one [UNK] per unknown character
    assert max_token_chars(_bpe(byte_fallback=True)) == 5


def test_no_bound_where_a_step_drops_text():
    tok = _bpe(byte_fallback=True)
    tok.pre_tokenizer = pre_tokenizers.Whitespace()          # whitespace vanishes
    assert max_token_chars(tok) is None
    tok = _bpe(byte_fallback=True)
    tok.normalizer = normalizers.Strip()                     # so does leading and trailing space
    assert max_token_chars(tok) is None
    tok = _bpe(byte_fallback=True)
    tok.normalizer = normalizers.Sequence([normalizers.Replace(" ", "")])
    assert max_token_chars(tok) is None


def test_composition_widens_the_bound():
    tok = _bpe(byte_fallback=True)
    plain = max_token_chars(tok)
    tok.normalizer = normalizers.NFC()
    assert max_token_chars(tok) == 4 * plain   # alpha + 3 marks compose to one character (U+1F87)


def test_the_count_bound_stops_before_the_ids_are_made(tok):
    text = CORPUS[0] * 200                       # long enough to encode in pieces
    n = len(tok.encode(text))
    assert tok.encode(text, max_tokens=n) == tok.encode(text)
    with pytest.raises(TooManyTokens) as err:
        tok.encode(text, max_tokens=n - 1)
    assert err.value.count == n


def test_tokenize_names_the_bound_that_refused(tok):
    text = CORPUS[1] * 50
    n = len(tok.encode(text))
    assert tokenize(tok, TokenizeRequest(prompt=text, max_prompt_tokens=n)) == tok.encode(text)
    with pytest.raises(PromptTooLong, match=f"the prompt has {n} tokens; .* maximum context length is {n - 1}"):
        tokenize(tok, TokenizeRequest(prompt=text, max_prompt_tokens=n - 1))
    tiny = len(text) // tok.max_token_chars - 1   # so few tokens that the characters alone cannot fit
    with pytest.raises(PromptTooLong, match="characters"):
        tokenize(tok, TokenizeRequest(prompt=text, max_prompt_tokens=tiny))
    chat = TokenizeRequest(messages=[ChatMessage(role="user", content=text)], max_prompt_tokens=tiny)
    with pytest.raises(PromptTooLong, match="characters"):
        tokenize(tok, chat)
    # unbounded without a context length
    assert tokenize(tok, TokenizeRequest(prompt=text)) == tok.encode(text)
    assert issubclass(PromptTooLong, TokenizeError)
