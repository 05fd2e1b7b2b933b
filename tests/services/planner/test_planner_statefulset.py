"""The planner scaling a StatefulSet pool (a persistent disk KV tier) through
`statefulsets/{name}/scale`, beside a Deployment pool, in-process: the official client against
the HTTP Kubernetes API emulator, the signals handed in, the clock passed to each round."""
from __future__ import annotations

import pytest

from services.config import ConfigError, PlannerConfig, parse_config
from services.planner.kube import apps_api
from services.planner.main import Planner
from tests.services.planner.kube_emulator import KubeEmulator

NS = "llm"
PREFILL, DECODE = "prod-kvmesh-prefill", "prod-kvmesh-decode"
BUSY = {"ttft_p90_s": 0.1, "pending_prompt_tokens": 0.0, "itl_p90_s": 0.01, "kv_usage": 0.97}
IDLE = {**BUSY, "kv_usage": 0.1}


class Signals:
    def __init__(self) -> None:
        self.now: dict[str, float | None] = {}

    def read_all(self, wanted: list[str]) -> dict[str, float | None]:
        return {name: self.now.get(name) for name in wanted}


def planner_for(emu: KubeEmulator, tmp_path, *flags: str) -> tuple[Planner, Signals]:
    cfg = parse_config(PlannerConfig, ["--kube-namespace", NS, "--max-step", "1", "--scale-up-cooldown-s", "0",
                                       "--stabilization-window-s", "10", *flags], "kvmesh planner", env={})
    source = Signals()
    return Planner(cfg, source, apps_api(str(emu.kubeconfig(tmp_path / "kubeconfig")), 5.0)), source


@pytest.fixture
def emu():
    emu = KubeEmulator(NS, {PREFILL: 1, DECODE: 2}, statefulsets=frozenset({DECODE}))
    yield emu
    emu.close()


def test_a_statefulset_pool_scales_up_and_down_beside_a_deployment_pool(emu, tmp_path):
    planner, signals = planner_for(emu, tmp_path, "--prefill-deployment", PREFILL, "--decode-statefulset", DECODE,
                                   "--decode-min-replicas", "2", "--decode-max-replicas", "4")
    signals.now = BUSY
    for now in (0.0, 1.0, 2.0, 3.0):
        planner.tick(now)
    assert emu.replicas == {PREFILL: 1, DECODE: 4}          # one pod a round up to the maximum
    # idle: one pod leaves per 10 s window (the highest ordinal, Kubernetes' choice), down to the minimum
    signals.now = IDLE
    shrinks = {now: [d.desired for d in planner.tick(now) if d.pool == "decode"]
               for now in (3.0, 12.0, 13.0, 23.0, 40.0)}
    assert shrinks == {3.0: [4], 12.0: [4], 13.0: [3], 23.0: [2], 40.0: [2]}
    assert [(name, body["spec"]["replicas"]) for _, name, body, _ in emu.patches] == [
        (DECODE, 3), (DECODE, 4), (DECODE, 3), (DECODE, 2)]
    assert {kind for *_, kind in emu.patches} == {"application/merge-patch+json"}


def test_a_statefulset_named_as_a_deployment_is_not_found_and_not_patched(emu, tmp_path, caplog):
    planner, signals = planner_for(emu, tmp_path, "--decode-deployment", DECODE)
    signals.now = BUSY
    assert planner.tick(0.0) == []
    assert f"cannot read the scale of deployment/{DECODE}: (404)" in caplog.text
    assert emu.patches == [] and emu.replicas[DECODE] == 2


def test_a_pool_named_both_ways_is_refused():
    with pytest.raises(ConfigError, match="--decode-deployment and --decode-statefulset both name the decode pool"):
        parse_config(PlannerConfig, ["--decode-deployment", "a", "--decode-statefulset", "b"], "kvmesh planner", env={})
    cfg = parse_config(PlannerConfig, [], "kvmesh planner", env={"KVMESH_PREFILL_STATEFULSET": "p"})
    assert cfg.prefill_statefulset == "p" and not cfg.prefill_deployment
