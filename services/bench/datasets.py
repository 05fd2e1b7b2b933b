"""Benchmark workloads: each loader returns requests (or conversations) with known lengths.

| --dataset-name           | what one item is                                                       |
|--------------------------|------------------------------------------------------------------------|
| random                   | random tokens, input/output lengths fixed or drawn from a range         |
| sharegpt                 | first human/gpt turn pair of a ShareGPT JSON file, vLLM's filter rules  |
| sharegpt-synthetic       | random tokens with ShareGPT-like lognormal lengths (no file needed)     |
| generated-shared-prefix  | groups of prompts sharing a system prompt (SGLang's gsp workload)       |
| multi-turn               | a Conversation of one user: each turn resends the history (chat API)    |
| custom                   | JSONL lines {"prompt": str, "output_tokens": int}                      |
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.bench.tokens import TokenCounter

# vLLM's ShareGPT filter (benchmarks/datasets.py is_valid_sequence): drop tiny and oversized pairs.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]  # text, or token ids (only for the completions endpoint)
    prompt_len: int  # tokens, as the endpoint counts them (tokens.py), measured
    output_len: int | None  # sent as max_tokens; None lets the server decide


@dataclass(frozen=True)
class Conversation:
    turns: tuple[SampleRequest, ...]  # each turn's new user message; history is added when sent


@dataclass(frozen=True)
class DatasetOptions:
    """Everything the loaders read; built by cli.py from the flags of the same names."""

    name: str = "random"
    path: str | None = None
    num_prompts: int = 1000
    prompt_token_ids: bool = False  # build prompts as id lists (random / synthetic / gsp)
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    sharegpt_output_len: int | None = None
    gsp_num_groups: int = 64
    gsp_prompts_per_group: int = 16
    gsp_system_prompt_len: int = 2048
    gsp_question_len: int = 128
    gsp_output_len: int = 256
    multi_turn_num_turns: int = 10
    multi_turn_user_len: int = 64
    multi_turn_output_len: int = 64
    multi_turn_users: int | None = None  # conversations (one user each); None: num_prompts
    multi_turn_history_tokens: int | None = None  # the last turn's history; sets multi_turn_user_len
    custom_output_len: int = 256


def load_dataset(opts: DatasetOptions, counter: TokenCounter, seed: int) -> list[SampleRequest] | list[Conversation]:
    rng = np.random.default_rng(seed)
    loaders = {
        "random": _random,
        "sharegpt": _sharegpt,
        "sharegpt-synthetic": _sharegpt_synthetic,
        "generated-shared-prefix": _generated_shared_prefix,
        "multi-turn": _multi_turn,
        "custom": _custom,
    }
    if opts.name not in loaders:
        raise ValueError(f"unknown dataset {opts.name!r}; choose one of {', '.join(loaders)}")
    items = loaders[opts.name](opts, counter, rng)
    if not items:
        raise ValueError(f"dataset {opts.name!r} produced no requests; check --dataset-path and the length flags")
    return items


def range_bounds(length: int, ratio: float) -> tuple[int, int]:
    """vLLM's --random-range-ratio: lengths uniform in [floor(L*(1-r)), ceil(L*(1+r))], r in [0, 1)."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    return math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio))


def _make_prompt(n: int, prefix: list[int] | str, opts: DatasetOptions, counter: TokenCounter,
                 rng: np.random.Generator) -> SampleRequest:
    """A prompt of `prefix` followed by n random tokens (output_len filled in by the caller)."""
    if opts.prompt_token_ids:
        ids = list(prefix) + counter.random_ids(n, rng)
        return SampleRequest(ids, len(ids), None)
    text, length = counter.random_prompt(prefix, n, rng)
    return SampleRequest(text, length, None)


def _with_output(req: SampleRequest, output_len: int | None) -> SampleRequest:
    return SampleRequest(req.prompt, req.prompt_len, output_len)


def _shared_prefix(n: int, opts: DatasetOptions, counter: TokenCounter, rng) -> list[int] | str:
    if n <= 0:
        return [] if opts.prompt_token_ids else ""
    return counter.random_ids(n, rng) if opts.prompt_token_ids else counter.random_text(n, rng)


def _random(opts: DatasetOptions, counter: TokenCounter, rng) -> list[SampleRequest]:
    in_lo, in_hi = range_bounds(opts.random_input_len, opts.random_range_ratio)
    out_lo, out_hi = range_bounds(opts.random_output_len, opts.random_range_ratio)
    input_lens = rng.integers(max(in_lo, 1), max(in_hi, 1) + 1, size=opts.num_prompts)
    output_lens = rng.integers(max(out_lo, 1), max(out_hi, 1) + 1, size=opts.num_prompts)
    prefix = _shared_prefix(opts.random_prefix_len, opts, counter, rng)
    return [_with_output(_make_prompt(int(i), prefix, opts, counter, rng), int(o))
            for i, o in zip(input_lens, output_lens)]


def sharegpt_pairs(path: str) -> list[list[dict]]:
    """Conversations of a ShareGPT JSON file that have at least two turns."""
    data = json.loads(Path(path).read_text())
    return [d["conversations"] for d in data if len(d.get("conversations", [])) >= 2]


def is_valid_sharegpt(prompt_len: int, output_len: int, output_len_fixed: bool) -> bool:
    if prompt_len < SHAREGPT_MIN_LEN or (not output_len_fixed and output_len < SHAREGPT_MIN_LEN):
        return False
    return prompt_len <= SHAREGPT_MAX_PROMPT_LEN and prompt_len + output_len <= SHAREGPT_MAX_TOTAL_LEN


