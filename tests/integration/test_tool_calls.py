"""Tool calls and reasoning output through the whole stack, with the official `openai` client, on
both text paths: a gateway that makes its own text (--text-in-gateway) and one whose text the
tokenizer service makes (its --tool-call-parser / --reasoning-parser auto read from the service's
registry record).

The model is the tiny random Qwen3 with a Qwen3-style template (templates/qwen3_tools.jinja:
<tool_call> calls, <think> reasoning) and four vocabulary entries replaced by pieces of a thinking
answer that calls a tool, their output rows zeroed (logit 0 whatever the prompt). logit_bias (100,
90, 80, 70) with the largest repetition penalty makes greedy decoding write the pieces in order,
one per token: a real model writing a real call, split mid-tag and mid-arguments across tokens.
Without the bias the random model writes text; with a forced tool_choice the worker's constrained
decoding makes it write valid calls.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.conftest import free_port
from tests.integration.stack import FAST, INTERNAL, ROOT, redis_and_procs, wait_ready

TEMPLATE = Path(__file__).parent / "templates" / "qwen3_tools.jinja"
PIECES = ["<think>Weather? I should call", " the tool.</think>\n\n",
          '<tool_call>\n{"name": "get_weather", "arguments": {"ci', 'ty": "Paris"}}\n</tool_call>']
FIRST_ID = 1020   # the tiny model's vocabulary is 1,024 entries: the last four become the pieces
# bounded strings: a random model constrained to the schema would otherwise write until max_tokens
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def forced(pieces: int = 4) -> dict:
    """Request fields that make greedy decoding write the first `pieces` pieces, in order."""
    bias = {str(FIRST_ID + k): 100 - 10 * k for k in range(pieces)}
    return {"temperature": 0, "max_tokens": pieces, "logit_bias": bias,
            "extra_body": {"repetition_penalty": 10.0}}


def forge_model(src: Path, dst: Path) -> None:
    """A copy of `src` whose last vocabulary entries decode to PIECES, with the test template."""
    shutil.copytree(src, dst)
    from safetensors.torch import load_file, save_file
    weights = load_file(src / "model.safetensors")
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"   # tied
    weights[head][FIRST_ID:FIRST_ID + len(PIECES)] = 0      # (4, hidden): the pieces' logits are 0
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    gone = {by_id[FIRST_ID + k] for k in range(len(PIECES))}
    for token in gone:
        del vocab[token]
    pair = lambda m: m.split(" ", 1) if isinstance(m, str) else m   # noqa: E731
    tok["model"]["merges"] = [m for m in tok["model"]["merges"] if not (set(pair(m)) & gone or "".join(pair(m)) in gone)]
    tok["added_tokens"] += [{"id": FIRST_ID + k, "content": p, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": False} for k, p in enumerate(PIECES)]
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    (dst / "chat_template.jinja").write_text(TEMPLATE.read_text())
    from services.text.tokenizer import load_tokenizer
    loaded = load_tokenizer(dst)
    assert [loaded.decode([FIRST_ID + k]) for k in range(len(PIECES))] == PIECES


@pytest.fixture(scope="module")
def gateways(tmp_path_factory):
    """(local-text gateway URL, remote-text gateway URL, model name) over one worker."""
    where = tmp_path_factory.mktemp("tools")
    subprocess.run([sys.executable, "-m", "services.cli", "make-model", "--arch", "qwen3", "--size", "tiny",
                    str(where / "base")], cwd=ROOT, check=True, capture_output=True)
    model = where / "qwen3-tools"
    forge_model(where / "base", model)
    local, remote = free_port(), free_port()
    (where / "logs").mkdir()
    with redis_and_procs(where / "logs") as (_, procs):
        procs.start("tokenizer", "tokenizer", *FAST, *INTERNAL, "--metrics-port", "-1", "--model", str(model))
        procs.start("scheduler", "scheduler", *FAST, *INTERNAL, "--metrics-port", "-1")
        procs.start_worker("worker-0", str(model))
        procs.start("gateway-local", "gateway", *FAST, "--port", str(local), "--zmq-port", "0",
                    "--text-in-gateway", "--model", str(model))
        procs.start("gateway-remote", "gateway", *FAST, "--port", str(remote), "--zmq-port", "0")
        urls = [f"http://127.0.0.1:{p}" for p in (local, remote)]
        for url in urls:
            wait_ready(url, 180)
        yield urls, model.name


@pytest.fixture(params=["local", "remote"])
def client(request, gateways):
    urls, name = gateways
    c = openai.OpenAI(base_url=urls[request.param == "remote"] + "/v1", api_key="none", timeout=60, max_retries=0)
    c.model_name = name
    return c


def chat(client, **kw):
    kw.setdefault("messages", ASK)
    return client.chat.completions.create(model=client.model_name, **kw)


def assembled(chunks) -> dict:
    """A streamed answer put together by hand: by choice, tool calls by index."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in chunks:
        for choice in chunk.choices:
            d = choice.delta
            out["content"] += d.content or ""
            out["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                entry = out["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id is not None:
                    assert entry["id"] is None, "a call's id comes once, in its first delta"
                    entry.update(id=tc.id, name=tc.function.name)
                entry["arguments"] += tc.function.arguments or ""
            if choice.finish_reason is not None:
                out["finish"] = choice.finish_reason
    return out


def test_a_thinking_answer_that_calls_a_tool(client):
    r = chat(client, tools=TOOLS, **forced())
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "Weather? I should call the tool."
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 20
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    again = chat(client, tools=TOOLS, **forced()).choices[0].message.tool_calls[0]
    assert again.id != call.id   # server-assigned, random


def test_streamed_the_same_by_hand_and_by_the_clients_helper(client):
    got = assembled(chat(client, tools=TOOLS, stream=True, **forced()))
    assert got["finish"] == "tool_calls" and got["content"] == ""
    assert got["reasoning"] == "Weather? I should call the tool."
    [(index, call)] = got["calls"].items()
    assert index == 0 and call["id"].startswith("call_") and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    kw = forced()
    extra = kw.pop("extra_body")
    with client.chat.completions.stream(model=client.model_name, messages=ASK, tools=TOOLS, extra_body=extra,
                                        **kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')   # as written
    assert final.choices[0].finish_reason == "tool_calls" and "tool_calls.function.arguments.done" in events
    # the call streamed as it was generated: its arguments in the two tokens' fragments
    assert events.count("tool_calls.function.arguments.delta") >= 2


def test_tool_choice_none_leaves_the_call_as_text(client):
    r = chat(client, tools=TOOLS, tool_choice="none", **forced())
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and m.tool_calls is None
    assert m.content == PIECES[2] + PIECES[3] and m.model_extra["reasoning_content"] == "Weather? I should call the tool."


def test_an_auto_call_cut_inside_its_arguments_is_a_call(client):
    """Cut by max_tokens after `{"name": "get_weather", "arguments": {"ci`: the call was streamed
    from its arguments' `{` on, so it is a call with its arguments as far as they go, streamed or
    not, and finish_reason stays "length" (its arguments are not whole); cut before that it would be
    text (tests/services/gateway/test_render_tool_calls.py)."""
    kw = forced(3)
    r = chat(client, tools=TOOLS, **kw)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content is None
    assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] == [("get_weather", '{"ci')]
    got = assembled(chat(client, tools=TOOLS, stream=True, **kw))
    assert got["finish"] == "length" and got["content"] == ""
    assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == [("get_weather", '{"ci')]


def test_a_forced_call_cut_by_max_tokens_is_a_call(client):
    """tool_choice named or required, cut by max_tokens two tokens before the answer's end: the
    openai client reads tool_calls whose last arguments end where the cut came (the same calls as
    the whole answer's, as far as they go: arguments are the text as written), finish_reason
    "length" and no content, streamed or not. The whole answer streamed through the client's own
    helper: argument fragments as they were generated, assembled into the same calls."""
    def squeezed(calls) -> list:   # (name, arguments) of each call
        return [(c.function.name, c.function.arguments) for c in calls]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        kw = {"tools": TOOLS, "tool_choice": choice, "temperature": 0}
        full = chat(client, max_tokens=60, **kw)
        assert full.choices[0].finish_reason == "tool_calls"
        with client.chat.completions.stream(model=client.model_name, messages=ASK, max_tokens=60, **kw) as stream:
            fragments = [e for e in stream if e.type == "tool_calls.function.arguments.delta" and e.arguments_delta]
            final = stream.get_final_completion()
        assert squeezed(final.choices[0].message.tool_calls) == squeezed(full.choices[0].message.tool_calls)
        assert len(fragments) >= (2 if isinstance(choice, dict) else 1)   # get_weather's city is several tokens
        kw["max_tokens"] = full.usage.completion_tokens - 2
        cut = chat(client, **kw).choices[0]
        assert cut.finish_reason == "length" and cut.message.content is None and cut.message.tool_calls
        whole, part = squeezed(full.choices[0].message.tool_calls), squeezed(cut.message.tool_calls)
        assert whole[:len(part) - 1] == part[:-1]
        assert part[-1][0] == whole[len(part) - 1][0] and whole[len(part) - 1][1].startswith(part[-1][1])
        got = assembled(chat(client, stream=True, **kw))
        assert got["finish"] == "length" and got["content"] == ""
        assert [(c["name"], c["arguments"]) for _, c in sorted(got["calls"].items())] == [
            (c.function.name, c.function.arguments) for c in cut.message.tool_calls]


def test_auto_answers_with_text_or_valid_calls(client):
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        whole = chat(client, tools=TOOLS, max_tokens=12, **kw).choices[0]
        streamed = assembled(chat(client, tools=TOOLS, max_tokens=12, stream=True, **kw))
        if whole.message.tool_calls:   # its arguments as written (cut by max_tokens, maybe)
            assert whole.finish_reason == streamed["finish"] == "tool_calls"
            assert [(c["name"], c["arguments"]) for _, c in sorted(streamed["calls"].items())] == [
                (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        else:
            assert whole.finish_reason in ("stop", "length")
            assert streamed["content"] == (whole.message.content or "") and not streamed["calls"]


def test_enable_thinking_reaches_the_template(gateways):
    urls, name = gateways
    for url in urls:
        def count(**extra) -> int:
            r = httpx.post(url + "/tokenize", json={"model": name, "messages": ASK, **extra}, timeout=30)
            assert r.status_code == 200, r.text
            return r.json()["count"]
        assert count(chat_template_kwargs={"enable_thinking": False}) > count()
        r = httpx.post(url + "/v1/chat/completions", timeout=30,
                       json={"model": name, "messages": ASK, "chat_template_kwargs": {"messages": []}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


@pytest.mark.parametrize("tools, choice, param", [
    ([{"type": "function", "function": {"name": "no spaces"}}], "auto", "tools[0].function.name"),
    (TOOLS, {"type": "function", "function": {"name": "get_date"}}, "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_are_400s_and_harm_nothing(client, tools, choice, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tools=tools, tool_choice=choice, max_tokens=2) if tools else \
            chat(client, tool_choice=choice, max_tokens=2)
    assert e.value.body["param"] == param
    assert chat(client, tools=TOOLS, **forced()).choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_choice_always_calls(client, choice, stream):
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        r = chat(client, tools=TOOLS, tool_choice=choice, max_tokens=128, stream=stream, **kw)
        got = assembled(r) if stream else r.choices[0]
        calls = list(got["calls"].values()) if stream else [
            {"name": c.function.name, "arguments": c.function.arguments} for c in got.message.tool_calls or []]
        assert calls, got
        for call in calls:
            args = json.loads(call["arguments"])
            assert call["name"] in ("get_weather", "get_time") and isinstance(args, dict)
            if call["name"] == "get_weather":
                assert isinstance(args["city"], str)
            if isinstance(choice, dict):
                assert call["name"] == "get_weather"
