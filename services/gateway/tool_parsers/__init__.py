"""Tool-call parsers, one module per model family's call syntax (base.py says how they work):

    hermes        <tool_call>{"name": ..., "arguments": ...}</tool_call>      Qwen2.5 / Qwen3, Hermes
    llama3_json   {"name": ..., "parameters": ...}; {...}                   Llama 3.1 / 3.2
    mistral       [TOOL_CALLS][{...}] or [TOOL_CALLS]name[ARGS]{...}        Mistral
    forced.py     the JSON a forced tool_choice constrains the answer to

`tool_format(name, tool_names)` makes one answer's scanner; `detect` picks a name for
--tool-call-parser auto from the model's chat template and model type.
"""
from __future__ import annotations

from typing import Mapping

from services.gateway.tool_parsers.base import (
    Parsed, StreamingParser, StreamStep, ToolCall, ToolCallDelta, ToolFormat, parse)
from services.gateway.tool_parsers.forced import NamedFormat, RequiredFormat
from services.gateway.tool_parsers.hermes import HermesFormat
from services.gateway.tool_parsers.llama3_json import Llama3JsonFormat
from services.gateway.tool_parsers.mistral import MistralFormat

FORMATS: dict[str, type[ToolFormat]] = {"hermes": HermesFormat, "llama3_json": Llama3JsonFormat,
                                        "mistral": MistralFormat}
CHOICES = ("auto", *FORMATS, "none")

# markers a chat template writes when it renders tool calls, most specific first
_TEMPLATE_MARKERS = (("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"))
_MODEL_TYPES = {"qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
                "llama": "llama3_json", "mistral": "mistral", "mixtral": "mistral"}


def detect(template: str | Mapping[str, str] | None, model_type: str) -> str:
    """The format of a model's calls: from what its chat template writes, else its model type."""
    sources = [template] if isinstance(template, str) else list((template or {}).values())
    for marker, name in _TEMPLATE_MARKERS:
        if any(marker in s for s in sources):
            return name
    return _MODEL_TYPES.get(model_type, "none")


def tool_format(name: str, tool_names: frozenset[str]) -> ToolFormat:
    return FORMATS[name](tool_names)


__all__ = ["CHOICES", "FORMATS", "NamedFormat", "Parsed", "RequiredFormat", "StreamStep", "StreamingParser",
           "ToolCall", "ToolCallDelta", "ToolFormat", "detect", "parse", "tool_format"]