def _sharegpt(opts: DatasetOptions, counter: TokenCounter, rng) -> list[SampleRequest]:
    if not opts.path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json "
                         "(or use --dataset-name sharegpt-synthetic)")
    convs = sharegpt_pairs(opts.path)
    out: list[SampleRequest] = []
    for idx in rng.permutation(len(convs)):
        prompt, completion = convs[idx][0]["value"], convs[idx][1]["value"]
        prompt_len = counter.prompt_len(prompt)
        fixed = opts.sharegpt_output_len is not None
        output_len = opts.sharegpt_output_len if fixed else counter.count(completion)
        if is_valid_sharegpt(prompt_len, output_len, fixed):
            out.append(SampleRequest(prompt, prompt_len, output_len))
            if len(out) == opts.num_prompts:
                break
    return out


def synthetic_sharegpt_lengths(n: int, rng) -> list[tuple[int, int]]:
    """(input, output) lengths, lognormal with means ~200 / ~180, kept inside vLLM's ShareGPT filter."""
    pairs: list[tuple[int, int]] = []
    while len(pairs) < n:
        # mean of lognormal(mu, s) is exp(mu + s^2/2): mu = ln(mean) - s^2/2.
        i = int(rng.lognormal(math.log(200) - 0.5 * 0.9**2, 0.9))
        o = int(rng.lognormal(math.log(180) - 0.5 * 0.8**2, 0.8))
        if is_valid_sharegpt(i, o, output_len_fixed=False):
            pairs.append((i, o))
    return pairs


def _sharegpt_synthetic(opts: DatasetOptions, counter: TokenCounter, rng) -> list[SampleRequest]:
    return [_with_output(_make_prompt(i, [] if opts.prompt_token_ids else "", opts, counter, rng), o)
            for i, o in synthetic_sharegpt_lengths(opts.num_prompts, rng)]


def _generated_shared_prefix(opts: DatasetOptions, counter: TokenCounter, rng) -> list[SampleRequest]:
    """gsp_num_groups system prompts, each followed by gsp_prompts_per_group questions; shuffled."""
    out: list[SampleRequest] = []
    for _ in range(opts.gsp_num_groups):
        system = _shared_prefix(opts.gsp_system_prompt_len, opts, counter, rng)
        for _ in range(opts.gsp_prompts_per_group):
            req = _make_prompt(opts.gsp_question_len, system, opts, counter, rng)
            out.append(_with_output(req, opts.gsp_output_len))
    return [out[i] for i in rng.permutation(len(out))]


def multi_turn_user_len(opts: DatasetOptions) -> int:
    """Tokens of each user message. With multi_turn_history_tokens H, T turns and O output tokens a
    turn, the last turn sends T user messages and T - 1 replies: T x user_len + (T - 1) x O = H.

        turn 1   [u1]
        turn 2   [u1 r1 u2]
        turn T   [u1 r1 u2 r2 ... uT]      ~ H tokens (the chat template adds its own on top)
    """
    if opts.multi_turn_history_tokens is None:
        return opts.multi_turn_user_len
    turns, out = opts.multi_turn_num_turns, opts.multi_turn_output_len
    user_len = (opts.multi_turn_history_tokens - (turns - 1) * out) // turns
    if user_len < 1:
        raise ValueError(f"--multi-turn-history-tokens {opts.multi_turn_history_tokens} cannot hold {turns} turns "
                         f"with {out} output tokens each; give at least {(turns - 1) * out + turns}")
    return user_len


def _multi_turn(opts: DatasetOptions, counter: TokenCounter, rng) -> list[Conversation]:
    if opts.path:
        return _sharegpt_conversations(opts, counter, rng)
    text_opts = DatasetOptions(prompt_token_ids=False)  # chat messages are always text
    user_len = multi_turn_user_len(opts)
    users = opts.multi_turn_users if opts.multi_turn_users is not None else opts.num_prompts
    return [Conversation(tuple(_with_output(_make_prompt(user_len, "", text_opts, counter, rng),
                                            opts.multi_turn_output_len)
                               for _ in range(opts.multi_turn_num_turns)))
            for _ in range(users)]


def _sharegpt_conversations(opts: DatasetOptions, counter: TokenCounter, rng) -> list[Conversation]:
    """Human turns of ShareGPT conversations as user messages; the following gpt turn sets max_tokens."""
    convs = sharegpt_pairs(opts.path)
    out: list[Conversation] = []
    for idx in rng.permutation(len(convs)):
        turns = []
        msgs = convs[idx]
        for user, reply in zip(msgs[0::2], msgs[1::2]):
            out_len = max(counter.count(reply["value"]), 1)
            turns.append(SampleRequest(user["value"], counter.prompt_len(user["value"]), out_len))
        out.append(Conversation(tuple(turns[: opts.multi_turn_num_turns])))
        if len(out) == (opts.multi_turn_users or opts.num_prompts):
            break
    return out


def _custom(opts: DatasetOptions, counter: TokenCounter, rng) -> list[SampleRequest]:
    if not opts.path:
        raise ValueError("--dataset-name custom needs --dataset-path FILE.jsonl")
    out: list[SampleRequest] = []
    for lineno, line in enumerate(Path(opts.path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("prompt"), str):
            raise ValueError(f"{opts.path}:{lineno}: each line needs a string \"prompt\"")
        out.append(SampleRequest(row["prompt"], counter.prompt_len(row["prompt"]),
                                 int(row.get("output_tokens", opts.custom_output_len))))
        if len(out) == opts.num_prompts:
            break
    return out
