"""--speculative-config: parsed as vLLM's JSON, every mistake named by its key, and taken with
async scheduling (the served default) as without."""
from __future__ import annotations

import subprocess
import sys

import pytest

from gpu_worker.config import EngineConfig
from services.speculative import DEFAULT_BACKOFF_MAX_STEPS, DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig, parse_speculative_config


def test_ngram_config_parses_with_defaults():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert cfg == SpeculativeConfig("ngram", 3, 2, 4, DEFAULT_DISABLE_BY_BATCH_SIZE)
    assert parse_speculative_config(None) is None and parse_speculative_config("") is None
    assert cfg.backoff_max_steps == DEFAULT_BACKOFF_MAX_STEPS > 0        # back-off on by default
    off = parse_speculative_config('{"method": "draft_model", "model": "/m", "backoff_max_steps": 0}')
    assert off.backoff_max_steps == 0


@pytest.mark.parametrize("text, named", [
    ('{"method": "ngram", "num_speculative_tokens": 9}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 3}', "prompt_lookup_min"),
    ('{"method": "ngram", "prompt_lookup_max": 65}', "prompt_lookup_max"),
    ('{"method": "ngram", "disable_by_batch_size": 0}', "disable_by_batch_size"),
    ('{"method": "ngram", "backoff_max_steps": -1}', "backoff_max_steps"),
    ('{"method": "ngram", "backoff_max_steps": 65537}', "backoff_max_steps"),
    ('{"method": "mtp", "backoff_max_steps": false}', "backoff_max_steps"),
    ('{"method": "draft_model"}', "model"),
    ('{"method": "draft_model", "model": ""}', "model"),
    ('{"method": "draft_model", "model": 3}', "model"),
    ('{"method": "draft_model", "model": "/m", "draft_tensor_parallel_size": 2}', "draft_tensor_parallel_size"),
    ('{"method": "ngram", "model": "/m"}', "model"),
    ('{"method": "mtp", "model": "/m"}', "model"),
    ('{"method": "eagle"}', "method"),
    ('{"num_speculative_tokens": 4}', "method"),
    ('{"method": "ngram", "typo": 1}', "'typo'"),
    ('[1, 2]', "JSON object"),
    ('{"method": ', "not valid JSON"),
])
def test_bad_values_name_their_key(text, named):
    with pytest.raises(ValueError, match="invalid speculative_config") as e:
        parse_speculative_config(text)
    assert named in str(e.value)


def test_draft_model_config_parses():
    cfg = parse_speculative_config('{"method": "draft_model", "model": "/d", "num_speculative_tokens": 3, '
                                   '"draft_tensor_parallel_size": 1}')
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens, cfg.draft_tensor_parallel_size) == \
        ("draft_model", "/d", 3, 1)
    with pytest.raises(ValueError, match="draft_model runs with tensor_parallel_size 1 only"):
        EngineConfig(model="/m", speculative_config='{"method": "draft_model", "model": "/d"}',
                     tensor_parallel_size=2)


def test_mtp_config_parses_and_needs_one_device():
    cfg = parse_speculative_config('{"method": "mtp", "num_speculative_tokens": 2}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.model) == ("mtp", 2, None)
    with pytest.raises(ValueError, match="mtp runs with tensor_parallel_size 1 only"):
        EngineConfig(model="/m", speculative_config='{"method": "mtp"}', tensor_parallel_size=2)
    # an MoE model's MTP layer is MoE, but its experts are not sharded: expert parallelism refused too
    with pytest.raises(ValueError, match="mtp runs with tensor_parallel_size 1 only, with or without "
                                         "enable_expert_parallel"):
        EngineConfig(model="/m", speculative_config='{"method": "mtp"}', tensor_parallel_size=2,
                     enable_expert_parallel=True)


def test_engine_config_validates_and_takes_async_scheduling():
    good = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert EngineConfig(model="/m", speculative_config=good).speculative.num_speculative_tokens == 2
    with pytest.raises(ValueError, match="invalid engine argument speculative_config: num_speculative_tokens"):
        EngineConfig(model="/m", speculative_config='{"method": "ngram", "num_speculative_tokens": 99}')
    both = EngineConfig(model="/m", speculative_config=good, async_scheduling=True)
    assert both.async_scheduling and both.speculative.method == "ngram"


def test_cli_names_the_flag_and_key():
    """kvmesh generate with a bad value exits with a message, not a traceback."""
    proc = subprocess.run([sys.executable, "-m", "gpu_worker.cli_generate", "--model", "/nonexistent", "--prompt",
                           "hi", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 20}'],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--speculative-config: invalid engine argument speculative_config: num_speculative_tokens" in proc.stderr


def test_a_dict_is_taken_as_vllm_llm_takes_it():
    """vLLM's LLM(speculative_config={...}) passes the object itself; the field keeps its JSON (what
    a worker's flag carries), and a value of another type is an error naming the field."""
    cfg = EngineConfig(model="/m", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert cfg.speculative.num_speculative_tokens == 3
    assert isinstance(cfg.speculative_config, str)
    with pytest.raises(ValueError, match="invalid engine argument speculative_config: method must be one of"):
        EngineConfig(model="/m", speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="invalid engine argument speculative_config: .*JSON object"):
        EngineConfig(model="/m", speculative_config=["ngram"])
