"""The vLLM-shaped offline API and `kvmesh generate` on a tiny llama."""
from __future__ import annotations

import json

import pytest

from gpu_worker import LLM, SamplingParams
from gpu_worker.cli_generate import main as generate_main
from gpu_worker.outputs import RequestError


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(model=tiny_models["llama"], device="cpu", num_gpu_blocks=64)


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_generate_shapes_and_text(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("The sky is")
    outs = llm.generate(["Hello world", ids, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello world", None, None]
    assert outs[0].prompt_token_ids == tok.encode("Hello world")
    assert outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.index == 0 and len(c.token_ids) == 12 and c.finish_reason == "length"
        assert c.text == tok.decode(c.token_ids)
        assert c.logprobs is None and c.cumulative_logprob is None
    assert outs[2].num_cached_tokens == 0     # 4-token prompt: no full block to reuse
    llm.llm_engine.block_manager.check_integrity()


def test_single_prompt_params_list_and_logprobs(llm):
    outs = llm.generate("abc", [SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True)],
                        use_tqdm=False)
    c = outs[0].outputs[0]
    assert len(c.logprobs) == 4 and all(len(d) >= 2 and t in d for d, t in zip(c.logprobs, c.token_ids))
    assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)


def test_prompt_logprobs_as_vllm(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("The sky is blue")
    [out] = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for tid, entry in zip(ids[1:], out.prompt_logprobs[1:]):
        assert tid in entry and 3 <= len(entry) <= 4 and entry[tid].decoded_token == tok.decode([tid])
        assert sorted(lp.rank for t, lp in entry.items() if t != tid or lp.rank <= 3)[:3] == [1, 2, 3]
    [plain] = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_stop_string_excluded_and_n_samples(llm):
    full = llm.generate("Hello world", GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = full[6:9]
    assert stop and stop not in full[:6]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop], n=3)
    out = llm.generate("Hello world", params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        assert c.finish_reason == "stop" and c.stop_reason == stop and c.text == full[:full.index(stop)]
    llm.llm_engine.block_manager.check_integrity()
    assert llm.llm_engine.block_manager.num_used_blocks == 0


def test_the_stop_token_is_no_text_and_min_tokens_holds_off_stop_strings(llm):
    """As the server's text (services/text/sample_text.py): the stop token that ended a sample
    counts but is not text; a stop string counts only past the min_tokens-th token."""
    tok = llm.get_tokenizer()
    full = llm.generate("Hello world", GREEDY, use_tqdm=False)[0].outputs[0]
    at = next(i for i in range(3, 12) if full.token_ids[i] not in full.token_ids[:i])
    stop_id = full.token_ids[at]
    out = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[:at + 1] and (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.text == tok.decode(full.token_ids[:at])
    # the text of token `at` as a stop string: ignored while min_tokens covers that token
    stop = tok.decode(full.token_ids[:at + 1])[len(tok.decode(full.token_ids[:at])):]
    first = full.text.index(stop)
    ends_in = next(i for i in range(12) if len(tok.decode(full.token_ids[:i + 1])) >= first + len(stop))
    held_off = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop],
                                                          min_tokens=ends_in + 1), use_tqdm=False)[0].outputs[0]
    assert held_off.text.startswith(full.text[:first + len(stop)])
    llm.llm_engine.block_manager.check_integrity()


def test_prefix_cache_reported(llm):
    prompt = "word " * 40
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens > 0


def test_bad_prompt_leaves_llm_usable(llm):
    with pytest.raises(RequestError, match="prompt_token_ids"):
        llm.generate([[1, 2], [99999]], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate("ok", GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_chat(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    assert "hi" in out.prompt and len(out.outputs[0].token_ids) == 12


def test_unknown_engine_argument(tiny_models):
    with pytest.raises(TypeError, match="max_num_seq\\b"):
        LLM(model=tiny_models["llama"], max_num_seq=4)


def test_cli_generate(tiny_models, capsys):
    rc = generate_main(["--model", tiny_models["qwen2"], "--prompt", "Hi", "--max-tokens", "5", "--temperature", "0",
                        "--device", "cpu", "--num-gpu-blocks", "32", "--json", "--n", "2"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["prompt"] == "Hi" and [len(o["token_ids"]) for o in data["outputs"]] == [5, 5]


@pytest.mark.parametrize("argv,flag", [
    (["--top-p", "2"], "--top-p"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--max-model-len", "99999"], "--max-model-len"),
    (["--n", "40"], "--n"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),          # the engine flags are EngineArgs' own
    (["--cuda-graph-max-bs", "0"], "--cuda-graph-max-bs"),
    (["--dtype", "int8"], "--dtype"),
    (["--max-n", "2", "--n", "3"], "--n"),
])
def test_cli_errors_name_the_flag(tiny_models, capsys, argv, flag):
    rc = generate_main(["--model", tiny_models["qwen2"], "--prompt", "Hi", "--device", "cpu", *argv])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"error: {flag}:" in err or f"error: {flag}=" in err, err


def test_cli_bad_tuning_variable_is_named_not_blamed_on_model(tiny_models, capsys, monkeypatch):
    monkeypatch.setenv("KVMESH_DECODE_GEMV_MAX_M", "x")
    rc = generate_main(["--model", tiny_models["qwen2"], "--prompt", "Hi", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("kvmesh generate: error: KVMESH_DECODE_GEMV_MAX_M='x'"), err


def test_allowed_token_ids_and_bad_words_offline(llm):
    """vLLM's SamplingParams fields: greedy tokens keep to allowed_token_ids; a bad word (encoded
    by the tokenizer, with and without a leading space) never appears in the text."""
    tok = llm.get_tokenizer()
    full = llm.generate("Hello world", GREEDY, use_tqdm=False)[0].outputs[0]
    allowed = sorted(set(full.token_ids[1:]))[:3] + [5]
    out = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                     allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)
    word = tok.decode(full.token_ids[2:4]).strip()
    assert word and word in full.text
    out = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                     bad_words=[word]), use_tqdm=False)[0].outputs[0]
    banned = [tok.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    assert not any(out.token_ids[i:i + len(b)] == b for b in banned for i in range(len(out.token_ids)))
    assert out.token_ids[:2] == full.token_ids[:2] and out.token_ids != full.token_ids
    with pytest.raises(RequestError, match="allowed_token_ids"):
        llm.generate("a", SamplingParams(allowed_token_ids=[]), use_tqdm=False)
    llm.llm_engine.block_manager.check_integrity()


def test_allowed_token_ids_against_a_grammar(llm):
    """allowed_token_ids disjoint from what guided_choice allows: a clear error, not a banned
    token 0; allowing a choice's tokens but not EOS: the choice, then "stop" at the grammar's end."""
    from services.protocol.sampling import StructuredOutput
    tok = llm.get_tokenizer()
    choice = StructuredOutput(choice=["yes", "no"])
    yes = tok.encode("yes", add_special_tokens=False)
    with pytest.raises(ValueError, match="no token can be generated at output position 0: allowed_token_ids and "
                                         "the structured output constraint"):
        llm.generate("Hello", SamplingParams(temperature=0.7, seed=1, n=2, max_tokens=5, structured=choice,
                                             allowed_token_ids=[7, 8], logprobs=2), use_tqdm=False)
    out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=5, structured=choice,
                                               allowed_token_ids=yes), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.text, out.finish_reason) == (yes, "yes", "stop")
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.block_manager.check_integrity()
    assert llm.llm_engine.block_manager.num_used_blocks == 0
