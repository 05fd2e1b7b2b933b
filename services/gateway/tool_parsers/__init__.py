"""Tool-call parsers, one module per model family's call syntax (base.py says how they work):

    hermes        <tool_call>{"name": ..., "arguments": ...}</tool_call>      Qwen2.5 / Qwen3, Hermes
    llama3_json   {"name": ..., "parameters": ...}; {...}                   Llama 3.1 / 3.2
    mistral       [TOOL_CALLS][{...}] or [TOOL_CALLS]name[ARGS]{...}        Mistral
    forced.py     the JSON a forced tool_choice constrains the answer to

`tool_format(name, tool_names)` makes one answer's scanner (--tool-call-parser auto takes the
name services/text/chat_formats.py reads from the model's chat template).
"""
from __future__ import annotations

from services.gateway.tool_parsers.base import (
    Parsed, StreamingParser, StreamStep, ToolCall, ToolCallDelta, ToolFormat, parse)
from services.gateway.tool_parsers.forced import NamedFormat, RequiredFormat
from services.gateway.tool_parsers.hermes import HermesFormat
from services.gateway.tool_parsers.llama3_json import Llama3JsonFormat
from services.gateway.tool_parsers.mistral import MistralFormat

FORMATS: dict[str, type[ToolFormat]] = {"hermes": HermesFormat, "llama3_json": Llama3JsonFormat,
                                        "mistral": MistralFormat}


def tool_format(name: str, tool_names: frozenset[str]) -> ToolFormat:
    return FORMATS[name](tool_names)


__all__ = ["FORMATS", "NamedFormat", "Parsed", "RequiredFormat", "StreamStep", "StreamingParser",
           "ToolCall", "ToolCallDelta", "ToolFormat", "parse", "tool_format"]
