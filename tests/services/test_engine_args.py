"""Every engine field (services/engine_args.py's EngineArgs, gpu_worker/config.py's EngineConfig)
reaches the engine from every entry point: `kvmesh serve` (through the worker flags it hands on),
`kvmesh worker` (flags and KVMESH_* variables), `kvmesh generate`, `LLM(**kwargs)` and the Helm
chart's `worker.engine` and pools' `engine`; and each entry point's default is the one declared default: EngineArgs'
offline one for LLM / generate, SERVED_DEFAULTS' (else EngineArgs') for serve / worker / Helm."""
from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpu_worker.cli_generate import _engine_args
from gpu_worker.cli_generate import build_parser as generate_parser
from gpu_worker.config import EngineConfig
from gpu_worker.llm import LLM
from gpu_worker.service.main import engine_config
from services.config import ServeConfig, WorkerConfig, build_parser, env_name, flag_name, parse_config
from services.engine_args import ENGINE_FIELDS, SERVED_DEFAULTS, EngineArgs, ServedEngineArgs
from services.launcher import _disk_tier_flags, _engine_flags
from services.options import out_of_bounds
from tests.helm.chart import CHART, RELEASE, containers, env_of, helm, run_helm  # noqa: F401 (helm: a fixture)

# EngineConfig fields that are deliberately no flag, with the way they are set instead.
NOT_FLAGS = {"tuning": "the KVMESH_* tuning variables (services/config.py's TUNING_ENV), read when "
                       "an EngineConfig is built",
             "kv_offload_shared_key": "a secret: the worker derives it from its --trust-dir (shared_tier_key)"}
SHARED_KEY = bytes(range(32))          # what a worker's trust directory gives when the samples share a tier
# Engine fields `kvmesh serve` sets per worker itself rather than through _engine_flags.
PER_WORKER = ("model", "device", "kv_offload_dir")
# Engine fields the Helm chart sets from values of its own, and why.
HELM_SET = {"device": "worker.device: pods that request GPUs run on cuda",
            "tensor_parallel_size": "worker.gpus: one rank per GPU of the pod (set above 1 only)",
            "max_num_batched_tokens": "workerPools.prefill.engine: large steps, no decodes to wait behind them",
            "max_num_seqs": "workerPools.decode.engine: many sequences a step"}
FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}


def _non_default(f: dataclasses.Field, default: Any) -> Any:
    """A valid value of field `f` other than `default`, so that a lost value shows."""
    meta = f.metadata
    if meta.get("choices"):
        value = next(c for c in meta["choices"] if c != default)
    elif isinstance(default, bool):
        value = not default
    elif f.name in ("model", "model_id", "kv_offload_dir"):
        value = f"/models/{f.name}"
    elif f.name == "speculative_config":
        value = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    elif "pattern" in meta:                  # the device
        value = "cpu"
    elif isinstance(default, float):
        value = default / 2 if default else meta.get("min", 0) + 1.5
    else:                                    # counts, possibly None ("not set")
        value = (default if default is not None else meta.get("min", 1)) + 3
        if "max" in meta and value > meta["max"]:
            value = meta["max"]
    assert value != default and out_of_bounds(value, meta) is None, (f.name, value)
    return value


OFFLINE = {name: f.default for name, f in FIELDS.items()}
SERVED = {**OFFLINE, **{name: d.default for name, d in SERVED_DEFAULTS.items()}}
# Values other than the default of the entry point they go through.
OFFLINE_SAMPLES = {name: _non_default(f, OFFLINE[name]) for name, f in FIELDS.items()}
SERVED_SAMPLES = {name: _non_default(f, SERVED[name]) for name, f in FIELDS.items()}
# Fields whose samples may not meet in one config (fp8 KV and KV tiers with tensor parallelism,
# KV tiers without prefix caching): set in a round of their own.
APART = ("kv_cache_dtype", "kv_offload_cpu_gb", "kv_offload_dir", "kv_offload_disk_gb", "kv_offload_shared_dir",
         "kv_offload_shared_gb", "kv_load_policy")


def rounds(samples: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in samples.items() if k not in APART},
            {k: samples[k] for k in ("model", *APART)}]


def _as_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _flags(values: dict[str, Any]) -> list[str]:
    argv: list[str] = []
    for name, value in values.items():
        if isinstance(value, bool):
            argv.append(flag_name(name) if value else "--no-" + flag_name(name)[2:])
        else:
            argv += [flag_name(name), str(value)]
    return argv


def test_every_engine_config_field_is_an_engine_arg_or_named_as_no_flag():
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert names == set(ENGINE_FIELDS) | set(NOT_FLAGS)
    assert not set(SERVED_DEFAULTS) - set(ENGINE_FIELDS)


