"""The config tree: flags, KVMESH_* env, defaults, loud failures."""
from __future__ import annotations

import re

import pytest

from services.config import (
    ConfigError, GatewayConfig, PlannerConfig, SchedulerConfig, ServeConfig, WorkerConfig, build_parser,
    known_env_names, parse_config, to_argv)


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
    ({"KVMESH_LEASE_MS": "100"}, "--lease-ms=100 must be at least 3 x --heartbeat-ms"),
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


def _kvmesh_names_in_code() -> set[str]:
    """Every "KVMESH_*" string literal in the product's code outside services/config.py."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    found = set()
    for pkg in ("gpu_worker", "services", "tokenizer_svc", "scheduler_svc", "prefix_cache_svc"):
        for path in (root / pkg).rglob("*.py"):
            if path != root / "services" / "config.py":
                found |= set(re.findall(r"[\"'](KVMESH_[A-Z0-9_]+)[\"']", path.read_text()))
    return found


def test_every_kvmesh_variable_read_in_code_is_known():
    """A KVMESH_* variable the code reads outside the config tree must be in EXTERNAL_ENV, or a
    process started with it set would refuse it as unknown."""
    read = _kvmesh_names_in_code()
    assert {"KVMESH_DECODE_GEMV_MAX_M", "KVMESH_FP8_GEMV_MAX_M", "KVMESH_CACHE_DIR"} <= read   # the scan sees them
    assert read <= known_env_names(), read - known_env_names()


def test_every_external_variable_is_read_by_code():
    """EXTERNAL_ENV allows only names some code reads: an allowed name that nothing reads is a
    setting that silently does nothing."""
    from services.config import EXTERNAL_ENV, TUNING_ENV
    assert EXTERNAL_ENV - _kvmesh_names_in_code() == set()
    from gpu_worker.config import tuning_from_env
    defaults = tuning_from_env({})
    changed = {"KVMESH_DECODE_ATTENTION": "u+2p", "KVMESH_DECODE_GEMV_MAX_M": "2", "KVMESH_DECODE_GEMV_WEIGHTS": "fp8",
               "KVMESH_DECODE_GEMV_FUSE": "1", "KVMESH_FP8_GEMV_MAX_M": "8", "KVMESH_PDL": "0"}
    assert set(changed) == TUNING_ENV
    for name, value in changed.items():                  # each one changes the engine's tuning
        assert tuning_from_env({name: value}) != defaults, name


@pytest.mark.parametrize("cls, argv, needle", [
    (ServeConfig, ["--workers", "-1"], "--workers=-1 must be at least 0"),
    (ServeConfig, ["--workers", "0"], "--workers=0 needs --prefill-workers and --decode-workers"),
    (ServeConfig, ["--prefill-workers", "1"], "--prefill-workers and --decode-workers go together"),
    # a hand-off moves one process's cache: refused before a model loads, not at the role's start
    (ServeConfig, ["--prefill-workers", "1", "--decode-workers", "1", "--tensor-parallel-size", "2"],
     "--prefill-workers with --tensor-parallel-size=2"),
    (WorkerConfig, ["--redis-url", "redis://x", "--role", "decode", "--tensor-parallel-size", "2"],
     "--role=decode with --tensor-parallel-size=2"),
    (WorkerConfig, ["--redis-url", "redis://x", "--handoff-lease-ms", "10"], "--handoff-lease-ms=10 must be at least 100"),
    (ServeConfig, ["--port", "70000"], "--port=70000 must be at most 65535"),
    # serve passes both to every service it starts: refused up front, not by a child mid-start
    (ServeConfig, ["--lease-ms", "100", "--heartbeat-ms", "1000"], "--lease-ms=100 must be at least 3 x --heartbeat-ms"),
    # both listen on loopback: the fleet page's bind would fail once the whole stack is up
    (ServeConfig, ["--port", "9000", "--fleet-metrics-port", "9000"], "--fleet-metrics-port=9000 is also --port"),
    # float() takes nan and inf, which pass every `value < min` comparison
    (ServeConfig, ["--route-conversation-ttl-s", "nan"], "--route-conversation-ttl-s=nan must be a finite number"),
    (ServeConfig, ["--null-step-ms", "inf"], "--null-step-ms=inf must be a finite number"),
    (PlannerConfig, ["--scale-up-cooldown-s", "nan"], "--scale-up-cooldown-s=nan must be a finite number"),
    # redis-py's URL parser would raise inside the process, as a traceback; the value (it may hold
    # the password) is not echoed
    (GatewayConfig, ["--redis-url", "notaurl"], "--redis-url must be a redis://, rediss:// or unix:// URL"),
    (ServeConfig, ["--redis-url", ":pw@localhost:6379"], "--redis-url must be a redis://"),
    (ServeConfig, ["--port", "0"], "--port=0 must be at least 1"),
    (ServeConfig, ["--gpu-memory-utilization", "0"], "--gpu-memory-utilization=0.0 must be greater than 0"),
    (ServeConfig, ["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization=1.5 must be at most 1"),
    (ServeConfig, ["--max-num-seqs", "0"], "--max-num-seqs=0 must be at least 1"),
    (ServeConfig, ["--max-model-len", "-1"], "--max-model-len=-1 must be at least 2"),
    (ServeConfig, ["--device", "tpu"], "--device='tpu' must be auto, cpu, cuda or cuda:N"),
    (ServeConfig, ["--dtype", "int8"], "--dtype='int8' must be one of"),
    (WorkerConfig, ["--redis-url", "redis://x", "--metrics-port", "-2"], "--metrics-port=-2 must be at least -1"),
    (WorkerConfig, ["--redis-url", "redis://x", "--block-size", "0"], "--block-size='0' must be one of: 4, 8, 16"),
    (ServeConfig, ["--block-size", "7"], "--block-size='7' must be one of: 4, 8, 16, 32, 64, 128"),
    (ServeConfig, ["--served-model-name", "a,b,a"], "--served-model-name=['a', 'b', 'a'] names 'a' twice"),
    (WorkerConfig, ["--redis-url", "redis://x", "--served-model-name", "m, m"], "--served-model-name=['m', 'm'] names"),
    (WorkerConfig, ["--redis-url", "redis://x", "--device", "cuda:x"], "--device='cuda:x' must be"),
    (GatewayConfig, ["--redis-url", "redis://x", "--max-body-bytes", "0"], "--max-body-bytes=0 must be at least 1"),
    (SchedulerConfig, ["--redis-url", "redis://x", "--route-cpu-credit", "2"], "--route-cpu-credit=2.0 must be at most 1"),
])
def test_out_of_range_values_name_their_flag(cls, argv, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        parse_config(cls, argv, "prog", env={})


@pytest.mark.parametrize("cls", [GatewayConfig, ServeConfig])
@pytest.mark.parametrize("argv, env", [
    (["--api-key", ""], {}),
    (["--api-key", " , "], {}),            # `--api-key "$A,$B"` with both unset
    ([], {"KVMESH_API_KEY": ""}),
    ([], {"KVMESH_API_KEY": ","}),
])
def test_an_api_key_given_empty_is_refused_not_read_as_no_key(cls, argv, env):
    """Read as "no key", the gateway would serve anyone while its operator believed it locked."""
    with pytest.raises(ConfigError) as exc:
        parse_config(cls, argv + ["--redis-url", "redis://x"] * (cls is GatewayConfig), "prog", env=env)
    assert "--api-key / KVMESH_API_KEY" in str(exc.value) and "serve anyone" in str(exc.value)


def test_an_empty_api_key_is_refused_from_code_too_and_never_echoed():
    with pytest.raises(ConfigError, match="--api-key must not hold an empty item") as exc:
        GatewayConfig(redis_url="redis://x", api_key=["sk-hunter2", " "])   # "" would match a missing header
    assert "hunter2" not in str(exc.value)
    assert GatewayConfig(redis_url="redis://x").api_key == []        # unset: no key, on purpose


def test_kvmesh_serve_with_an_empty_api_key_exits_2_naming_the_flag(monkeypatch, capsys):
    from services.config import load_or_exit
    monkeypatch.setenv("KVMESH_API_KEY", ",")
    with pytest.raises(SystemExit) as exc:
        load_or_exit(ServeConfig, [], "kvmesh serve")
    assert exc.value.code == 2 and "KVMESH_API_KEY=','" in capsys.readouterr().err


def test_a_bad_redis_url_is_not_echoed():
    """Pods' logs keep the error; the URL in it may carry the Redis password."""
    with pytest.raises(ConfigError) as exc:
        parse_config(WorkerConfig, [], "prog", env={"KVMESH_REDIS_URL": ":hunter2@redis:6379"})
    assert "hunter2" not in str(exc.value) and "--redis-url" in str(exc.value)


