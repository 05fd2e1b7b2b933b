"""POST /v1/chat/completions in-process over a scripted backend: the answer text a worker would
send, read by the route as a client gets it, whole and streamed."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from services.config import GatewayConfig
from services.gateway.app import create_app
from services.protocol.messages import TextDelta
from services.text.chat_formats import ChatFormats

HI = [{"role": "user", "content": "hi"}]


class ScriptedJob:
    """One answer per sample, one character a delta; the last delta finishes with `finish`."""

    submitted = first_read = 0.0

    def __init__(self, answers: list[str], finish: str) -> None:
        self.answers, self.finish = answers, finish

    async def batches(self):
        for index, text in enumerate(self.answers):
            for k, ch in enumerate(text):
                end = self.finish if k == len(text) - 1 else None
                yield [(0, TextDelta(request_id="r", index=index, text=ch, num_new_tokens=1, finish_reason=end))]

    def close(self) -> None:
        pass


class ScriptedBackend:
    def __init__(self, answers: list[str], finish: str = "stop", formats=ChatFormats("hermes", "deepseek_r1")):
        self.answers, self.finish = answers, finish
        self.catalog = SimpleNamespace(names=["m"], vocab_sizes={"m": 100}, max_model_lens={"m": 64},
                                       resolve=lambda m: m)
        self.text = SimpleNamespace(formats=lambda: formats)

    def check_vocab(self, model, params) -> None:
        pass

    async def start(self, prompts, params, **kwargs):
        return ScriptedJob(self.answers[:params.n], self.finish), [3]


def chat(backend: ScriptedBackend, **fields) -> tuple[dict, dict]:
    """The whole answer's first choice, and the streamed one's, assembled as a client does."""
    client = TestClient(create_app(GatewayConfig(), backend))
    body = {"model": "m", "messages": HI, **fields}
    whole = client.post("/v1/chat/completions", json=body)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    streamed: dict = {"content": None, "reasoning_content": None, "calls": {}}
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                delta = c["delta"]
                for key in ("content", "reasoning_content"):
                    if delta.get(key):
                        streamed[key] = (streamed[key] or "") + delta[key]
                for tc in delta.get("tool_calls") or []:
                    call = streamed["calls"].setdefault(tc["index"], {"name": "", "arguments": ""})
                    call["name"] += tc.get("function", {}).get("name") or ""
                    call["arguments"] += tc.get("function", {}).get("arguments") or ""
                if c["finish_reason"]:
                    streamed["finish_reason"] = c["finish_reason"]
    return choice, streamed


@pytest.mark.parametrize("constraint", [{"guided_choice": ["yes", "no"]},
                                        {"structured_outputs": {"choice": ["yes", "no"]}},
                                        {"response_format": {"type": "json_object"}}])
def test_a_constrained_answer_is_content_under_a_reasoning_parser_that_starts_inside_a_block(constraint):
    """deepseek_r1 reads an answer as reasoning until `</think>`; a constrained answer is held to
    its grammar from its first token, so none of it is reasoning: it is the content."""
    text = "no" if "response_format" not in constraint else '{"a": 1}'
    choice, streamed = chat(ScriptedBackend([text]), **constraint)
    assert choice["message"]["content"] == text and choice["message"]["reasoning_content"] is None
    assert streamed["content"] == text and streamed["reasoning_content"] is None


def test_an_unconstrained_answer_still_thinks_under_deepseek_r1():
    choice, streamed = chat(ScriptedBackend(["hmm</think>yes"]))
    assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == ("hmm", "yes")
    assert (streamed["reasoning_content"], streamed["content"]) == ("hmm", "yes")


TOOLS = [{"type": "function", "function": {"name": name}} for name in ("get_time", "get_date")]
TWO_CALLS = ('<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>\n'
             '<tool_call>{"name": "get_date", "arguments": {}}</tool_call>')


@pytest.mark.parametrize("parallel, calls", [(True, [("get_time", '{"tz": "UTC"}'), ("get_date", "{}")]),
                                             (False, [("get_time", '{"tz": "UTC"}')])])
def test_parallel_tool_calls_false_returns_the_first_call_only(parallel, calls):
    """OpenAI's parallel_tool_calls: false means at most one call; vLLM drops the calls after the first."""
    backend = ScriptedBackend([TWO_CALLS], formats=ChatFormats("hermes", "none"))
    choice, streamed = chat(backend, tools=TOOLS, parallel_tool_calls=parallel)
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    assert whole == calls and choice["finish_reason"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == calls
    assert streamed["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("parallel, calls, finish", [
    (True, [("get_time", '{"tz": "UTC"}'), ("get_date", '{"d')], "length"),
    (False, [("get_time", '{"tz": "UTC"}')], "tool_calls")])
def test_a_call_cut_by_max_tokens_and_dropped_leaves_the_kept_call_whole(parallel, calls, finish):
    """max_tokens cut the second call's arguments: "length" says a returned call may be cut short,
    but with parallel_tool_calls false that call is dropped and the one returned is whole."""
    cut = TWO_CALLS.split("\n")[0] + '\n<tool_call>{"name": "get_date", "arguments": {"d'
    backend = ScriptedBackend([cut], finish="length", formats=ChatFormats("hermes", "none"))
    choice, streamed = chat(backend, tools=TOOLS, parallel_tool_calls=parallel)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == calls
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == calls
    assert choice["finish_reason"] == streamed["finish_reason"] == finish


NOT_JSON_SCHEMA = {"type": "object", "properties": {"x": {"type": "nope"}}}
NO_GRAMMAR = {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}   # valid, but nothing to build


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "bad"}}])
@pytest.mark.parametrize("parameters, where", [(NOT_JSON_SCHEMA, "at properties/x/type: "), (NO_GRAMMAR, "")])
def test_a_forced_choice_over_a_bad_parameters_schema_names_the_tools_field(choice, parameters, where):
    """The 400 names the client's field and a path within it, not the schema kvmesh builds around
    the tools for `required` (items/anyOf/1/properties/parameters/...)."""
    tools = [TOOLS[0], {"type": "function", "function": {"name": "bad", "parameters": parameters}}]
    client = TestClient(create_app(GatewayConfig(), ScriptedBackend(["[]"])))
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": HI, "tools": tools, "tool_choice": choice})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "tools[1].function.parameters", r.text
    assert where in error["message"] and "anyOf" not in error["message"] and "items" not in error["message"]


def test_include_reasoning_false_drops_the_reasoning_whole_and_streamed():
    """vLLM's include_reasoning: false answers without reasoning_content; the content is the same."""
    choice, streamed = chat(ScriptedBackend(["hmm</think>yes"]), include_reasoning=False)
    assert "reasoning_content" not in choice["message"] and choice["message"]["content"] == "yes"
    assert streamed["reasoning_content"] is None and streamed["content"] == "yes"
