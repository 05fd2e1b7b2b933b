"""Where a gateway's text is made, chosen once at start-up (--text-in-gateway):

    LocalText    the gateway tokenizes prompts and turns its requests' tokens into text itself
                 (the model's tokenizer files in --model): every Submit names this gateway's inbox
                 as the detokenizer, workers send it StreamOpen / StepOutput / Abort, and no
                 tokenizer service is needed. One hop less per request and per token.
    RemoteText   the tokenizer services do both: gRPC Tokenize / Detokenize (one client), and
                 their detokenizer streams send this gateway text (TextBatch).

Both answer the routes the same way: a prompt refused gets a 400 naming the request's field
(context_length_exceeded when it cannot fit), ids outside the vocabulary on /detokenize a 400
naming `tokens`, and no way to make text a retryable 503.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import grpc
import msgspec

from services.config import REASONING_PARSERS, TOOL_CALL_PARSERS
from services.gateway.schemas import ApiError, param_of
from services.gateway.tokenizer_client import TokenizerClient, TokenizerRefused, unavailable
from services.protocol.messages import (
    Abort, DetokenizeReply, DetokenizeRequest, Migrate, StepOutput, StreamOpen, TokenizeReply, TokenizeRequest)
from services.registry import ServiceRecord
from services.security.bundle import Trust
from services.text.chat_formats import NO_FORMATS, ChatFormats, chat_formats
from services.text.streams import DetokCore
from services.text.requests import (
    PromptTooLong, TokenizeError, bad_words_token_ids, check_chars, detokenize_off_loop, prompt_chars,
    tokenize_off_loop)


# what LocalText adds to the gateway's inbox: message -> the roles that may send it (the
# scheduler aborts or moves the streams of a worker that stopped)
LOCAL_TEXT_SENDERS = {StreamOpen: ("worker",), StepOutput: ("worker",), Abort: ("worker", "scheduler"),
                      Migrate: ("scheduler",)}


def prompt_error(req: TokenizeRequest, exc: TokenizeError) -> ApiError:
    """A prompt the tokenizer refused, as a 400 naming the request's field."""
    param = param_of(str(exc)) or ("messages" if req.messages is not None else "prompt")
    code = "context_length_exceeded" if isinstance(exc, PromptTooLong) else None
    return ApiError(400, str(exc), param=param, code=code)


class TextPath(Protocol):
    detok: DetokCore | None
    """The stream core when this gateway turns tokens into text; None when services do."""

    async def tokenize(self, req: TokenizeRequest) -> TokenizeReply:
        """The prompt's ids and the address of the detokenizer that will stream its text."""

    async def token_ids(self, req: TokenizeRequest) -> list[int]:
        """The prompt's ids alone (the /tokenize route)."""

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeReply:
        """/detokenize's text and /tokenize's token strings."""

    def update(self, tokenizers: list[ServiceRecord]) -> None:
        """The live tokenizer services' records (discovery, every heartbeat)."""

    def detok_addrs(self) -> set[str]:
        """Detokenizers whose text this gateway may be waiting for: a request streamed by any
        other has lost its detokenizer."""

    def not_ready_reason(self) -> str | None:
        """Why no text can be made now, or None."""

    def formats(self) -> ChatFormats:
        """The served model's tool-call syntax and reasoning block, read from its chat template."""

    def close(self) -> None: ...