def test_bounds_hold_for_env_values_and_code_too():
    with pytest.raises(ConfigError, match=re.escape("--max-num-seqs=-4 must be at least 1")):
        parse_config(ServeConfig, [], "prog", env={"KVMESH_MAX_NUM_SEQS": "-4"})
    with pytest.raises(ConfigError, match="--lease-ms=0 must be at least 1"):
        ServeConfig(lease_ms=0)
    ok = parse_config(WorkerConfig, ["--redis-url", "redis://x", "--device", "cuda:1", "--metrics-port", "-1",
                                     "--port", "0", "--gpu-memory-utilization", "1"], "prog", env={})
    assert (ok.device, ok.metrics_port, ok.port, ok.gpu_memory_utilization) == ("cuda:1", -1, 0, 1.0)


def test_every_numeric_flag_has_bounds():
    """A new int/float flag states what it takes (opt's min/max/above), or is listed here on purpose."""
    import dataclasses

    from services.config import SECTIONS, _base_type
    unbounded = {"seed"}      # any integer seeds the engine
    for cls in SECTIONS:
        for f in dataclasses.fields(cls):
            if _base_type(f.type)[0] in (int, float) and f.name not in unbounded:
                assert {"min", "max", "above", "choices"} & set(f.metadata), f"{cls.__name__}.{f.name} has no bounds"
