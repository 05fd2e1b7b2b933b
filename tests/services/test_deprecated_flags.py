"""One text flag everywhere (--text-in-gateway / KVMESH_TEXT_IN_GATEWAY); the names it replaced
still work, each use logging one warning that names what it means now."""
from __future__ import annotations

import logging

import pytest

from services.config import ConfigError, GatewayConfig, ServeConfig, known_env_names, parse_config


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvmesh.config" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("argv, env", [
    (["--local-tokenizer", "/m", "--local-detokenizer"], {}),
    (["--local-tokenizer=/m"], {}),
    ([], {"KVMESH_LOCAL_TOKENIZER": "/m", "KVMESH_LOCAL_DETOKENIZER": "true"}),
    (["--text-in-gateway", "--model", "/m"], {}),
])
def test_gateway_old_names_mean_text_in_gateway(caplog, argv, env):
    caplog.set_level(logging.WARNING, "kvmesh.config")
    cfg = parse_config(GatewayConfig, argv, "kvmesh gateway", env=env)
    assert (cfg.text_in_gateway, cfg.model) == (True, "/m")
    old = [a.split("=")[0] for a in argv if a.startswith("--local")] + list(env)
    assert len(warnings_of(caplog)) == len(old)
    assert all(any(name in w and "deprecated" in w for w in warnings_of(caplog)) for name in old)


@pytest.mark.parametrize("argv, env, expected", [
    ([], {}, True),
    (["--no-tokenize-in-gateway"], {}, False),
    (["--no-detokenize-in-gateway"], {}, False),
    (["--tokenize-in-gateway", "--detokenize-in-gateway"], {}, True),
    ([], {"KVMESH_TOKENIZE_IN_GATEWAY": "false"}, False),
    ([], {"KVMESH_DETOKENIZE_IN_GATEWAY": "0"}, False),
    (["--no-text-in-gateway"], {}, False),
    ([], {"KVMESH_TEXT_IN_GATEWAY": "false"}, False),
])
def test_serve_old_names_mean_text_in_gateway(caplog, argv, env, expected):
    caplog.set_level(logging.WARNING, "kvmesh.config")
    assert parse_config(ServeConfig, argv, "kvmesh serve", env=env).text_in_gateway is expected
    assert len(warnings_of(caplog)) == sum("tokenize" in a.lower() for a in [*argv, *env])


def test_the_new_variable_wins_over_an_old_one():
    env = {"KVMESH_TEXT_IN_GATEWAY": "true", "KVMESH_TOKENIZE_IN_GATEWAY": "false"}
    assert parse_config(ServeConfig, [], "kvmesh serve", env=env).text_in_gateway is True


def test_old_variables_are_known_names():
    assert {"KVMESH_LOCAL_TOKENIZER", "KVMESH_LOCAL_DETOKENIZER", "KVMESH_TOKENIZE_IN_GATEWAY",
            "KVMESH_DETOKENIZE_IN_GATEWAY", "KVMESH_TEXT_IN_GATEWAY"} <= known_env_names()


def test_text_in_gateway_needs_the_model_directory():
    with pytest.raises(ConfigError, match="--text-in-gateway needs --model"):
        parse_config(GatewayConfig, ["--text-in-gateway"], "kvmesh gateway", env={})
    assert parse_config(GatewayConfig, [], "kvmesh gateway", env={}).text_in_gateway is False
