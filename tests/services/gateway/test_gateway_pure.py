"""The gateway's pure parts: request bounds and OpenAI response shapes (no sockets)."""
from __future__ import annotations

import json

import msgspec
import pytest

from services.gateway.render import Accumulator, ChunkWriter
from services.gateway.schemas import (
    ApiError, ChatRequest, CompletionRequest, chat_prompt, client_request_id, completion_prompts, decode)
from services.protocol.messages import TextDelta, TokenLogprobText


def chat_body(**kw) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}).encode()


def test_chat_fields_map_to_sampling_params():
    req = decode(ChatRequest, chat_body(max_completion_tokens=7, max_tokens=99, temperature=0, top_p=0.5, n=3,
                                        stop="x", seed=5, logprobs=True, top_logprobs=4, presence_penalty=0.5,
                                        frequency_penalty=-0.5, top_k=10, min_p=0.1, repetition_penalty=1.1,
                                        ignore_eos=True, min_tokens=2, user="u", store=False, speculative=False))
    prompt, p = chat_prompt(req, 10)
    assert prompt.messages[0].content == "hi" and prompt.add_generation_prompt
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.stop, p.seed, p.logprobs) == (7, 0, 0.5, 3, ["x"], 5, 4)
    assert (p.presence_penalty, p.frequency_penalty, p.top_k, p.min_p, p.ignore_eos, p.min_tokens) == (
        0.5, -0.5, 10, 0.1, True, 2)
    assert not p.speculative and decode(ChatRequest, chat_body()).speculative     # on unless turned off
    with pytest.raises(ApiError) as e:
        decode(ChatRequest, chat_body(speculative="no"))
    assert e.value.status == 400 and e.value.param == "speculative"


def test_content_parts_are_joined_and_non_text_refused():
    req = decode(ChatRequest, chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                               {"type": "text", "text": "b"}]}]))
    assert chat_prompt(req, 10)[0].messages[0].content == "ab"
    req = decode(ChatRequest, chat_body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]))
    with pytest.raises(ApiError) as e:
        chat_prompt(req, 10)
    assert e.value.param == "messages[0].content"