class LocalText:
    def __init__(self, model_dir: str, threads: int) -> None:
        from services.text.tokenizer import load_tokenizer
        self.tok = load_tokenizer(model_dir)
        self.detok: DetokCore | None = DetokCore(self.tok)
        self._formats = chat_formats(self.tok)
        # long prompts and id lists: off the event loop, a bounded number at once
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")
        self.inbox_addr = ""   # this gateway's inbox: the shell sets it once bound

    async def tokenize(self, req: TokenizeRequest) -> TokenizeReply:
        ids = await self.token_ids(req)
        try:
            bad = bad_words_token_ids(self.tok, req.bad_words) if req.bad_words else []
        except TokenizeError as exc:
            raise ApiError(400, str(exc), param="bad_words") from None
        return TokenizeReply(prompt_token_ids=ids, detok_addr=self.inbox_addr, vocab_size=self.tok.vocab_size,
                             bad_words_token_ids=bad)

    async def token_ids(self, req: TokenizeRequest) -> list[int]:
        try:
            return await tokenize_off_loop(self.tok, req, self.pool)
        except TokenizeError as exc:
            raise prompt_error(req, exc) from None

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeReply:
        try:
            return await detokenize_off_loop(self.tok, req, self.pool)
        except TokenizeError as exc:
            raise ApiError(400, str(exc), param="tokens") from None

    def update(self, tokenizers: list[ServiceRecord]) -> None:
        pass

    def detok_addrs(self) -> set[str]:
        return {self.inbox_addr}

    def not_ready_reason(self) -> str | None:
        return None

    def formats(self) -> ChatFormats:
        return self._formats

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class RemoteText:
    def __init__(self, trust: Trust | None, fixed_targets: list[str]) -> None:
        self.client = TokenizerClient(trust)
        self.detok: DetokCore | None = None
        self.fixed_targets = fixed_targets    # --tokenizer-addr: these, not the registry's
        self.streams: set[str] = set()        # the services' detokenizer inboxes
        self.token_chars: int | None = None   # the services' longest token, in characters
        self._formats = NO_FORMATS            # what the services read from the model's chat template
        if fixed_targets:
            self.client.set_targets(fixed_targets)

    async def tokenize(self, req: TokenizeRequest) -> TokenizeReply:
        if not self.client.stubs:
            raise unavailable()
        try:   # the service checks too; here it costs no gRPC round trip of megabytes
            if not req.truncate_prompt_tokens:
                check_chars(req, prompt_chars(req), self.token_chars)
        except PromptTooLong as exc:
            raise prompt_error(req, exc) from None
        try:
            reply = await self.client.call("Tokenize", req)
        except TokenizerRefused as exc:
            too_long = exc.status == grpc.StatusCode.OUT_OF_RANGE
            raise prompt_error(req, (PromptTooLong if too_long else TokenizeError)(str(exc))) from None
        # a tokenizer service that predates max_prompt_tokens ignores it
        if req.max_prompt_tokens and len(reply.prompt_token_ids) > req.max_prompt_tokens:
            raise prompt_error(req, PromptTooLong(
                f"the prompt has {len(reply.prompt_token_ids)} tokens; this model's maximum context length is "
                f"{req.max_prompt_tokens} tokens; shorten the prompt"))
        return reply

    async def token_ids(self, req: TokenizeRequest) -> list[int]:
        return (await self.tokenize(req)).prompt_token_ids

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeReply:
        try:
            return await self.client.call("Detokenize", req)
        except TokenizerRefused as exc:
            raise ApiError(400, str(exc), param="tokens") from None

    def update(self, tokenizers: list[ServiceRecord]) -> None:
        if not self.fixed_targets:
            self.client.set_targets([r.addrs["grpc"] for r in tokenizers if "grpc" in r.addrs])
        self.streams = {r.addrs["zmq"] for r in tokenizers if "zmq" in r.addrs}
        # they serve one model; the largest is the safe bound should one differ
        self.token_chars = max((_int_or_zero(r.info.get("max_token_chars")) for r in tokenizers), default=0) or None
        used = [r for r in tokenizers if not self.fixed_targets or r.addrs.get("grpc") in self.fixed_targets]
        if used:   # they serve one model: any one's record says its formats
            info = used[0].info
            self._formats = ChatFormats(_known(info.get("tool_call_parser"), TOOL_CALL_PARSERS),
                                        _known(info.get("reasoning_parser"), REASONING_PARSERS))

    def detok_addrs(self) -> set[str]:
        return self.streams

    def not_ready_reason(self) -> str | None:
        return None if self.client.stubs and self.streams else "no tokenizer is registered"

    def formats(self) -> ChatFormats:
        return self._formats

    def close(self) -> None:
        pass


def _int_or_zero(value: object) -> int:
    """A record's number, 0 (unknown) when it has the wrong type: one malformed record must not
    fail the gateway's whole discovery."""
    try:
        return int(value or 0)
    except (ValueError, TypeError):
        return 0


def _known(name: object, choices: tuple[str, ...]) -> str:
    """A format a tokenizer service advertises, when this gateway knows it (else: none)."""
    return name if isinstance(name, str) and name in choices and name != "auto" else "none"


def bounded(req: TokenizeRequest, max_model_len: int) -> TokenizeRequest:
    """`req` refused past the model's context length (0: unknown, unbounded)."""
    return msgspec.structs.replace(req, max_prompt_tokens=max_model_len)
