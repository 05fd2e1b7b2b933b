"""Tokenize: a TokenizeRequest (plain prompt, client token ids, or chat messages) -> prompt ids;
detokenize: ids -> text (the /detokenize route, /tokenize's token strings).

Shared by tokenizer_svc (the gRPC Tokenize and Detokenize methods) and the gateway's local text
path. Raises TokenizeError with a client-facing message (the gateway answers 400).
"""
from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import Executor
from typing import Any

import msgspec

from services.protocol.messages import DetokenizeReply, DetokenizeRequest, TokenizeRequest
from services.protocol.sampling import MAX_BAD_WORD_LEN, MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS
from services.text.chat_template import ChatTemplateError
from services.text.prompt_bounds import TooManyTokens

# shorter inputs run on the event loop (a thread hop costs more than they do); longer ones in a thread
INLINE_CHARS = 4096  # prompt characters (tokenize)
INLINE_IDS = 4096    # token ids (detokenize)
MAX_DETOKENIZE_IDS = 1 << 20
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_BYTES = 16 * 1024
_TEMPLATE_KWARG = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
# what render_chat itself passes to a template: a client cannot replace them
_RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "limits", "template",
                              "template_name"})


class TokenizeError(ValueError):
    """The prompt cannot be tokenized; the message says what to change."""


class PromptTooLong(TokenizeError):
    """The prompt cannot fit the model's context (req.max_prompt_tokens), by its characters or tokens."""


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """chat_template_kwargs: a few named JSON values the template reads (enable_thinking...)."""
    if not kwargs:
        return
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise TokenizeError(f"invalid chat_template_kwargs: at most {MAX_TEMPLATE_KWARGS} entries")
    for key in kwargs:
        if not isinstance(key, str) or not _TEMPLATE_KWARG.fullmatch(key) or key in _RESERVED_KWARGS:
            raise TokenizeError(f"invalid chat_template_kwargs: {str(key)[:64]!r} is not a name a template may be "
                                f"given (a letter, then letters, digits or _; not {', '.join(sorted(_RESERVED_KWARGS))})")
    try:
        size = len(json.dumps(kwargs))   # ASCII: characters are bytes
    except (ValueError, RecursionError):
        size = MAX_TEMPLATE_KWARGS_BYTES + 1
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise TokenizeError(f"invalid chat_template_kwargs: at most {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON "
                            "(and nested only a little)")


def tokenize(tok: Any, req: TokenizeRequest) -> list[int]:
    if req.truncate_prompt_tokens:
        return _truncated(tok, req)
    try:
        ids = _tokenize(tok, req)
    except TooManyTokens as exc:
        ids_count = exc.count
    else:
        ids_count = len(ids)
    if req.max_prompt_tokens and ids_count > req.max_prompt_tokens:
        raise PromptTooLong(f"the prompt has {ids_count} tokens; this model's maximum context length is "
                            f"{req.max_prompt_tokens} tokens; shorten the prompt")
    return ids


def _truncated(tok: Any, req: TokenizeRequest) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: the context length). It is
    tokenized whole, however long (the request body bounds it), then cut on the left:

        prompt ids   [ t0 t1 ... t(n-k-1) | t(n-k) ... t(n-1) ]
                       dropped              kept: k tokens
    """
    k = req.max_prompt_tokens if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
    if k < -1 or (req.max_prompt_tokens and k > req.max_prompt_tokens):
        raise TokenizeError(f"invalid truncate_prompt_tokens: must be -1 (the context length) or in [1, "
                            f"{req.max_prompt_tokens or 'the context length'}], got {req.truncate_prompt_tokens}")
    ids = _tokenize(tok, msgspec.structs.replace(req, max_prompt_tokens=0, truncate_prompt_tokens=0))
    return ids[-k:] if k > 0 else ids


def _tokenize(tok: Any, req: TokenizeRequest) -> list[int]:
    given = [req.prompt is not None, req.prompt_token_ids is not None, req.messages is not None]
    if sum(given) != 1:
        raise TokenizeError("give exactly one of prompt, prompt token ids or messages")
    check_chars(req, prompt_chars(req), tok.max_token_chars)
    if req.messages is not None:
        messages = [{k: v for k, v in (("role", m.role), ("content", m.content), ("name", m.name),
                                       ("tool_calls", m.tool_calls), ("tool_call_id", m.tool_call_id))
                     if v is not None} for m in req.messages]
        check_template_kwargs(req.chat_template_kwargs)
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                           tools=req.tools, **(req.chat_template_kwargs or {}))
        except ChatTemplateError as exc:
            raise TokenizeError(str(exc)) from None
        if req.continue_final_message:
            text = open_final_message(text, req.messages[-1].content or "")
        # the template adds text around the messages (and may repeat them): bound what it made too
        check_chars(req, len(text), tok.max_token_chars)
        # the template writes bos itself; chat_special_tokens adds the tokenizer's on top (vLLM's)
        ids = tok.encode(text, add_special_tokens=req.chat_special_tokens, max_tokens=req.max_prompt_tokens)
    elif req.prompt is not None:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens, max_tokens=req.max_prompt_tokens)
    else:
        ids = list(req.prompt_token_ids or [])
        vocab = tok.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise TokenizeError(f"prompt token ids must be in [0, {vocab})")
    if not ids:
        raise TokenizeError("the prompt is empty")
    return ids


def bad_words_token_ids(tok: Any, words: list[str]) -> list[list[int]]:
    """vLLM's SamplingParams.update_from_tokenizer: each bad word's ids as the text begins with it,
    and with a leading space (as it appears mid-text) where that encodes to as many tokens with
    another first token. The engine bans a sequence's last token once the output ends in the rest."""
    if len(words) > MAX_BAD_WORDS or any(not w.strip() or len(w) > MAX_BAD_WORD_LEN for w in words):
        raise TokenizeError(f"invalid bad_words: at most {MAX_BAD_WORDS} words of 1 to {MAX_BAD_WORD_LEN} characters")
    out: list[list[int]] = []
    for word in words:
        bare = tok.encode(word.lstrip(), add_special_tokens=False)
        spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
        for ids in (bare, spaced) if len(spaced) == len(bare) and spaced[:1] != bare[:1] else (bare,):
            if not 0 < len(ids) <= MAX_BAD_WORD_TOKENS:
                raise TokenizeError(f"invalid bad_words: each word must encode to 1 to {MAX_BAD_WORD_TOKENS} tokens")
            out.append(ids)
    return out


