"""Dataset loaders: ShareGPT filter, random ranges, gsp prefixes, multi-turn, custom, token exactness."""
import json

import numpy as np
import pytest

from services.bench.datasets import (Conversation, DatasetOptions, load_dataset, range_bounds,
                                     synthetic_sharegpt_lengths)
from services.bench.tokens import LocalTokenizer, TokenCounter, approx_token_count

WORDS = TokenCounter()  # no tokenizer: one word = one token


def words(n):
    return " ".join(["word"] * n)


def test_sharegpt_filter_rules(tmp_path):
    convs = [
        {"id": "ok", "conversations": [{"from": "human", "value": words(10)}, {"from": "gpt", "value": words(20)}]},
        {"id": "one-turn", "conversations": [{"from": "human", "value": words(10)}]},
        {"id": "short-prompt", "conversations": [{"from": "human", "value": words(3)}, {"from": "gpt", "value": words(20)}]},
        {"id": "short-out", "conversations": [{"from": "human", "value": words(10)}, {"from": "gpt", "value": words(3)}]},
        {"id": "long-prompt", "conversations": [{"from": "human", "value": words(1025)}, {"from": "gpt", "value": words(5)}]},
        {"id": "long-total", "conversations": [{"from": "human", "value": words(1000)}, {"from": "gpt", "value": words(1049)}]},
        {"id": "edge", "conversations": [{"from": "human", "value": words(1024)}, {"from": "gpt", "value": words(1024)}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    reqs = load_dataset(DatasetOptions(name="sharegpt", path=str(path), num_prompts=100), WORDS, seed=0)
    assert sorted((r.prompt_len, r.output_len) for r in reqs) == [(10, 20), (1024, 1024)]
    # A fixed output length skips the short-output check (vLLM's rule), not the size limits.
    reqs = load_dataset(DatasetOptions(name="sharegpt", path=str(path), num_prompts=100, sharegpt_output_len=3),
                        WORDS, seed=0)
    assert sorted(r.prompt_len for r in reqs) == [10, 10, 1000, 1024]


def test_random_lengths_within_range():
    assert range_bounds(100, 0.5) == (50, 150)
    with pytest.raises(ValueError):
        range_bounds(100, 1.0)
    opts = DatasetOptions(name="random", num_prompts=200, random_input_len=100, random_output_len=40,
                          random_range_ratio=0.25, random_prefix_len=10)
    reqs = load_dataset(opts, WORDS, seed=1)
    ins = [r.prompt_len for r in reqs]
    outs = [r.output_len for r in reqs]
    assert 10 + 75 <= min(ins) and max(ins) <= 10 + 125 and len(set(ins)) > 20
    assert 30 <= min(outs) and max(outs) <= 50
    prefix = reqs[0].prompt.split()[:10]
    assert all(r.prompt.split()[:10] == prefix for r in reqs)
    fixed = load_dataset(DatasetOptions(name="random", num_prompts=20, random_input_len=64, random_output_len=8),
                         WORDS, seed=0)
    assert {r.prompt_len for r in fixed} == {64} and {r.output_len for r in fixed} == {8}


def test_random_prompts_are_token_exact_with_tokenizer(tiny_tokenizer):
    counter = TokenCounter(tiny_tokenizer)
    reqs = load_dataset(DatasetOptions(name="random", num_prompts=20, random_input_len=50, random_output_len=4,
                                       random_range_ratio=0.5), counter, seed=0)
    assert all(counter.prompt_len(r.prompt) == r.prompt_len for r in reqs)
    assert sum(25 <= r.prompt_len <= 75 for r in reqs) == 20
    ids = load_dataset(DatasetOptions(name="random", num_prompts=5, random_input_len=30, random_output_len=4,
                                      prompt_token_ids=True), counter, seed=0)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len == 30 for r in ids)


def test_generated_shared_prefix_groups():
    opts = DatasetOptions(name="generated-shared-prefix", gsp_num_groups=3, gsp_prompts_per_group=4,
                          gsp_system_prompt_len=32, gsp_question_len=8, gsp_output_len=5)
    reqs = load_dataset(opts, WORDS, seed=0)
    assert len(reqs) == 12 and {r.output_len for r in reqs} == {5}
    prefixes = {}
    for r in reqs:
        prefixes.setdefault(" ".join(r.prompt.split()[:32]), []).append(r)
    assert sorted(len(v) for v in prefixes.values()) == [4, 4, 4]
    assert all(r.prompt_len == 40 for r in reqs)


def test_multi_turn_conversations():
    opts = DatasetOptions(name="multi-turn", num_prompts=3, multi_turn_num_turns=4, multi_turn_user_len=12,
                          multi_turn_output_len=6)
    convs = load_dataset(opts, WORDS, seed=0)
    assert len(convs) == 3 and all(isinstance(c, Conversation) and len(c.turns) == 4 for c in convs)
    assert all(t.prompt_len == 12 and t.output_len == 6 for c in convs for t in c.turns)


def test_multi_turn_users_and_history_length():
    """--multi-turn-users conversations; --multi-turn-history-tokens sizes the user messages so that
    the last turn sends that much history: T messages and T - 1 replies."""
    opts = DatasetOptions(name="multi-turn", num_prompts=50, multi_turn_users=4, multi_turn_num_turns=10,
                          multi_turn_output_len=20, multi_turn_history_tokens=1000)
    convs = load_dataset(opts, WORDS, seed=0)
    assert len(convs) == 4 and all(len(c.turns) == 10 for c in convs)
    user_len = convs[0].turns[0].prompt_len
    assert user_len == (1000 - 9 * 20) // 10 == 82
    assert 1000 - 10 < 10 * user_len + 9 * 20 <= 1000
    assert len(load_dataset(DatasetOptions(name="multi-turn", num_prompts=3, multi_turn_num_turns=2), WORDS, 0)) == 3
    with pytest.raises(ValueError, match="--multi-turn-history-tokens 100 cannot hold 10 turns"):
        load_dataset(DatasetOptions(name="multi-turn", multi_turn_num_turns=10, multi_turn_output_len=20,
                                    multi_turn_history_tokens=100), WORDS, seed=0)


def test_synthetic_sharegpt_lengths():
    pairs = synthetic_sharegpt_lengths(3000, np.random.default_rng(0))
    ins, outs = np.array(pairs).T
    assert 150 < ins.mean() < 250 and 140 < outs.mean() < 220
    assert ins.min() >= 4 and ins.max() <= 1024 and (ins + outs).max() <= 2048


def test_custom_jsonl(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"prompt": "one two three", "output_tokens": 7}\n\n{"prompt": "four, five"}\n')
    reqs = load_dataset(DatasetOptions(name="custom", path=str(path), custom_output_len=9), WORDS, seed=0)
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(3, 7), (3, 9)]
    assert approx_token_count("four, five") == 3


@pytest.fixture
def bos_tokenizer(tiny_tokenizer, tmp_path) -> str:
    """The tiny tokenizer with a post-processor that puts <s> in front, as llama's does."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(f"{tiny_tokenizer}/tokenizer.json")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(tmp_path / "tokenizer.json"))
    return str(tmp_path)


class CountsOnly:
    """What a server's /tokenize gives: counts, no vocabulary (so prompts are built from words)."""

    name = "counts only"

    def __init__(self, path: str):
        self._tok = LocalTokenizer(path)

    def count(self, text: str, add_special_tokens: bool) -> int:
        return self._tok.count(text, add_special_tokens)


@pytest.mark.parametrize("backend", ["vocabulary", "counts"])
def test_prompt_lengths_count_the_bos_of_the_completions_endpoint(bos_tokenizer, backend):
    tok = bos_tokenizer if backend == "vocabulary" else CountsOnly(bos_tokenizer)
    completions, chat = TokenCounter(tok), TokenCounter(tok, chat=True)
    opts = DatasetOptions(name="random", num_prompts=10, random_input_len=40, random_output_len=4)
    # completions: the bos is one of the 40 (what usage.prompt_tokens reports); a prefix adds its own 8
    for req in load_dataset(opts, completions, seed=0):
        assert req.prompt_len == 40 == completions.prompt_len(req.prompt) == completions.count(req.prompt) + 1
    with_prefix = DatasetOptions(name="random", num_prompts=10, random_input_len=40, random_output_len=4,
                                 random_prefix_len=8)
    assert {r.prompt_len for r in load_dataset(with_prefix, completions, seed=0)} == {48}
    # chat: the message's own 40 tokens (the template adds its tokens on top)
    assert all(r.prompt_len == 40 == chat.count(r.prompt) for r in load_dataset(opts, chat, seed=0))
