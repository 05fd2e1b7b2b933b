"""Render Hugging Face chat templates in a sandbox with time and size limits.

Chat templates ship with model repositories, so they are untrusted code. Rendering follows
`transformers`' `apply_chat_template` exactly (same Jinja environment options and helpers:
`raise_exception`, `strftime_now`, HF's `tojson`, a `dict` and a `namespace` without dunder
access, the loopcontrols extension, trim_blocks + lstrip_blocks), so a model renders the same
prompt here as in `transformers`. On top of Jinja's ImmutableSandboxedEnvironment we bound
what a hostile template can cost:

- source size (`max_template_chars`) and message count/size are checked before compiling;
- time: every loop iteration and every call checks a deadline (`timeout_s`), so nested
  `range(100000)` loops or exponential macro recursion stop in time instead of hanging;
- memory: `+`, `*`, `**`, `%`, `~`, `join` and width arguments are checked before they
  allocate, and all text a render emits (also into macro and `set` buffers) is counted;
- the final prompt must be at most `max_output_chars`.

Every failure is a `ChatTemplateError` (a ValueError) whose message says what to change.
"""
from __future__ import annotations

import json
import re
import time
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache, update_wrapper
from typing import Any, Iterable, Iterator, Mapping

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_DATA_DEPTH = 32   # nesting of the messages, tools and variables a template is given


class ChatTemplateError(ValueError):
    """The chat template or the messages given to it cannot be rendered; the message says why."""


@dataclass(frozen=True)
class ChatLimits:
    max_template_chars: int = 512 * 1024
    """Largest chat template source accepted (real templates are a few KiB)."""
    max_output_chars: int = 4 * 1024 * 1024
    """Largest rendered prompt, in characters."""
    max_messages: int = 4096
    """Most messages in one conversation."""
    max_content_chars: int = 4 * 1024 * 1024
    """Most characters of message content (all messages together)."""
    timeout_s: float = 1.0
    """Wall-clock budget for one render."""


DEFAULT_LIMITS = ChatLimits()


# --------------------------------------------------------------------------------------------
# Per-render budget. Guards reach it through a ContextVar, so concurrent renders (threads or
# asyncio tasks) never share one and a template has no handle to it.