@pytest.mark.parametrize("samples", rounds(SERVED_SAMPLES))
def test_serve_flags_reach_the_workers_engine(samples):
    serve = parse_config(ServeConfig, _flags(samples), "kvmesh serve", env={})
    handed_on = _engine_flags(serve)
    worker_argv = ["--model", serve.model, "--device", serve.device, *handed_on, *_disk_tier_flags(serve, "worker-0")]
    config = engine_config(parse_config(WorkerConfig, worker_argv, "kvmesh worker", env={}), SHARED_KEY)
    for name, value in samples.items():
        if name == "kv_offload_dir":             # one directory per worker, under serve's
            value = f"{value}/worker-0"
        assert getattr(config, name) == value, name
    assert not {flag_name(name) for name in PER_WORKER} & set(handed_on)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_serve_gives_the_speculative_config_to_decode_workers_and_prefill_ones_ignore_it(method):
    """Every pool gets serve's engine flags; a prefill worker draws first tokens only, so its
    engine runs without a proposer while the decode worker's speculates; but with mtp, whose KV
    of the prompt only the prefill worker can compute (it moves with the hand-off)."""
    spec = f'{{"method": "{method}", "num_speculative_tokens": 3}}'
    serve = parse_config(ServeConfig, ["--prefill-workers", "1", "--decode-workers", "1",
                                       "--speculative-config", spec], "kvmesh serve", env={})
    argv = ["--model", "/m", *_engine_flags(serve)]
    assert argv[argv.index("--speculative-config") + 1] == spec
    configs = {role: engine_config(parse_config(WorkerConfig, [*argv, "--role", role], "kvmesh worker", env={}))
               for role in ("prefill", "decode", "mixed")}
    prefill = configs["prefill"].speculative
    assert prefill is None if method == "ngram" else prefill.method == "mtp"
    assert configs["decode"].speculative.method == configs["mixed"].speculative.method == method


@pytest.mark.parametrize("source", ["flags", "env"])
@pytest.mark.parametrize("samples", rounds(SERVED_SAMPLES))
def test_worker_flags_and_env_reach_the_engine(source, samples):
    if source == "flags":
        cfg = parse_config(WorkerConfig, _flags(samples), "kvmesh worker", env={})
    else:
        env = {env_name(name): _as_text(value) for name, value in samples.items()}
        cfg = parse_config(WorkerConfig, [], "kvmesh worker", env=env)
    config = engine_config(cfg, SHARED_KEY)
    for name, value in samples.items():
        assert getattr(config, name) == value, name


@pytest.mark.parametrize("samples", rounds(OFFLINE_SAMPLES))
def test_generate_flags_reach_the_engine(samples):
    args = generate_parser().parse_args(["--model", "/m", "--prompt", "Hi", *_flags(samples)])
    # kvmesh generate has no trust directory: its shared tier's key comes only through LLM(...)
    config = EngineConfig.from_kwargs(**_engine_args(args), kv_offload_shared_key=SHARED_KEY)
    for name, value in samples.items():
        assert getattr(config, name) == value, name


@pytest.mark.parametrize("samples", rounds(OFFLINE_SAMPLES))
def test_llm_takes_every_field_as_a_keyword(samples):
    params = inspect.signature(LLM.__init__).parameters
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    assert not (set(ENGINE_FIELDS) - {"model"}) & set(params), "an LLM parameter hides an engine field"
    config = EngineConfig.from_kwargs(**{"model": "/m", **samples}, kv_offload_shared_key=SHARED_KEY)
    for name, value in samples.items():
        assert getattr(config, name) == value, name


def _worker_pods(helm: str, values: dict, tmp_path: Path) -> dict[str, dict]:
    out = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", "llm", values=values, tmp=tmp_path)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment"]
    pods = {d["metadata"]["name"]: containers(d)[0] for d in docs if containers(d)[0]["command"] == ["kvmesh", "worker"]}
    assert pods
    return pods


def _worker_envs(helm: str, values: dict, tmp_path: Path) -> dict[str, dict[str, str]]:
    """Each worker pool's environment as its container sees it: the shared ConfigMap (envFrom)
    under the container's own `env`, which wins, as in Kubernetes."""
    out = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", "llm", values=values, tmp=tmp_path)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    shared = next(d["data"] for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config"))
    envs = {}
    for d in docs:
        if d["kind"] == "Deployment" and containers(d)[0]["command"] == ["kvmesh", "worker"]:
            names = [e["name"] for e in containers(d)[0]["env"]]
            assert len(names) == len(set(names)), (d["metadata"]["name"], "a variable twice")
            container_env = {n: e["value"] for n, e in env_of(containers(d)[0]).items() if "value" in e}
            envs[d["metadata"]["name"]] = {**shared, **container_env}
    assert envs
    return envs


