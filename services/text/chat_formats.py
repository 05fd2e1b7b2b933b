"""Which tool-call syntax and which reasoning block a model's answers use, read from its chat
template (and model type) once, where the tokenizer is loaded: the gateway with --text-in-gateway,
else the tokenizer services, which advertise it in their registry records. The gateway's
--tool-call-parser auto and --reasoning-parser auto take these.
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from services.text.chat_template import ChatTemplateError

# markers a chat template writes when it renders tool calls, most specific first
_TOOL_MARKERS = (("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"))
_TOOL_FORMAT_OF_MODEL_TYPE = {"qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
                              "llama": "llama3_json", "mistral": "mistral", "mixtral": "mistral"}
THINK = "<think>"


class ChatFormats(NamedTuple):
    tool_call_parser: str     # hermes, llama3_json, mistral or none
    reasoning_parser: str     # qwen3, deepseek_r1 or none


NO_FORMATS = ChatFormats("none", "none")


def _sources(template: str | Mapping[str, str] | None) -> list[str]:
    return [template] if isinstance(template, str) else list((template or {}).values())


def tool_call_format(template: str | Mapping[str, str] | None, model_type: str) -> str:
    """The syntax of a model's calls: what its chat template writes, else its model type's."""
    sources = _sources(template)
    for marker, name in _TOOL_MARKERS:
        if any(marker in s for s in sources):
            return name
    return _TOOL_FORMAT_OF_MODEL_TYPE.get(model_type, "none")


def reasoning_format(template: str | Mapping[str, str] | None, generation_prompt: str) -> str:
    """A template that writes `<think>` thinks: qwen3 when the answer opens the block itself,
    deepseek_r1 when the generation prompt (a one-message chat's) already opened it."""
    if not any(THINK in s for s in _sources(template)):
        return "none"
    return "deepseek_r1" if generation_prompt.rstrip().endswith(THINK) else "qwen3"


def chat_formats(tok: Any) -> ChatFormats:
    """The formats of a loaded TextTokenizer's model."""
    template = tok.chat_template
    if template is None:
        return NO_FORMATS
    try:
        prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    except ChatTemplateError:
        prompt = ""
    return ChatFormats(tool_call_format(template, tok.model_type), reasoning_format(template, prompt))
