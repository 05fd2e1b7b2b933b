"""Chat templates render exactly as transformers renders them, inside a sandbox with limits."""
from __future__ import annotations

import time

import pytest
from text_fixtures import CHATML, build_tokenizer_dir

from services.text.chat_template import ChatLimits, ChatTemplateError, render_chat, validate_messages
from services.text.tokenizer import load_tokenizer

LLAMA3 = """{{- bos_token }}
{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Exercises namespace, loop.last, loopcontrols, dict(), list content parts and trim_blocks/lstrip_blocks.
FANCY = """{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m.role == 'system' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    [{{ ns.n }}] {{ m.role }}:
    {% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p.text }}{% if not loop.last %} | {% endif %}{% endfor %}{% endif %}

    {% if loop.index > 50 %}{% break %}{% endif %}
{% endfor %}
{{ dict(a=1, b='é') | tojson }}
{% if add_generation_prompt %}assistant:{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "  You are terse.  "}, {"role": "user", "content": "你好 😀"},
     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye <b>&</b>"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}],
]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

TOOL_CHAT = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
]


@pytest.fixture(scope="module")
def named_dir(tmp_path_factory):
    templates = [{"name": "default", "template": CHATML}, {"name": "llama3", "template": LLAMA3},
                 {"name": "fancy", "template": FANCY}]
    return build_tokenizer_dir(tmp_path_factory.mktemp("named") / "m", chat_template=templates)


@pytest.fixture(scope="module")
def hf_named(named_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(named_dir))


@pytest.mark.parametrize("name", ["default", "llama3", "fancy"])
@pytest.mark.parametrize("gen", [True, False])
def test_matches_transformers(named_dir, hf_named, name, gen):
    ours = load_tokenizer(named_dir)
    for chat in CONVERSATIONS:
        if name == "default" and not isinstance(chat[-1]["content"], str):
            continue  # ChatML here concatenates content as a string
        expected = hf_named.apply_chat_template(chat, chat_template=name, tokenize=False,
                                                add_generation_prompt=gen)
        got = ours.apply_chat_template(chat, add_generation_prompt=gen, template_name=name)
        assert got == expected


def test_tools_match_transformers(named_dir, hf_named):
    ours = load_tokenizer(named_dir)
    expected = hf_named.apply_chat_template(TOOL_CHAT, tools=TOOLS, chat_template="llama3", tokenize=False,
                                            add_generation_prompt=True)
    assert ours.apply_chat_template(TOOL_CHAT, tools=TOOLS, template_name="llama3") == expected
    assert '"city": "Zürich"' in expected  # tojson without ASCII escaping, as HF does


def test_default_template_and_encode_chat(tok, tok_dir):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    chat = CONVERSATIONS[1]
    assert tok.apply_chat_template(chat) == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tok.encode_chat(chat) == hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True,
                                                           return_dict=False)


def test_raise_exception_becomes_error():
    with pytest.raises(ChatTemplateError, match="no first user message"):
        render_chat(LLAMA3, [{"role": "system", "content": "s"}], tools=TOOLS, bos_token="<s>")


# -- sandbox ------------------------------------------------------------------------------------

MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{{ dict.__call__.__globals__ }}",
    "{{ messages.append(1) }}",
])
def test_sandbox_blocks_escapes(template):
    with pytest.raises(ChatTemplateError):
        render_chat(template, MSGS)


@pytest.mark.parametrize("template", [
    "{% for i in range(10**9) %}x{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "{% set xs = range(100000) | list %}{% for a in xs %}{% for b in xs %}{{ '' }}{% endfor %}{% endfor %}",
])
def test_runaway_templates_fail_fast(template):
    start = time.monotonic()
    with pytest.raises(ChatTemplateError):
        render_chat(template, MSGS, limits=ChatLimits(timeout_s=0.5))
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}",
    "{{ 'a' * 10**9 }}",
    "{{ 'a' | center(10**9) }}",
    "{{ ''.ljust(10**9) }}",
    "{{ '%2000000000s' % '' }}",
    "{{ '{:{}}'.format('', 10**9) }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{{ (['x' * 1000] * 2000) | join }}",
    "{% macro m() %}{% for i in range(100000) %}{{ messages[0].content * 500 }}{% endfor %}{% endmacro %}{{ m() | length }}",
])
def test_output_and_memory_limits(template):
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="limit|large"):
        render_chat(template, MSGS, limits=ChatLimits(max_output_chars=1_000_000))
    assert time.monotonic() - start < 2.0


def test_output_limit_is_exact():
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    msgs = [{"role": "user", "content": "x" * 1000}]
    assert len(render_chat(template, msgs, limits=ChatLimits(max_output_chars=1000))) == 1000
    with pytest.raises(ChatTemplateError, match="over the limit"):
        render_chat(template, msgs, limits=ChatLimits(max_output_chars=999))


def test_template_size_and_syntax():
    with pytest.raises(ChatTemplateError, match="characters"):
        render_chat("x" * 100, MSGS, limits=ChatLimits(max_template_chars=99))
    with pytest.raises(ChatTemplateError, match="syntax error"):
        render_chat("{% for %}", MSGS)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat("", MSGS)


# -- messages -----------------------------------------------------------------------------------

@pytest.mark.parametrize("messages, why", [
    ("hello", "list"),
    ([], "empty"),
    ([{"content": "x"}], "role"),
    ([{"role": "root", "content": "x"}], "role"),
    (["user: hi"], "object"),
    ([{"role": "user", "content": 5}], "content"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "text"),
    ([{"role": "user", "content": ["raw"]}], "object"),
    ([{"role": "user", "content": "x"}] * 11, "too many"),
    ([{"role": "user", "content": "x" * 101}], "too long"),
    ([{"role": "user", "content": "x", "meta": object()}], "JSON"),
])
def test_bad_messages_rejected(messages, why):
    limits = ChatLimits(max_messages=10, max_content_chars=100)
    with pytest.raises(ChatTemplateError, match=why):
        validate_messages(messages, limits)
    with pytest.raises(ValueError):
        render_chat(CHATML, messages, limits=limits)


def test_messages_are_copied_and_none_dropped():
    msgs = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]
    out = validate_messages(msgs)
    assert out == [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]
    assert out[0]["tool_calls"] is not msgs[0]["tool_calls"]


def test_template_errors_on_missing_fields_are_clear():
    with pytest.raises(ChatTemplateError, match="failed"):
        render_chat("{{ messages[0].content + 1 }}", MSGS)
