"""truncate_prompt_tokens (vLLM's): the prompt's last k tokens, whatever route made them."""
from __future__ import annotations

import pytest

from services.gateway.text_path import prompt_error
from services.protocol.messages import ChatMessage, TokenizeRequest
from services.text.requests import TokenizeError, tokenize, tokenize_off_loop

TEXT = "the quick brown fox jumps over the lazy dog " * 4


def test_the_last_k_tokens_of_text_ids_and_chat(tok):
    whole = tokenize(tok, TokenizeRequest(prompt=TEXT))
    assert tokenize(tok, TokenizeRequest(prompt=TEXT, truncate_prompt_tokens=5)) == whole[-5:]
    assert tokenize(tok, TokenizeRequest(prompt_token_ids=whole, truncate_prompt_tokens=3)) == whole[-3:]
    assert tokenize(tok, TokenizeRequest(prompt=TEXT, truncate_prompt_tokens=10_000)) == whole   # shorter: all
    msgs = [ChatMessage(role="user", content=TEXT)]
    chat = tokenize(tok, TokenizeRequest(messages=msgs))
    assert tokenize(tok, TokenizeRequest(messages=msgs, truncate_prompt_tokens=7)) == chat[-7:]


async def test_a_prompt_longer_than_the_context_fits_once_truncated(tok):
    whole = tokenize(tok, TokenizeRequest(prompt=TEXT))
    limit = len(whole) // 2
    with pytest.raises(TokenizeError, match="maximum context length"):
        await tokenize_off_loop(tok, TokenizeRequest(prompt=TEXT, max_prompt_tokens=limit))
    got = await tokenize_off_loop(tok, TokenizeRequest(prompt=TEXT, max_prompt_tokens=limit, truncate_prompt_tokens=-1))
    assert got == whole[-limit:]
    got = await tokenize_off_loop(tok, TokenizeRequest(prompt=TEXT, max_prompt_tokens=limit, truncate_prompt_tokens=4))
    assert got == whole[-4:]


def test_more_than_the_context_length_is_refused_naming_the_field(tok):
    req = TokenizeRequest(prompt=TEXT, max_prompt_tokens=8, truncate_prompt_tokens=9)
    with pytest.raises(TokenizeError) as info:
        tokenize(tok, req)
    err = prompt_error(req, info.value)
    assert (err.status, err.param) == (400, "truncate_prompt_tokens") and "[1, 8]" in err.message