def _called(arguments) -> list[dict]:
    return [{"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "content": "r", "tool_call_id": "c1"}]


@pytest.mark.parametrize("arguments, value", [('{"city": "Paris"}', {"city": "Paris"}), ("", {}),
                                              ({"city": "Rome"}, {"city": "Rome"})])
def test_history_tool_call_arguments_reach_the_template_as_values(arguments, value):
    """Templates write `arguments | tojson` (vLLM hands them the parsed value): OpenAI's JSON text
    passed as it came was quoted twice in the prompt."""
    prompt, _ = chat_prompt(decode(ChatRequest, chat_body(messages=_called(arguments))), 10)
    assert prompt.messages[1].tool_calls[0]["function"] == {"name": "f", "arguments": value}
    assert prompt.messages[1].tool_calls[0]["id"] == "c1" and prompt.messages[2].tool_call_id == "c1"


@pytest.mark.parametrize("arguments", ["{city: Paris", '{"x": NaN}', "1e999", "[" * 5000])
def test_history_tool_call_arguments_that_are_not_json_are_a_400_naming_them(arguments):
    with pytest.raises(ApiError) as e:
        chat_prompt(decode(ChatRequest, chat_body(messages=_called(arguments))), 10)
    assert e.value.status == 400 and e.value.param == "messages[1].tool_calls[0].function.arguments"


@pytest.mark.parametrize("prompt, count", [("a", 1), (["a", "b"], 2), ([1, 2], 1), ([[1], [2, 3]], 2)])
def test_completion_prompt_forms(prompt, count):
    req = decode(CompletionRequest, json.dumps({"model": "m", "prompt": prompt}).encode())
    prompts, params = completion_prompts(req, 8)
    assert len(prompts) == count and params.max_tokens == 16


@pytest.mark.parametrize("prompt", [[], [1, "a"], [[1], "a"], [True], [[]], {"a": 1}])
def test_bad_completion_prompts(prompt):
    with pytest.raises(ApiError) as e:
        completion_prompts(decode(CompletionRequest, json.dumps({"model": "m", "prompt": prompt}).encode()), 8)
    assert e.value.status == 400


def test_too_deep_json_is_400():
    with pytest.raises(ApiError, match="nested too deeply"):
        decode(ChatRequest, b'{"messages": [], "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")


def delta(i, text, finish=None, n=1, lp=None):
    return TextDelta("r", i, text, n, finish, lp, 5, 2)


def test_accumulated_chat_response_and_usage():
    acc = Accumulator("chat", "m", 2, 1, [5], want_logprobs=True)
    lp = [TokenLogprobText("he", -0.1, [104, 101], [("he", -0.1, [104, 101])])]
    acc.add(0, delta(0, "he", lp=lp))
    acc.add(0, delta(1, "yo", "length", lp=lp))
    acc.add(0, delta(0, "llo", "stop", lp=lp))
    r = acc.response()
    assert [c["message"]["content"] for c in r["choices"]] == ["hello", "yo"]
    assert [c["finish_reason"] for c in r["choices"]] == ["stop", "length"]
    assert r["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                          "prompt_tokens_details": {"cached_tokens": 2}}
    assert r["choices"][0]["logprobs"]["content"][0]["top_logprobs"][0] == {"token": "he", "logprob": -0.1,
                                                                           "bytes": [104, 101]}


def sse(data: bytes) -> list:
    return [json.loads(line[6:]) for line in data.decode().split("\n\n") if line.startswith("data: ")]


def test_chunks_with_usage_and_role_first():
    acc = Accumulator("chat", "m", 1, 1, [3], want_logprobs=False)
    w = ChunkWriter(acc, include_usage=True)
    first = sse(w.start())
    assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first[0]["usage"] is None
    assert w.delta(0, delta(0, "")) == b""                       # nothing to say: no chunk
    mid = sse(w.delta(0, delta(0, "hi", "stop")))
    assert mid[0]["choices"][0] == {"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": "stop",
                                    "stop_reason": None}
    last = sse(w.finish())
    assert last[0]["choices"] == [] and last[0]["usage"]["completion_tokens"] == 2


def test_completion_logprob_offsets():
    acc = Accumulator("completions", "m", 1, 2, [1, 1], want_logprobs=True)
    w = ChunkWriter(acc, include_usage=False)
    lp = [TokenLogprobText("ab", -1.0, [97, 98], [("ab", -1.0, [97, 98])]),
          TokenLogprobText("c", -2.0, [99], [])]
    [chunk] = sse(w.delta(1, delta(0, "abc", n=2, lp=lp)))
    assert chunk["choices"][0]["index"] == 1                       # prompt 1, sample 0
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [0, 2]
    # the sampled token is always there (OpenAI: up to logprobs + 1 entries)
    assert chunk["choices"][0]["logprobs"]["top_logprobs"] == [{"ab": -1.0}, {"c": -2.0}]


def test_stop_reason_in_whole_responses_and_no_empty_tool_calls():
    chat = Accumulator("chat", "m", 2, 1, [5], want_logprobs=False)
    chat.add(0, TextDelta("r", 0, "a", 1, "stop", None, 5, 0, "###"))
    chat.add(0, TextDelta("r", 1, "b", 1, "stop", None, 5, 0, 7))
    r = chat.response()
    assert [c["stop_reason"] for c in r["choices"]] == ["###", 7]
    assert "tool_calls" not in r["choices"][0]["message"]     # OpenAI: no key when no tool was called
    comp = Accumulator("completions", "m", 1, 1, [5], want_logprobs=False)
    comp.add(0, delta(0, "x", "length"))
    assert comp.response()["choices"][0]["stop_reason"] is None


def test_streamed_stop_reason_only_on_the_last_chunk():
    w = ChunkWriter(Accumulator("completions", "m", 1, 1, [3], want_logprobs=False), include_usage=False)
    [mid] = sse(w.delta(0, delta(0, "a")))
    [last] = sse(w.delta(0, TextDelta("r", 0, "b", 1, "stop", None, 3, 0, "\n\n")))
    assert (mid["choices"][0]["stop_reason"], last["choices"][0]["stop_reason"]) == (None, "\n\n")
    assert "usage" not in mid


def test_continuous_usage_in_every_chunk():
    w = ChunkWriter(Accumulator("chat", "m", 1, 1, [3], want_logprobs=False), include_usage=True,
                    continuous_usage=True)
    chunks = sse(w.start() + w.delta(0, delta(0, "a")) + w.delta(0, delta(0, "bc", "length", n=2)) + w.finish())
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 3, 3]
    assert all(c["usage"]["prompt_tokens"] == 3 and c["usage"]["total_tokens"] == 3 + c["usage"]["completion_tokens"]
               for c in chunks)
    assert chunks[-1]["choices"] == []


def test_continuous_usage_without_include_usage_sends_no_usage():
    """vLLM's should_include_usage: continuous usage only with include_usage; alone, no usage at all."""
    w = ChunkWriter(Accumulator("chat", "m", 1, 1, [3], want_logprobs=False), include_usage=False,
                    continuous_usage=True)
    chunks = sse(w.start() + w.delta(0, delta(0, "a")) + w.delta(0, delta(0, "bc", "length", n=2)) + w.finish())
    assert len(chunks) == 3 and all("usage" not in c for c in chunks)


@pytest.mark.parametrize("body, param, words", [
    (b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content", "surrogate"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature", "NaN"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": -Infinity}', "top_p", "-Infinity"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": ["x", "\\udc00"]}', "stop[1]",
     "surrogate"),
])
def test_malformed_values_name_their_field(body, param, words):
    with pytest.raises(ApiError) as e:
        decode(ChatRequest, body)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message


def test_other_malformed_json_keeps_the_decoder_message():
    with pytest.raises(ApiError) as e:
        decode(ChatRequest, b'{"model": "m", "messages": [}')
    assert e.value.param is None and "not valid JSON" in e.value.message


@pytest.mark.parametrize("extra, param", [
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"_x": 1}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {f"k{i}": i for i in range(33)}}, "chat_template_kwargs"),
])
def test_refused_chat_options(extra, param):
    with pytest.raises(ApiError) as e:
        chat_prompt(decode(ChatRequest, chat_body(**extra)), 10)
    assert e.value.status == 400 and e.value.param == param