@pytest.mark.parametrize("samples", rounds(SERVED_SAMPLES))
def test_helm_worker_engine_reaches_the_engine(helm, tmp_path, samples):
    """`engine: {max-num-seqs: ..., ...}` with every engine field, in `worker` and in each pool (whose
    own map wins key by key): each becomes its KVMESH_* variable in every worker pool's container,
    and the worker's config parser turns the container's environment into the sampled values.
    The fields the chart sets from values of its own, which `engine` refuses, go through those:
    tensor-parallel-size through `worker.config` (the chart derives it from `gpus`), device through
    `worker.device`, model through `model.path` and block-size through the top-level `config`,
    which the prefix-cache index reads too."""
    own = {"tensor_parallel_size", "device", "model", "block_size"}
    engine = {flag_name(name)[2:]: value for name, value in samples.items() if name not in own}
    config = {flag_name(name)[2:]: value for name, value in samples.items() if name == "tensor_parallel_size"}
    values = {"worker": {"engine": engine, "config": config},
              "workerPools": {pool: {"engine": engine} for pool in ("prefill", "decode")}}
    if "device" in samples:
        values["worker"]["device"] = samples["device"]
    if "model" in samples:
        values["model"] = {"path": samples["model"]}
    if "block_size" in samples:
        values["config"] = {"block-size": samples["block_size"]}
    engine_env = {env_name(name) for name in ENGINE_FIELDS}
    for pod, pod_env in _worker_envs(helm, values, tmp_path).items():
        env = {name: value for name, value in pod_env.items() if name in engine_env}
        config = engine_config(parse_config(WorkerConfig, [], "kvmesh worker", env=env), SHARED_KEY)
        for name, value in samples.items():
            assert getattr(config, name) == value, (pod, name)


def test_defaults_are_the_declared_ones(helm, tmp_path):
    offline, served = OFFLINE, SERVED
    # LLM(...) and kvmesh generate: EngineArgs' defaults, generate adding none of its own
    config = EngineConfig.from_kwargs(model="/m")
    assert {name: getattr(config, name) for name in ENGINE_FIELDS} == {**offline, "model": "/m"}
    assert _engine_args(generate_parser().parse_args(["--model", "/m", "--prompt", "Hi"])) == {"model": "/m"}
    # kvmesh worker and kvmesh serve: the served defaults; serve hands its workers no engine flag
    for cls in (WorkerConfig, ServeConfig):
        cfg = parse_config(cls, [], "x", env={})
        assert {name: getattr(cfg, name) for name in ENGINE_FIELDS} == served, cls.__name__
    assert _engine_flags(ServeConfig()) == []
    config = engine_config(WorkerConfig(model="/m"))
    assert {name: getattr(config, name) for name in ENGINE_FIELDS} == {**served, "model": "/m"}
    # Helm: no engine variable in a worker pod unless the chart sets it from its own values
    for pod, container in _worker_pods(helm, {}, tmp_path).items():
        set_by_chart = {name for name in ENGINE_FIELDS if env_name(name) in env_of(container)}
        assert set_by_chart <= set(HELM_SET) | {"model"}, (pod, set_by_chart)


def test_help_shows_every_engine_field_once_with_one_default():
    for parser in (build_parser(ServeConfig, "kvmesh serve"), build_parser(WorkerConfig, "kvmesh worker"),
                   generate_parser()):
        for name in ENGINE_FIELDS:
            flags = [a for a in parser._actions if flag_name(name) in a.option_strings]
            assert len(flags) == 1, (parser.prog, name)
            assert flags[0].help.count("(default: ") == 1, (parser.prog, name)


@pytest.mark.parametrize("env, field, expected", [
    ({"KVMESH_MAX_MODEL_LEN": "0"}, "max_model_len", None),      # 0: the model's limit, as before
    ({"KVMESH_NUM_GPU_BLOCKS": "0"}, "num_gpu_blocks", None),
    ({"KVMESH_QUANTIZATION": ""}, "quantization", None),
    ({"KVMESH_QUANTIZATION": "fp8"}, "quantization", "fp8"),
])
def test_existing_worker_settings_keep_their_meaning(env, field, expected):
    assert getattr(engine_config(parse_config(WorkerConfig, ["--model", "/m"], "w", env=env)), field) == expected


def test_served_engine_args_differ_from_offline_only_where_declared():
    for f in dataclasses.fields(ServedEngineArgs):
        expected = SERVED_DEFAULTS[f.name].default if f.name in SERVED_DEFAULTS else FIELDS[f.name].default
        assert f.default == expected, f.name


@pytest.mark.parametrize("command, defaults", [("serve", SERVED), ("worker", SERVED), ("generate", OFFLINE)])
def test_cli_help_lists_every_engine_flag_once_with_its_default(command, defaults):
    """`kvmesh <command> --help` as a user runs it: every engine flag once, with the default that
    entry point applies (generate's are LLM(...)'s)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    out = subprocess.run([sys.executable, "-m", "services.cli", command, "--help"], capture_output=True, text=True,
                         timeout=120, env=env, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())       # argparse wraps help lines
    for name in ENGINE_FIELDS:
        flag = flag_name(name)
        # an option's entry is the one line that starts with two spaces and the flag
        assert len(re.findall(rf"^  {re.escape(flag)}(?![\w-])", out.stdout, re.M)) == 1, (command, flag)
    for name in SERVED_DEFAULTS:
        entry = text[text.index(" " + flag_name(name)) + 1:]
        shown = re.search(r"\(default: ([^)]*)\)", entry).group(1)
        assert shown in (str(defaults[name]), repr(defaults[name])), (command, name, shown)
