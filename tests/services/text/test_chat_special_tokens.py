"""add_special_tokens on a chat (vLLM's, default false): the tokenizer's special tokens on top of
what the chat template writes."""
from __future__ import annotations

from services.protocol.messages import ChatMessage, TokenizeRequest
from services.text.requests import tokenize
from services.text.tokenizer import load_tokenizer
from text_fixtures import build_tokenizer_dir

CHAT = [ChatMessage(role="user", content="Hello, world!")]


def test_chat_special_tokens_add_the_tokenizers_bos_to_the_rendered_chat(tmp_path):
    tok = load_tokenizer(build_tokenizer_dir(tmp_path / "m", extra_config={"add_bos_token": True}))
    plain = tokenize(tok, TokenizeRequest(messages=CHAT))
    assert plain[0] != tok.bos_token_id
    assert tokenize(tok, TokenizeRequest(messages=CHAT, chat_special_tokens=True)) == [tok.bos_token_id, *plain]
