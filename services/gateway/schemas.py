"""OpenAI request bodies, decoded and bounded; each problem becomes an ApiError (400) naming the field.

Unknown fields are ignored (clients send `store`, `metadata`...); wrong types and values
out of range are refused. Decoding is msgspec (typed, fast, with a recursion limit).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec

from services.gateway.json_errors import explain
from services.gateway.structured import (
    ConstraintError, ConstraintFields, SchemaPart, check_constraint, constraint_field, structured_output)
from services.protocol.messages import ChatMessage, TokenizeRequest
from services.protocol.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams, SamplingParamsError
from services.text.requests import TokenizeError, check_template_kwargs

MAX_CACHE_SALT = 256
MAX_PRIORITY = 1 << 31
MAX_CHOICES = 128
MAX_CLIENT_REQUEST_ID = 128
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]+")


class ApiError(Exception):
    """An error answered to the client: HTTP status + OpenAI error object."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int = 0) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def param_of(message: str) -> str | None:
    """The field a SamplingParamsError names ("invalid <field>: why"), wherever it was raised."""
    m = re.match(r"invalid ([a-z_]+): ", message)
    return m.group(1) if m else None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessageIn(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None


class _Common(ConstraintFields, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # extensions (vLLM names)
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False   # the matched stop string stays in the text
    allowed_token_ids: list[int] | None = None  # sampling masks every other token
    bad_words: list[str] | None = None          # each word's last token is masked after the rest of it
    truncate_prompt_tokens: int | None = None   # keep the prompt's last k tokens (-1: the context length)
    best_of: int | None = None                  # vLLM's: must equal n (kvmesh returns every sample)
    priority: int = 0
    cache_salt: str | None = None
    # kvmesh's: false decodes this request one token a step on a worker that speculates (vLLM has
    # no per-request switch)
    speculative: bool = True
    # OpenAI's end-user id, and an extension naming one conversation of it: either routes the
    # request where the conversation's last turn ran (conversation.py); never logged or a label
    user: str | None = None
    conversation_id: str | None = None
    # vLLM's: each prompt token's logprob given its prefix and this many top alternatives, in the
    # answer's `prompt_logprobs` (not streamed)
    prompt_logprobs: int | None = None


class ChatRequest(_Common, kw_only=True):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None          # checked with the tools: services/gateway/tools.py
    parallel_tool_calls: bool = True  # false: at most one call an answer (OpenAI's)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None   # vLLM's: template variables (enable_thinking...)
    continue_final_message: bool = False    # vLLM's: the last message rendered open, continued by the answer
    add_special_tokens: bool = False        # vLLM's: the tokenizer's bos/eos on top of the template's
    echo: bool = False                      # vLLM's: the answer begins with the last message when of its role
    include_reasoning: bool = True          # vLLM's: false answers without reasoning_content


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]          # str, [str], [int] or [[int]]: checked in completion_prompts
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class TokenizeBody(msgspec.Struct, kw_only=True):
    """POST /tokenize (vLLM's): a completion prompt, or chat messages rendered with the template as
    the chat route renders them (its fields, defaults and 400s)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool | None = None   # vLLM's defaults: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeBody(msgspec.Struct, kw_only=True):
    """POST /detokenize (vLLM's)."""
    model: str | None = None
    tokens: list[int]


_decoders = {cls: msgspec.json.Decoder(cls) for cls in (ChatRequest, CompletionRequest, TokenizeBody,
                                                         DetokenizeBody)}


def tokenize_request(body: TokenizeBody, max_messages: int) -> TokenizeRequest:
    if (body.prompt is None) == (body.messages is None):
        raise bad("give exactly one of prompt or messages", "prompt")
    if body.messages is None:
        return TokenizeRequest(prompt=body.prompt, add_special_tokens=body.add_special_tokens is not False)
    if not body.messages:
        raise bad("messages must not be empty", "messages")
    if len(body.messages) > max_messages:
        raise bad(f"at most {max_messages} messages per request", "messages")
    check_continuation(body.continue_final_message, body.add_generation_prompt)
    return TokenizeRequest(messages=chat_messages(body.messages), add_generation_prompt=body.add_generation_prompt,
                           tools=body.tools, chat_template_kwargs=template_kwargs(body.chat_template_kwargs),
                           continue_final_message=body.continue_final_message,
                           chat_special_tokens=bool(body.add_special_tokens))


def check_continuation(continue_final_message: bool, add_generation_prompt: bool) -> None:
    """vLLM's rule: the last message cannot be continued after a generation prompt opened a new one."""
    if continue_final_message and add_generation_prompt:
        raise bad("cannot set both continue_final_message and add_generation_prompt to true; send "
                  "add_generation_prompt: false to continue the last message", "continue_final_message")


def decode(cls: type, body: bytes) -> Any:
    try:
        return _decoders[cls].decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        if "at `$." in text:
            param = text.rsplit("at `$.", 1)[1].rstrip("`")
        elif (m := re.search(r"missing required field `(\w+)`", text)):
            param = m.group(1)
        else:
            param = None
        raise bad(f"invalid request body: {text}", param) from None
    except msgspec.DecodeError as exc:
        if (found := explain(body)) is not None:
            raise bad(found.message, found.param) from None
        raise bad(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad("the JSON body is nested too deeply") from None


def client_request_id(value: str | None) -> str | None:
    """The client's X-Request-Id, checked before it is echoed back (vLLM echoes it). It only labels
    the response: internal request ids are always the gateway's own."""
    if value is None:
        return None
    if len(value) > MAX_CLIENT_REQUEST_ID or not _CLIENT_REQUEST_ID.fullmatch(value):
        raise bad(f"the X-Request-Id header must be 1 to {MAX_CLIENT_REQUEST_ID} characters of "
                  "A-Z a-z 0-9 . _ : / + = -", "X-Request-Id")
    return value


MAX_TRUNCATE_PROMPT_TOKENS = 2**31 - 1    # a context length bounds it in use (services/text/requests.py)


def check_best_of(req: _Common) -> None:
    """vLLM's best_of must equal n: best_of > n would return the best n of more samples."""
    if req.best_of is not None and req.best_of != req.n:
        raise bad("best_of must equal n", "best_of")


def truncation(req: _Common) -> int:
    """truncate_prompt_tokens for the TokenizeRequest (0: none); past the context length the
    tokenizer refuses it, naming the field."""
    k = req.truncate_prompt_tokens
    if k is None:
        return 0
    if not (k == -1 or 1 <= k <= MAX_TRUNCATE_PROMPT_TOKENS):
        raise bad(f"invalid truncate_prompt_tokens: must be -1 (the context length) or at least 1, got {k}",
                  "truncate_prompt_tokens")
    return k


def check_streaming(req: _Common) -> None:
    """stream_options only means something for a streamed answer (OpenAI refuses it otherwise);
    prompt_logprobs are not streamed (vLLM refuses them with stream, as here)."""
    if req.stream_options is not None and not req.stream:
        raise bad("stream_options is only allowed when stream is true", "stream_options")
    if req.stream and req.prompt_logprobs is not None:
        raise bad("prompt_logprobs are not available when stream is true", "prompt_logprobs")


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's {"token id as a string": bias} -> {token id: bias} (bounds: SamplingParams.validate;
    ids past the vocabulary: Backend.check_vocab, with the workers' vocabulary size)."""
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad(f"invalid logit_bias: at most {MAX_LOGIT_BIAS} token ids, got {len(bias)}", "logit_bias")
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise bad(f"invalid logit_bias: keys must be token ids (decimal strings), got {key[:20]!r}",
                      "logit_bias")
        out[int(key)] = float(value)
    return out


def sampling_params(req: _Common, max_tokens: int | None, logprobs: int | None,
                    named: Mapping[str, str] | None = None) -> SamplingParams:
    """`named`: the request's own names of max_tokens and logprobs where they differ (a chat's
    max_completion_tokens, top_logprobs): its errors name the field the client sent."""
    named = named or {}
    if req.cache_salt is not None and len(req.cache_salt) > MAX_CACHE_SALT:
        raise bad(f"cache_salt must have at most {MAX_CACHE_SALT} characters", "cache_salt")
    if not -MAX_PRIORITY <= req.priority < MAX_PRIORITY:
        raise bad("priority must fit in a 32-bit signed integer", "priority")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        field = named.get("logprobs", "logprobs")
        raise bad(f"invalid {field}: must be between 0 and {MAX_LOGPROBS}, got {logprobs}", field)
    try:
        constraint = structured_output(req)
    except ConstraintError as exc:
        raise bad(str(exc), exc.param) from None
    try:
        params = SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k, min_p=req.min_p,
            repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, seed=req.seed, max_tokens=max_tokens,
            min_tokens=req.min_tokens, stop=_stop_list(req.stop), stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos, logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output, prompt_logprobs=req.prompt_logprobs,
            allowed_token_ids=req.allowed_token_ids, bad_words=list(req.bad_words or []),
            logit_bias=_logit_bias(req.logit_bias), structured=constraint[0] if constraint else None,
            speculative=req.speculative)
        params.validate()
    except SamplingParamsError as exc:
        message, field = str(exc), param_of(str(exc))
        if field in named:
            message, field = message.replace(f"invalid {field}", f"invalid {named[field]}", 1), named[field]
        raise bad(message, field) from None
    return params


async def check_request_constraint(req: _Common, params: SamplingParams, parts: tuple[SchemaPart, ...] = ()) -> None:
    """The grammar check of a constrained request (services/gateway/structured.py), off the event
    loop; `parts`: the client's schemas a forced tool_choice built it from (ToolPlan.schema_parts)."""
    if params.structured is None:
        return
    try:
        await check_constraint(params.structured, constraint_field(req), parts)
    except ConstraintError as exc:
        raise bad(str(exc), exc.param) from None


def chat_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise bad("only text content parts are supported", f"messages[{i}].content")
            content = "".join(p.text or "" for p in content)
        out.append(ChatMessage(role=m.role, content=content, name=m.name, tool_calls=_read_arguments(m.tool_calls, i),
                               tool_call_id=m.tool_call_id))
    return out


def _read_arguments(calls: list[dict] | None, i: int) -> list[dict] | None:
    """A turn's tool_calls with each call's `arguments` JSON text read into its value, as vLLM gives
    them to chat templates: they write `arguments | tojson`, which would quote a string twice."""
    if not calls:
        return calls
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            text = fn["arguments"]
            try:   # msgspec, as the body: no NaN or Infinity, numbers in range
                value = msgspec.json.decode(text) if text.strip() else {}
            except (msgspec.DecodeError, RecursionError):
                raise bad("a tool call's arguments must be JSON text (OpenAI's `arguments` string)",
                          f"messages[{i}].tool_calls[{j}].function.arguments") from None
            call = {**call, "function": {**fn, "arguments": value}}
        out.append(call)
    return out


def chat_prompt(req: ChatRequest, max_messages: int) -> tuple[TokenizeRequest, SamplingParams]:
    if not req.messages:
        raise bad("messages must not be empty", "messages")
    if len(req.messages) > max_messages:
        raise bad(f"at most {max_messages} messages per request", "messages")
    check_best_of(req)
    check_streaming(req)
    messages = chat_messages(req.messages)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    # OpenAI's chat names: max_completion_tokens (the newer one, when sent) and top_logprobs
    named = {"logprobs": "top_logprobs",
             **({"max_tokens": "max_completion_tokens"} if req.max_completion_tokens is not None else {})}
    params = sampling_params(req, max_tokens, logprobs, named)
    check_continuation(req.continue_final_message, req.add_generation_prompt)
    return TokenizeRequest(messages=messages, add_generation_prompt=req.add_generation_prompt,
                           tools=req.tools, chat_template_kwargs=template_kwargs(req.chat_template_kwargs),
                           truncate_prompt_tokens=truncation(req),
                           continue_final_message=req.continue_final_message,
                           chat_special_tokens=req.add_special_tokens), params


def chat_echo(req: ChatRequest) -> str:
    """vLLM's chat echo: the answer's role is the assistant's, or with add_generation_prompt false the
    last message's; the last message's content when it has that role (text parts joined by lines)."""
    last = req.messages[-1]
    role = "assistant" if req.add_generation_prompt else last.role
    if not req.echo or last.role != role or not last.content:
        return ""
    if isinstance(last.content, list):
        return "\n".join(p.text or "" for p in last.content)
    return last.content


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    try:
        check_template_kwargs(kwargs)
    except TokenizeError as exc:
        raise bad(str(exc), "chat_template_kwargs") from None
    return kwargs or None


def thinking(req: ChatRequest) -> bool:
    """False when the client told the template not to think (chat_template_kwargs.enable_thinking)."""
    return (req.chat_template_kwargs or {}).get("enable_thinking") is not False


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def completion_prompts(req: CompletionRequest, max_prompts: int) -> tuple[list[TokenizeRequest], SamplingParams]:
    """The prompts and their sampling. echo (vLLM's, OpenAI's legacy): each answer begins with its
    prompt, with logprobs its prompt's tokens' (the engine makes them: prompt_logprobs = logprobs,
    unless the request set prompt_logprobs); max_tokens 0 with echo answers the prompt alone (one
    token is drawn and dropped: echo_only)."""
    if req.suffix:
        raise bad("suffix is not supported", "suffix")
    check_best_of(req)
    check_streaming(req)
    p = req.prompt
    k = truncation(req)
    if isinstance(p, str):
        prompts = [TokenizeRequest(prompt=p, truncate_prompt_tokens=k)]
    elif p and all(_is_int(x) for x in p):
        prompts = [TokenizeRequest(prompt_token_ids=list(p), truncate_prompt_tokens=k)]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [TokenizeRequest(prompt=x, truncate_prompt_tokens=k) for x in p]
    elif p and all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in p):
        prompts = [TokenizeRequest(prompt_token_ids=list(x), truncate_prompt_tokens=k) for x in p]
    else:
        raise bad("prompt must be a non-empty string, list of strings, or list of token ids", "prompt")
    if len(prompts) > max_prompts:
        raise bad(f"at most {max_prompts} prompts per request", "prompt")
    if len(prompts) * req.n > MAX_CHOICES:
        raise bad(f"prompts x n must be at most {MAX_CHOICES}", "n")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    params = sampling_params(req, 1 if echo_only(req) else max_tokens, req.logprobs)
    if req.echo and req.logprobs is not None and params.prompt_logprobs is None:
        params = msgspec.structs.replace(params, prompt_logprobs=req.logprobs)
    return prompts, params


def echo_only(req: CompletionRequest) -> bool:
    """echo with max_tokens 0: the answer is the prompt alone (vLLM's echo without generation)."""
    return req.echo and req.max_tokens == 0


def echo_ids(req: CompletionRequest) -> list[list[int]] | None:
    """An echoing request's token-id prompts, as the engine gets them (truncate_prompt_tokens
    applied): their text is the detokenizer's. None for text prompts (echoed as sent)."""
    p = req.prompt
    if isinstance(p, str) or not p or isinstance(p[0], str):
        return None
    lists = [list(p)] if _is_int(p[0]) else [list(x) for x in p]
    k = req.truncate_prompt_tokens
    return [ids[-k:] for ids in lists] if k is not None and k > 0 else lists
