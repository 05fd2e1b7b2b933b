"""continue_final_message (vLLM's, transformers'): the chat rendered open after the last message."""
from __future__ import annotations

import pytest

from services.protocol.messages import ChatMessage, TokenizeRequest
from services.text.requests import TokenizeError, open_final_message, tokenize

CHAT = [ChatMessage(role="user", content="Name a colour."), ChatMessage(role="assistant", content="The colour is")]


def test_the_prompt_ends_with_the_last_messages_content(tok):
    whole = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in CHAT],
                                    add_generation_prompt=False)
    assert not whole.endswith("The colour is")               # the template closes the turn
    ids = tokenize(tok, TokenizeRequest(messages=CHAT, add_generation_prompt=False, continue_final_message=True))
    assert tok.decode(ids, skip_special_tokens=False) == whole[:whole.rindex("The colour is") + len("The colour is")]


def test_the_last_occurrence_is_cut_after_and_a_missing_one_is_refused():
    assert open_final_message("<u>ab</u><a>ab</a>", "ab") == "<u>ab</u><a>ab"
    assert open_final_message("<a>ab</a>", "ab  ") == "<a>ab"           # transformers retries it stripped
    with pytest.raises(TokenizeError, match="invalid continue_final_message"):
        open_final_message("<a>xy</a>", "ab")
