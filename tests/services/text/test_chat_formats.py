"""--tool-call-parser auto and --reasoning-parser auto: what a model's chat template and type say."""
from __future__ import annotations

from pathlib import Path

from services.text.chat_formats import ChatFormats, chat_formats, reasoning_format, tool_call_format
from services.text.tokenizer import load_tokenizer
from text_fixtures import build_tokenizer_dir

QWEN3_TOOLS = (Path(__file__).resolve().parents[2] / "integration" / "templates" / "qwen3_tools.jinja").read_text()


def test_tool_call_format():
    assert tool_call_format("{{ '<tool_call>' }}", "llama") == "hermes"
    assert tool_call_format({"default": "x", "tool_use": "[TOOL_CALLS]"}, "") == "mistral"
    assert tool_call_format("{{ '<|python_tag|>' }}", "") == "llama3_json"
    assert tool_call_format("plain", "qwen3") == "hermes"
    assert tool_call_format("plain", "llama") == "llama3_json"
    assert tool_call_format(None, "gpt2") == "none"


def test_reasoning_format():
    assert reasoning_format("no thinking here", "<|im_start|>assistant\n") == "none"
    assert reasoning_format("{{ '<think>' }}", "<|im_start|>assistant\n") == "qwen3"
    assert reasoning_format("{{ '<think>' }}", "<|im_start|>assistant\n<think>\n") == "deepseek_r1"


def test_chat_formats_of_a_model_directory(tmp_path):
    plain = build_tokenizer_dir(tmp_path / "p")
    (plain / "config.json").write_text('{"model_type": "llama"}')
    assert chat_formats(load_tokenizer(plain)) == ChatFormats("llama3_json", "none")
    assert chat_formats(load_tokenizer(build_tokenizer_dir(tmp_path / "q", chat_template=QWEN3_TOOLS))) == \
        ChatFormats("hermes", "qwen3")
    opened = QWEN3_TOOLS.replace("{{- '<|im_start|>assistant\\n' }}\n{%- if enable", "{{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- if enable")
    assert opened != QWEN3_TOOLS
    assert chat_formats(load_tokenizer(build_tokenizer_dir(tmp_path / "r", chat_template=opened))).reasoning_parser == "deepseek_r1"
    assert chat_formats(load_tokenizer(build_tokenizer_dir(tmp_path / "n", chat_template=None))) == ChatFormats("none", "none")