class _Budget:
    __slots__ = ("deadline", "max_chars", "emit_left", "timeout_s")

    def __init__(self, limits: ChatLimits) -> None:
        self.timeout_s = limits.timeout_s
        self.deadline = time.monotonic() + limits.timeout_s
        self.max_chars = limits.max_output_chars
        # Text may be emitted more than once (a macro's output printed twice, a `set` block
        # reused), so allow some headroom over the final limit.
        self.emit_left = 4 * limits.max_output_chars

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(
                f"chat template took longer than {self.timeout_s:g} s to render; "
                "the template probably loops too much")

    def check_len(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise ChatTemplateError(
                f"chat template built a {what} of length {n}, over the limit of {self.max_chars}")


_BUDGET: ContextVar[_Budget | None] = ContextVar("kvmesh_chat_budget", default=None)


def _budget() -> _Budget:
    budget = _BUDGET.get()
    if budget is None:  # compiled template used outside render_chat
        raise ChatTemplateError("chat templates render only through render_chat()")
    return budget


# Filters the AST rewrite inserts. pass_context keeps Jinja from constant-folding them at
# compile time (it would run them with no budget in place).

@jinja2.pass_context
def _guard_iter(_ctx: Any, iterable: Any) -> Iterator[Any]:
    budget = _budget()
    budget.tick()
    for item in iterable:
        budget.tick()
        yield item


@jinja2.pass_context
def _guard_emit(_ctx: Any, value: Any) -> str:
    text = str(value)
    budget = _budget()
    budget.emit_left -= len(text)
    if budget.emit_left < 0:
        raise ChatTemplateError(
            f"chat template output is over the limit of {budget.max_chars} characters")
    return text


@jinja2.pass_context
def _guard_concat(_ctx: Any, parts: list[Any]) -> str:
    strings = [str(p) for p in parts]
    _budget().check_len(sum(len(s) for s in strings), "string")
    return "".join(strings)


_GUARD_FILTERS = {"_kvmesh_iter": _guard_iter, "_kvmesh_emit": _guard_emit,
                  "_kvmesh_concat": _guard_concat}


def _filter(node: nodes.Expr, name: str) -> nodes.Filter:
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


class _GuardInserter(NodeTransformer):
    """Rewrites a parsed template: loops tick the budget, output and `~` are size-checked."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = _filter(node.iter, "_kvmesh_iter")
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Output:
        self.generic_visit(node)
        node.nodes = [_filter(nodes.Const(c.data, lineno=c.lineno) if isinstance(c, nodes.TemplateData)
                              else c, "_kvmesh_emit") for c in node.nodes]
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        self.generic_visit(node)
        return _filter(nodes.List(node.nodes, lineno=node.lineno), "_kvmesh_concat")


# --------------------------------------------------------------------------------------------
# The helpers transformers gives templates (transformers/utils/chat_template_utils.py).

def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Unlike Jinja's tojson: no HTML escaping, and the json.dumps options are exposed.
    if isinstance(indent, int) and indent > 64:
        raise ChatTemplateError("tojson indent is too large")
    text = json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)
    _budget().check_len(len(text), "string")
    return text


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace that refuses underscore-prefixed names (no CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed namespace attributes ({name!r})")


# --------------------------------------------------------------------------------------------
# The environment.

# A %-format or str.format width/precision of a million or more, or a width taken from the args.
_BIG_WIDTH = re.compile(r"%[-+ #0]*\.?\d{7,}|\{[^{}]*:[^{}]*\d{7,}")
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _GuardInserter().visit(super()._parse(source, name, filename))

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # Jinja returns an Undefined that fails only when used; fail at the access instead.
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__} is not allowed")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        if operator == "**":
            _check_pow(left, right)
        elif operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                    budget.check_len(len(seq) * max(count, 0), type(seq).__name__)
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                budget.check_len(len(left) + len(right), type(left).__name__)
        elif operator == "%" and isinstance(left, str):
            _check_format(left, right, budget)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget()
        budget.tick()
        target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        owner = getattr(target, "__self__", None)
        if isinstance(owner, str):
            name = getattr(target, "__name__", "")
            if name in _WIDTH_METHODS:
                _check_ints(args, kwargs, budget)
            elif name == "join" and args:
                _check_join(owner, args[0], budget)
            elif name in ("format", "format_map"):
                _check_format(owner, args + tuple(kwargs.values()), budget)
        return super().call(__context, __obj, *args, **kwargs)


def _check_pow(left: Any, right: Any) -> None:
    if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if abs(left).bit_length() * right > 4096:
            raise ChatTemplateError("chat template computes a power that is too large")


def _check_ints(args: Iterable[Any], kwargs: Mapping[str, Any], budget: _Budget) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and value > budget.max_chars:
            raise ChatTemplateError(f"chat template asks for a width of {value}, over the limit")


def _check_join(sep: str, items: Any, budget: _Budget) -> None:
    if isinstance(items, (list, tuple)):
        total = len(sep) * max(len(items) - 1, 0)
        total += sum(len(s) for s in items if isinstance(s, str))
        budget.check_len(total, "string")


def _check_format(fmt: str, args: Any, budget: _Budget) -> None:
    if _BIG_WIDTH.search(fmt):
        raise ChatTemplateError("chat template format string has a width that is too large")
    flat = args if isinstance(args, tuple) else (args,)
    _check_ints([a for a in flat if isinstance(a, int)], {}, budget)


_JINJA_JOIN = jinja2.filters.do_join


@jinja2.pass_eval_context
def _join_filter(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    items = value if isinstance(value, (list, tuple)) else list(value)
    if attribute is None:
        _check_join(str(d), [x if isinstance(x, str) else str(x) for x in items], _budget())
    return _JINJA_JOIN(eval_ctx, items, d, attribute)


def _width_guarded(filter_fn: Any) -> Any:
    """Wrap a Jinja filter so int arguments (widths) and format strings are checked first."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        _check_ints(args, kwargs, budget)
        if filter_fn is jinja2.filters.do_format and args and isinstance(args[0], str):
            _check_format(args[0], (), budget)
        return filter_fn(*args, **kwargs)
    return update_wrapper(wrapper, filter_fn)  # keeps Jinja's pass_* marker


def _make_env() -> _LimitedSandbox:
    env = _LimitedSandbox(trim_blocks=True, lstrip_blocks=True,
                          extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters.update(_GUARD_FILTERS)
    env.filters["tojson"] = _tojson
    env.filters["join"] = _join_filter
    for name in ("center", "indent", "wordwrap", "format", "truncate"):
        env.filters[name] = _width_guarded(env.filters[name])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


_ENV = _make_env()


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error on line {e.lineno}: {e.message}") from None
    except RecursionError:
        raise ChatTemplateError("chat template is nested too deeply") from None


# --------------------------------------------------------------------------------------------
# Inputs.

def validate_messages(messages: Any, limits: ChatLimits = DEFAULT_LIMITS) -> list[dict]:
    """Check an OpenAI-style message list; return plain dicts (None-valued keys dropped, as HF does).

    A message is a dict with a `role` in ROLES and `content` that is a string, None (assistant
    turns with tool calls) or a list of parts, each a dict with a string `text` when its type is
    "text". Other keys (name, tool_calls, tool_call_id, reasoning_content...) pass through as
    plain JSON data.
    """
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError("messages must be a list of {role, content} objects")
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    if len(messages) > limits.max_messages:
        raise ChatTemplateError(f"too many messages: {len(messages)} (limit {limits.max_messages})")
    total = 0
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object with role and content")
        role = msg.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        total += _content_chars(msg.get("content"), i)
        if total > limits.max_content_chars:
            raise ChatTemplateError(
                f"messages are too long: over {limits.max_content_chars} characters of content")
        out.append({str(k): _plain(v) for k, v in msg.items() if v is not None})
    return out


def _content_chars(content: Any, i: int) -> int:
    if content is None or isinstance(content, str):
        return len(content or "")
    if not isinstance(content, (list, tuple)):
        raise ChatTemplateError(f"messages[{i}].content must be a string or a list of content parts")
    n = 0
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f"messages[{i}].content[{j}] must be an object")
        if part.get("type", "text") == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatTemplateError(f"messages[{i}].content[{j}].text must be a string")
            n += len(text)
    return n


def _plain(value: Any, depth: int = 0) -> Any:
    """Rebuild a value from plain JSON types (what the sandbox may safely see)."""
    if depth > MAX_DATA_DEPTH:
        raise ChatTemplateError("message data is nested too deeply")
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, (str, int, float)):  # subclasses such as enums: strip to the base type
        return type(value).__mro__[-2](value)
    raise ChatTemplateError(f"message data of type {type(value).__name__} is not JSON")


