"""prompt_logprobs and completions' echo through the routes, in-process (vLLM's shapes): what
reaches SamplingParams, the answers whole and streamed, and the 400s naming the field."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from services.config import GatewayConfig
from services.gateway.app import create_app
from services.gateway.backend import Backend, check_prompt_logprobs_len
from services.gateway.schemas import ApiError
from services.protocol.messages import DetokenizeReply, PromptLogprobText, TextDelta, TokenizeReply, TokenLogprobText
from services.protocol.sampling import MAX_PROMPT_LOGPROBS_TOKENS
from services.text.chat_formats import ChatFormats

# the prompt "Hi there" as three tokens; "!" drawn after it
PROMPT_LP = [PromptLogprobText(7, "Hi", None, None),
             PromptLogprobText(8, " the", -1.5, 2, [(9, " a", -0.5), (8, " the", -1.5)]),
             PromptLogprobText(10, "re", float("-inf"), 50, [(11, "x", -0.1), (12, "y", -2.0)])]
DRAWN = TokenLogprobText("!", -0.25, [33], [("!", -0.25, [33]), ("?", -1.75, [63])])


class Answer:
    submitted = first_read = 0.0

    def __init__(self, n: int, num_prompts: int, with_prompt: bool) -> None:
        self.n, self.num_prompts, self.with_prompt = n, num_prompts, with_prompt

    async def batches(self):
        yield [(p, TextDelta("r", i, "!", 1, "length", [DRAWN], 3, 0, None,
                             PROMPT_LP if self.with_prompt and i == 0 else None))
               for p in range(self.num_prompts) for i in range(self.n)]

    def close(self) -> None:
        pass


class Backend_:
    def __init__(self) -> None:
        self.started: list[tuple] = []
        self.detokenized: list[list[int]] = []
        self.catalog = SimpleNamespace(names=["m"], vocab_sizes={"m": 100}, max_model_lens={"m": 64},
                                       resolve=lambda m: m)
        self.text = SimpleNamespace(formats=lambda: ChatFormats("hermes", "none"))

    check_vocab = Backend.check_vocab

    async def start(self, prompts, params, **kwargs):
        self.started.append((prompts, params))
        self.start_kwargs = kwargs
        return Answer(params.n, len(prompts), params.prompt_logprobs is not None), [3] * len(prompts)

    async def detokenize(self, req):
        self.detokenized.append(req.token_ids)
        return DetokenizeReply(text="Hi there")


def client() -> tuple[TestClient, Backend_]:
    backend = Backend_()
    return TestClient(create_app(GatewayConfig(), backend)), backend


def post(route: str, **fields):
    c, backend = client()
    body = {"model": "m", **({"messages": [{"role": "user", "content": "hi"}]} if route == "chat" else
                             {"prompt": "Hi there"}), **fields}
    r = c.post("/v1/chat/completions" if route == "chat" else "/v1/completions", json=body)
    return r, backend


VLLM_PROMPT_LOGPROBS = [None,
                        {"8": {"logprob": -1.5, "rank": 2, "decoded_token": " the"},
                         "9": {"logprob": -0.5, "rank": 1, "decoded_token": " a"}},
                        {"10": {"logprob": -9999.0, "rank": 50, "decoded_token": "re"},
                         "11": {"logprob": -0.1, "rank": 1, "decoded_token": "x"},
                         "12": {"logprob": -2.0, "rank": 2, "decoded_token": "y"}}]


def test_completions_prompt_logprobs_on_each_choice():
    r, backend = post("completions", prompt_logprobs=2, n=2)
    assert r.status_code == 200, r.text
    assert backend.started[0][1].prompt_logprobs == 2
    choices = r.json()["choices"]
    assert [c["prompt_logprobs"] for c in choices] == [VLLM_PROMPT_LOGPROBS] * 2
    assert [c["text"] for c in choices] == ["!", "!"]


def test_chat_prompt_logprobs_at_the_top_of_the_answer():
    r, _ = post("chat", prompt_logprobs=2)
    assert r.status_code == 200, r.text
    assert r.json()["prompt_logprobs"] == VLLM_PROMPT_LOGPROBS
    r, _ = post("chat")
    assert "prompt_logprobs" not in r.json()


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("fields", [{"prompt_logprobs": 21}, {"prompt_logprobs": -1},
                                    {"prompt_logprobs": 1, "stream": True}])
def test_bad_prompt_logprobs_are_400s_naming_it(route, fields):
    r, backend = post(route, **fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    assert not backend.started


def test_long_prompts_may_not_ask():
    short, long = TokenizeReply(prompt_token_ids=[1] * MAX_PROMPT_LOGPROBS_TOKENS, detok_addr="", vocab_size=9), \
        TokenizeReply(prompt_token_ids=[1] * (MAX_PROMPT_LOGPROBS_TOKENS + 1), detok_addr="", vocab_size=9)
    check_prompt_logprobs_len([short], 20, 1)
    with pytest.raises(ApiError) as e:
        check_prompt_logprobs_len([short, long], 0, 1)
    assert e.value.status == 400 and e.value.param == "prompt_logprobs"


def test_one_answer_carries_a_bounded_number_of_prompt_logprobs():
    """128 choices of 8k-token prompts x 21 entries would be 1.5 GB of JSON in the gateway: the
    answer's entries (tokens x (k + 1) x copies) are bounded, the copies counted."""
    longest = TokenizeReply(prompt_token_ids=[1] * MAX_PROMPT_LOGPROBS_TOKENS, detok_addr="", vocab_size=9)
    check_prompt_logprobs_len([longest] * 4, 20, 1)
    check_prompt_logprobs_len([longest], 20, 4)
    for replies, copies in (([longest] * 5, 1), ([longest], 5), ([longest] * 8, 16)):
        with pytest.raises(ApiError, match="at most 688128 may be asked at once") as e:
            check_prompt_logprobs_len(replies, 20, copies)
        assert e.value.status == 400 and e.value.param == "prompt_logprobs"


