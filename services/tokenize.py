"""Tokenize: a TokenizeRequest (plain prompt, client token ids, or chat messages) -> prompt ids;
detokenize: ids -> text (the /detokenize route, /tokenize's token strings).

Shared by tokenizer_svc (the gRPC Tokenize and Detokenize methods) and the gateway's optional
in-process tokenization. Raises TokenizeError with a client-facing message (the gateway answers 400).
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any

from services.protocol.messages import DetokenizeReply, DetokenizeRequest, TokenizeRequest
from services.text.chat_template import ChatTemplateError

# shorter inputs run on the event loop (a thread hop costs more than they do); longer ones in a thread
INLINE_CHARS = 4096  # prompt characters (tokenize)
INLINE_IDS = 4096    # token ids (detokenize)
MAX_DETOKENIZE_IDS = 1 << 20


class TokenizeError(ValueError):
    """The prompt cannot be tokenized; the message says what to change."""


def tokenize(tok: Any, req: TokenizeRequest) -> list[int]:
    given = [req.prompt is not None, req.prompt_token_ids is not None, req.messages is not None]
    if sum(given) != 1:
        raise TokenizeError("give exactly one of prompt, prompt token ids or messages")
    if req.messages is not None:
        messages = [{k: v for k, v in (("role", m.role), ("content", m.content), ("name", m.name),
                                       ("tool_calls", m.tool_calls), ("tool_call_id", m.tool_call_id))
                     if v is not None} for m in req.messages]
        try:
            ids = tok.encode_chat(messages, add_generation_prompt=req.add_generation_prompt, tools=req.tools)
        except ChatTemplateError as exc:
            raise TokenizeError(str(exc)) from None
    elif req.prompt is not None:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        ids = list(req.prompt_token_ids or [])
        vocab = tok.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise TokenizeError(f"prompt token ids must be in [0, {vocab})")
    if not ids:
        raise TokenizeError("the prompt is empty")
    return ids


def prompt_chars(req: TokenizeRequest) -> int:
    return len(req.prompt or "") + sum(len(m.content or "") for m in (req.messages or ()))


def detokenize(tok: Any, req: DetokenizeRequest) -> DetokenizeReply:
    """/detokenize's text (and /tokenize's token strings); ids outside the vocabulary are refused."""
    vocab = tok.vocab_size
    if len(req.token_ids) > MAX_DETOKENIZE_IDS:
        raise TokenizeError(f"at most {MAX_DETOKENIZE_IDS} token ids")
    if any(not 0 <= t < vocab for t in req.token_ids):
        raise TokenizeError(f"token ids must be in [0, {vocab})")
    strs = [tok.id_to_token(t) or "" for t in req.token_ids] if req.token_strs else None
    return DetokenizeReply(text=tok.decode(req.token_ids, skip_special_tokens=req.skip_special_tokens),
                           token_strs=strs)


async def tokenize_off_loop(tok: Any, req: TokenizeRequest, executor: Executor | None = None) -> list[int]:
    """tokenize, in `executor` (None: asyncio's default) unless the prompt is short (INLINE_CHARS)."""
    if prompt_chars(req) <= INLINE_CHARS:
        return tokenize(tok, req)
    return await asyncio.get_running_loop().run_in_executor(executor, tokenize, tok, req)


async def detokenize_off_loop(tok: Any, req: DetokenizeRequest, executor: Executor | None = None) -> DetokenizeReply:
    """detokenize, in `executor` (None: asyncio's default) unless the id list is short (INLINE_IDS)."""
    if len(req.token_ids) <= INLINE_IDS:
        return detokenize(tok, req)
    return await asyncio.get_running_loop().run_in_executor(executor, detokenize, tok, req)