OFF_VALUES = {"allowed_token_ids": None, "bad_words": [], "prompt_logprobs": None, "include_stop_str_in_output": False,
              "truncate_prompt_tokens": None, "continue_final_message": False, "echo": False}


def test_the_off_values_of_vllm_extensions_clients_send_pass():
    chat_prompt(decode(ChatRequest, chat_body(**OFF_VALUES)), 10)
    off = {k: v for k, v in OFF_VALUES.items() if k != "continue_final_message"}
    completion_prompts(decode(CompletionRequest, json.dumps({"model": "m", "prompt": "p", **off}).encode()), 8)


@pytest.mark.parametrize("extra, param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_chat_range_errors_name_the_field_the_client_sent(extra, param):
    with pytest.raises(ApiError) as e:
        chat_prompt(decode(ChatRequest, chat_body(**extra)), 10)
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(f"invalid {param}: ")


@pytest.mark.parametrize("route, field", [("chat", "max_tokens"), ("chat", "max_completion_tokens"),
                                          ("completions", "max_tokens")])
def test_a_max_tokens_past_64_bits_is_a_400_not_a_message_that_cannot_be_sent(route, field):
    """The Submit carrying max_tokens is msgpack (64-bit ints at most): 2**64 made the send raise (a 500)."""
    def params(value):
        if route == "chat":
            return chat_prompt(decode(ChatRequest, chat_body(**{field: value})), 10)[1]
        return completion_prompts(decode(CompletionRequest, json.dumps({"prompt": "x", field: value}).encode()), 1)[1]
    msgspec.msgpack.encode(params(2**63 - 1))     # the largest accepted one can be sent
    with pytest.raises(ApiError) as e:
        params(2**64)
    assert e.value.status == 400 and e.value.param == field


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_unforced_tool_choice_is_accepted(choice):
    chat_prompt(decode(ChatRequest, chat_body(tools=[{"type": "function", "function": {"name": "f"}}],
                                              tool_choice=choice, stream=True,
                                              stream_options={"include_usage": True})), 10)


def test_completion_stream_options_need_stream():
    body = json.dumps({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}).encode()
    with pytest.raises(ApiError) as e:
        completion_prompts(decode(CompletionRequest, body), 4)
    assert e.value.param == "stream_options"


@pytest.mark.parametrize("value, ok", [(None, True), ("abc-123_X.y:z/+=", True), ("a" * 128, True),
                                       ("a" * 129, False), ("", False), ("a b", False), ("é", False),
                                       ("a\nb", False)])
def test_client_request_id_bounds(value, ok):
    if ok:
        assert client_request_id(value) == value
    else:
        with pytest.raises(ApiError) as e:
            client_request_id(value)
        assert e.value.param == "X-Request-Id"


def test_serving_beyond_loopback_without_an_api_key_is_warned_about():
    from services.config import GatewayConfig, parse_config
    from services.gateway.main import open_to_the_network

    def warning(*argv):
        return open_to_the_network(parse_config(GatewayConfig, list(argv), "gateway", env={}))
    assert "--api-key" in warning("--host", "0.0.0.0", "--port", "8000")
    assert "--host ::" in warning("--host", "::")
    assert warning("--host", "127.0.0.1") is None and warning("--host", "::1") is None
    assert warning("--host", "localhost") is None and warning("--host", "0.0.0.0", "--api-key", "k") is None


def test_the_gateways_stop_runs_to_its_end_through_a_cancellation():
    """Ctrl-C: uvicorn re-raises the SIGINT it handled, asyncio's runner cancels the main task
    while the backend stops; the stop must finish and the task end without CancelledError (which
    the runner turns into a KeyboardInterrupt traceback)."""
    import asyncio

    from services.gateway.main import stop_backend

    class SlowBackend:
        stopped = False

        async def stop(self):
            await asyncio.sleep(0.05)
            self.stopped = True

    async def scenario():
        backend = SlowBackend()
        task = asyncio.ensure_future(stop_backend(backend))
        await asyncio.sleep(0.01)
        task.cancel()
        await task
        return backend.stopped

    assert asyncio.run(scenario()) is True


NEG_INF = float("-inf")


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_minus_inf_logprobs_are_answered_as_vllm_does(kind):
    """A token the model's logits rule out (or whose probability underflows) has logprob -inf,
    which JSON cannot carry: vLLM answers -9999.0 for it and its alternatives, whole and
    streamed; never null (msgspec's encoding of -inf) or -Infinity (not JSON)."""
    lp = [TokenLogprobText("x", NEG_INF, [120], [("y", -0.5, [121]), ("x", NEG_INF, [120])])]
    acc = Accumulator(kind, "m", 1, 1, [3], want_logprobs=True)
    acc.add(0, delta(0, "x", "stop", lp=lp))
    whole = msgspec.json.decode(msgspec.json.encode(acc.response()))["choices"][0]["logprobs"]
    [chunk] = sse(ChunkWriter(Accumulator(kind, "m", 1, 1, [3], want_logprobs=True), include_usage=False)
                  .delta(0, delta(0, "x", lp=lp)))
    streamed = chunk["choices"][0]["logprobs"]
    for got in (whole, streamed):
        if kind == "chat":
            [entry] = got["content"]
            assert entry["logprob"] == -9999.0
            assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.5, -9999.0]
        else:
            assert got["token_logprobs"] == [-9999.0] and got["top_logprobs"] == [{"x": -9999.0, "y": -0.5}]