@pytest.mark.parametrize("route, n, copies", [("chat", 3, 1), ("completions", 3, 3)])
def test_prompt_logprobs_copies_are_the_choices_that_carry_them(route, n, copies):
    r, backend = post(route, prompt_logprobs=1, n=n)
    assert r.status_code == 200, r.text
    assert backend.start_kwargs["prompt_logprobs_copies"] == copies


ECHO_LOGPROBS = {"tokens": ["Hi", " the", "re", "!"], "token_logprobs": [None, -1.5, -9999.0, -0.25],
                 "top_logprobs": [None, {" the": -1.5, " a": -0.5}, {"re": -9999.0, "x": -0.1, "y": -2.0},
                                  {"!": -0.25, "?": -1.75}],
                 "text_offset": [0, 2, 6, 8]}


def test_echo_with_logprobs_as_lm_eval_harness_asks():
    r, backend = post("completions", echo=True, logprobs=1, max_tokens=1)
    assert r.status_code == 200, r.text
    assert backend.started[0][1].prompt_logprobs == 1          # made by the engine for the echo
    choice = r.json()["choices"][0]
    assert choice["text"] == "Hi there!" and "prompt_logprobs" not in choice
    assert choice["logprobs"] == ECHO_LOGPROBS                 # -inf as vLLM's -9999.0: JSON has none


def test_echo_with_max_tokens_0_answers_the_prompt_alone():
    r, backend = post("completions", echo=True, logprobs=1, max_tokens=0)
    assert r.status_code == 200, r.text
    assert backend.started[0][1].max_tokens == 1               # one token drawn, then left out
    choice = r.json()["choices"][0]
    assert choice["text"] == "Hi there" and choice["logprobs"]["tokens"] == ["Hi", " the", "re"]
    assert choice["logprobs"]["text_offset"] == [0, 2, 6]
    r, _ = post("completions", max_tokens=0)                   # without echo: a 400 naming it
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_echo_of_token_ids_is_their_text_and_streamed_on_the_first_chunk():
    c, backend = client()
    body = {"model": "m", "prompt": [7, 8, 10], "echo": True, "logprobs": 1, "max_tokens": 1, "stream": True}
    chunks = []
    with c.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    assert backend.detokenized == [[7, 8, 10]]
    assert chunks[0]["text"] == "Hi there!"
    assert chunks[0]["logprobs"]["tokens"] == ["Hi", " the", "re", "!"]
    assert chunks[0]["logprobs"]["text_offset"] == [0, 2, 6, 8]


def test_echo_without_logprobs_prepends_the_text_only():
    r, backend = post("completions", echo=True, prompt=["Hi there", "Yo"], max_tokens=2)
    assert r.status_code == 200, r.text
    assert backend.started[0][1].prompt_logprobs is None
    assert [(c["text"], c["logprobs"]) for c in r.json()["choices"]] == [("Hi there!", None), ("Yo!", None)]
