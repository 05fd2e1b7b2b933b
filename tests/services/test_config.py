"""The config tree: flags, KVMESH_* env, defaults, loud failures."""
from __future__ import annotations

import pytest

from services.config import (
    ConfigError, GatewayConfig, ServeConfig, WorkerConfig, build_parser, known_env_names, parse_config, to_argv)


def test_precedence_flag_env_default():
    cfg = parse_config(WorkerConfig, ["--max-num-seqs", "7"], "w",
                       env={"KVMESH_MAX_NUM_SEQS": "9", "KVMESH_ROLE": "decode", "KVMESH_NULL_MODEL": "true"})
    assert cfg.max_num_seqs == 7 and cfg.role == "decode" and cfg.null_model is True
    assert cfg.block_size == 16


def test_lists_and_bools():
    cfg = parse_config(GatewayConfig, ["--api-key", "a, b"], "g", env={})
    assert cfg.api_key == ["a", "b"]
    assert parse_config(GatewayConfig, [], "g", env={"KVMESH_API_KEY": "k"}).api_key == ["k"]
    assert parse_config(WorkerConfig, ["--no-enable-prefix-caching"], "w", env={}).enable_prefix_caching is False


@pytest.mark.parametrize("env, needle", [
    ({"KVMESH_MAX_NUM_SEQ": "1"}, "KVMESH_MAX_NUM_SEQS"),      # typo: names the close match
    ({"KVMESH_PORT": "eighty"}, "KVMESH_PORT"),
    ({"KVMESH_ROLE": "boss"}, "mixed"),
    ({"KVMESH_NULL_MODEL": "maybe"}, "KVMESH_NULL_MODEL"),
    ({"KVMESH_LEASE_MS": "100"}, "lease_ms"),
])
def test_bad_env_fails_loudly(env, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_config(WorkerConfig, [], "w", env=env)


def test_unknown_flag_exits():
    with pytest.raises(SystemExit):
        parse_config(WorkerConfig, ["--nope"], "w", env={})


def test_core_names_exist_and_help_has_env():
    names = known_env_names()
    for name in ("KVMESH_REDIS_URL", "KVMESH_MODEL", "KVMESH_HOST", "KVMESH_ADVERTISE_HOST", "KVMESH_PORT",
                 "KVMESH_ROLE", "KVMESH_DEVICE", "KVMESH_API_KEY"):
        assert name in names
    text = build_parser(WorkerConfig, "kvmesh worker").format_help()
    assert "KVMESH_MAX_NUM_SEQS" in text and "Engine: most sequences" in text


def test_to_argv_round_trip():
    cfg = ServeConfig(workers=3, api_key=["a", "b"], null_model=True, prefix_cache=False)
    assert parse_config(ServeConfig, to_argv(cfg), "s", env={}) == cfg


def test_advertise_host():
    assert WorkerConfig(host="0.0.0.0").reachable_host() == "127.0.0.1"
    assert WorkerConfig(host="0.0.0.0", advertise_host="10.0.0.5").reachable_host() == "10.0.0.5"


@pytest.mark.parametrize("cls", [WorkerConfig, GatewayConfig, ServeConfig])
def test_empty_bind_host_is_refused(cls):
    """An empty host would bind every interface; only an explicit 0.0.0.0 may."""
    with pytest.raises(ConfigError, match="KVMESH_HOST is empty"):
        parse_config(cls, ["--host", ""], "x", env={})
    with pytest.raises(ConfigError, match="KVMESH_HOST is empty"):
        parse_config(cls, [], "x", env={"KVMESH_HOST": " "})
    assert parse_config(cls, [], "x", env={}).host == "127.0.0.1"


def test_every_kvmesh_variable_read_in_code_is_known():
    """A KVMESH_* variable the code reads outside the config tree must be in EXTERNAL_ENV, or a
    process started with it set would refuse it as unknown."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    read = set()
    for pkg in ("gpu_worker", "services", "tokenizer_svc", "scheduler_svc", "prefix_cache_svc"):
        for path in (root / pkg).rglob("*.py"):
            read |= set(re.findall(r"environ(?:\.get\(|\[)\s*\"(KVMESH_[A-Z0-9_]+)\"", path.read_text()))
    assert {"KVMESH_DECODE_GEMV_MAX_M", "KVMESH_FP8_GEMV_MAX_M"} <= read     # the scan sees them
    assert read <= known_env_names(), read - known_env_names()
