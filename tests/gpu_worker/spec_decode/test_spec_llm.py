"""speculative_config through the offline entry points: LLM(...) and `kvmesh generate` give the
same text and tokens as without it, with drafts accepted."""
from __future__ import annotations

import json

from gpu_worker import LLM, SamplingParams
from gpu_worker.cli_generate import main as generate_main
from tests.gpu_worker.engine.conftest import tiny_models  # noqa: F401  (fixture)
from tests.gpu_worker.spec_decode.spec_fakes import ngram, repetitive

PROMPTS = ["one two three one two three one two three one two", "a b c d e f g h"]
# token ids whose greedy continuation on the tiny llama repeats itself (drafts get accepted)
CYCLING = [{"prompt_token_ids": repetitive(20, 3 + i, 10 + i)} for i in range(4)]


def test_llm_generate_is_unchanged_by_speculation(tiny_models):
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1, stop=["zz"])] * 3
    outs = []
    for spec in (None, ngram(k=3, lo=1, hi=3)):
        llm = LLM(model=tiny_models["llama"], device="cpu", num_gpu_blocks=64, speculative_config=spec)
        got = llm.generate(PROMPTS + CYCLING, params, use_tqdm=False)
        outs.append([(c.token_ids, c.text, c.finish_reason, round(c.cumulative_logprob or 0.0, 4))
                     for o in got for c in o.outputs])
        llm.llm_engine.block_manager.check_integrity()
        assert llm.llm_engine.block_manager.num_used_blocks == 0
    assert outs[0] == outs[1]
    assert llm.llm_engine.stats().extra["spec_decode"]["accepted"] > 0


def test_kvmesh_generate_takes_the_flag(tiny_models, capsys):
    runs = []
    for extra in ([], ["--speculative-config", ngram(k=3, lo=1, hi=3)]):
        assert generate_main(["--model", tiny_models["llama"], "--device", "cpu", "--num-gpu-blocks", "64",
                              "--max-tokens", "24", "--temperature", "0", "--ignore-eos", "--json",
                              "--prompt", PROMPTS[0], *extra]) == 0
        runs.append(json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"])
    assert runs[0] == runs[1] and len(runs[0]) == 24