# --------------------------------------------------------------------------------------------
# Rendering.

def render_chat(template: str, messages: Any, *, add_generation_prompt: bool = True,
                tools: list[dict] | None = None, documents: list[dict] | None = None,
                limits: ChatLimits = DEFAULT_LIMITS, **variables: Any) -> str:
    """Render `messages` with the chat template source `template`, as transformers would.

    `variables` become template variables (bos_token, eos_token, enable_thinking, ...).
    Raises ChatTemplateError for a bad template, bad messages, or a render over its limits.
    """
    if not isinstance(template, str) or not template:
        raise ChatTemplateError("this model has no chat template; pass a prompt instead of messages")
    if len(template) > limits.max_template_chars:
        raise ChatTemplateError(
            f"chat template is {len(template)} characters, over the limit of {limits.max_template_chars}")
    chat = _alias_reasoning(validate_messages(messages, limits))
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)):
        raise ChatTemplateError("tools must be a list of JSON schema objects")
    context = {k: _plain(v) for k, v in variables.items()}
    compiled = _compile(template)
    token = _BUDGET.set(_Budget(limits))
    try:
        text = compiled.render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                               add_generation_prompt=add_generation_prompt, **context)
    except ChatTemplateError:
        raise
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"chat template did something unsafe and was stopped: {e}") from None
    except jinja2.exceptions.TemplateError as e:  # raise_exception() lands here too
        raise ChatTemplateError(f"chat template failed: {e}") from None
    except OverflowError as e:  # the sandbox's range() limit
        raise ChatTemplateError(f"chat template failed: {e}") from None
    except (RecursionError, MemoryError):
        raise ChatTemplateError("chat template used too much recursion or memory") from None
    except Exception as e:  # template bugs: TypeError, KeyError... on these messages
        raise ChatTemplateError(f"chat template failed on these messages: {type(e).__name__}: {e}") from None
    finally:
        _BUDGET.reset(token)
    if len(text) > limits.max_output_chars:
        raise ChatTemplateError(
            f"rendered prompt is {len(text)} characters, over the limit of {limits.max_output_chars}")
    return text


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    # As transformers does: fill `reasoning_content` (and `thinking`, for gpt-oss) from any of the names.
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def select_template(templates: str | Mapping[str, str] | None, name: str | None = None,
                    tools: list | None = None) -> str:
    """Pick a template the way transformers does: by name, "tool_use" when tools are given, else "default"."""
    if templates is None:
        raise ChatTemplateError("this model has no chat template; pass a prompt instead of messages")
    if isinstance(templates, str):
        if name is not None and name != "default":
            raise ChatTemplateError(f"this model has no chat template named {name!r}")
        return templates
    if name is not None:
        if name not in templates:
            raise ChatTemplateError(
                f"no chat template named {name!r}; this model has {', '.join(sorted(templates))}")
        return templates[name]
    if tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise ChatTemplateError(
        f"this model has several chat templates and none is 'default'; pick one of {', '.join(sorted(templates))}")