def open_final_message(text: str, final: str) -> str:
    """The rendered chat cut right after the last message's content (transformers' and vLLM's
    continue_final_message), so the model continues that message instead of starting a turn:

        <|user|>Hi<|end|><|assistant|>The answer is<|end|>
                                      ^^^^^^^^^^^^^ final ^ cut here: no end-of-turn
    """
    for content in (final, final.strip()):
        at = text.rfind(content)
        if at >= 0:
            return text[:at + len(content)]
    raise TokenizeError("invalid continue_final_message: the final message does not appear in the chat the "
                        "template rendered; send its content as plain text, or leave continue_final_message false")


def prompt_chars(req: TokenizeRequest) -> int:
    return len(req.prompt or "") + sum(len(m.content or "") for m in (req.messages or ()))


def check_chars(req: TokenizeRequest, chars: int, max_token_chars: int | None) -> None:
    """Refuse a prompt too long to fit before tokenizing it: no token covers more than
    max_token_chars characters (services/text/prompt_bounds.py), so at most max_prompt_tokens times
    that many can fit. Cheap: run it on the event loop, before the thread hop."""
    if not (req.max_prompt_tokens and max_token_chars):
        return
    limit = req.max_prompt_tokens * max_token_chars
    if chars > limit:
        raise PromptTooLong(
            f"the prompt has {chars} characters; this model's maximum context length is {req.max_prompt_tokens} "
            f"tokens of at most {max_token_chars} characters each, so at most {limit} characters can fit; "
            "shorten the prompt")


def detokenize(tok: Any, req: DetokenizeRequest) -> DetokenizeReply:
    """/detokenize's text (and /tokenize's token strings); ids outside the vocabulary are refused."""
    vocab = tok.vocab_size
    if len(req.token_ids) > MAX_DETOKENIZE_IDS:
        raise TokenizeError(f"at most {MAX_DETOKENIZE_IDS} token ids")
    if any(not 0 <= t < vocab for t in req.token_ids):
        raise TokenizeError(f"token ids must be in [0, {vocab})")
    strs = [tok.id_to_token(t) or "" for t in req.token_ids] if req.token_strs else None
    return DetokenizeReply(text=tok.decode_long(req.token_ids, skip_special_tokens=req.skip_special_tokens),
                           token_strs=strs)


async def tokenize_off_loop(tok: Any, req: TokenizeRequest, executor: Executor | None = None) -> list[int]:
    """tokenize, in `executor` (None: asyncio's default) unless the prompt is short (INLINE_CHARS);
    a prompt too long to fit is refused here, on the caller's loop, without tokenizing it."""
    chars = prompt_chars(req)
    if not req.truncate_prompt_tokens:      # a truncated prompt may be longer than fits
        check_chars(req, chars, tok.max_token_chars)
    if chars <= INLINE_CHARS:
        return tokenize(tok, req)
    return await asyncio.get_running_loop().run_in_executor(executor, tokenize, tok, req)


async def detokenize_off_loop(tok: Any, req: DetokenizeRequest, executor: Executor | None = None) -> DetokenizeReply:
    """detokenize, in `executor` (None: asyncio's default) unless the id list is short (INLINE_IDS)."""
    if len(req.token_ids) <= INLINE_IDS:
        return detokenize(tok, req)
    return await asyncio.get_running_loop().run_in_executor(executor, detokenize, tok, req)
