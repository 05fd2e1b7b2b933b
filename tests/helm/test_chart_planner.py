"""The chart's `kvmesh planner` (planner.enabled): its manifests are valid Kubernetes objects, its
Role may only get and patch the two pools' scale, the pools it scales leave `replicas` to it and
have no other autoscaler, and a planner process started with exactly the environment the chart
renders scales the pools of a Kubernetes API emulator. A pool with a persistent disk KV tier is a
StatefulSet: the planner is told so and its Role names `statefulsets/scale` for it."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import yaml

from services.config import PlannerConfig, known_env_names, parse_config
from services.planner.kube import apps_api
from services.planner.main import Planner
from tests.helm.chart import CHART, CRD_GROUPS, FULLNAME, RELEASE, by_kind, containers, env_of, helm, run_helm  # noqa: F401
from tests.services.planner.kube_emulator import FakePrometheus, KubeEmulator

PLANNER = {"planner": {"enabled": True, "prometheusUrl": "http://prometheus-operated.monitoring:9090",
                       "decode": {"minReplicas": 2, "maxReplicas": 5}, "config": {"max-step": 1}}}
NAME = f"{FULLNAME}-planner"
WAIT_S = 30.0


def render(helm: str, values: dict, tmp_path) -> subprocess.CompletedProcess:
    return run_helm(helm, "template", RELEASE, str(CHART), "--namespace", "llm", values=values, tmp=tmp_path)


@pytest.fixture(scope="module")
def docs(helm, tmp_path_factory) -> list[dict]:
    out = render(helm, PLANNER, tmp_path_factory.mktemp("planner"))
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_planner_manifests_are_valid_kubernetes_objects(docs):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    mine = [d for d in docs if d["metadata"]["name"] == NAME]
    assert {d["kind"] for d in mine} == {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service",
                                         "NetworkPolicy"}
    for doc in mine:
        kubernetes_validate.validate(doc, version, strict=True)


def test_role_gets_and_patches_the_two_pools_scale_only(docs):
    (rule,) = by_kind(docs, "Role")[NAME]["rules"]
    assert rule == {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "patch"],
                    "resourceNames": [f"{FULLNAME}-prefill", f"{FULLNAME}-decode"]}
    binding = by_kind(docs, "RoleBinding")[NAME]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": NAME, "namespace": "llm"}]
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    pod = by_kind(docs, "Deployment")[NAME]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == NAME and pod["automountServiceAccountToken"] is True
    for name, dep in by_kind(docs, "Deployment").items():   # no other pod holds a token
        if name != NAME:
            assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_scaled_pools_leave_replicas_to_the_planner(docs):
    deps = by_kind(docs, "Deployment")
    assert "replicas" not in deps[f"{FULLNAME}-prefill"]["spec"]
    assert "replicas" not in deps[f"{FULLNAME}-decode"]["spec"]
    assert not by_kind(docs, "HorizontalPodAutoscaler") and not by_kind(docs, "ScaledObject")


def test_network_policy_lets_it_reach_the_api_server_and_prometheus_only(docs):
    policy = by_kind(docs, "NetworkPolicy")[NAME]
    ports = [sorted(p["port"] for p in rule["ports"]) for rule in policy["spec"]["egress"]]
    assert ports == [[53, 53], [443, 6443], [9090]]
    (ingress,) = policy["spec"]["ingress"]
    assert [p["port"] for p in ingress["ports"]] == [9090]


def planner_env(docs) -> dict[str, str]:
    (c,) = containers(by_kind(docs, "Deployment")[NAME])
    env = {k: v["value"] for k, v in env_of(c).items() if "value" in v}
    return {k: v.replace("$(POD_IP)", "127.0.0.1") for k, v in env.items()}


def test_the_rendered_environment_is_a_valid_planner_config(docs):
    env = planner_env(docs)
    assert not sorted(n for n in env if n.startswith("KVMESH_") and n not in known_env_names())
    cfg = parse_config(PlannerConfig, [], "kvmesh planner",
                       env={k: v for k, v in env.items() if k.startswith("KVMESH_")})
    assert (cfg.prefill_deployment, cfg.decode_deployment) == (f"{FULLNAME}-prefill", f"{FULLNAME}-decode")
    assert cfg.decode_selector == f'namespace="llm",service="{FULLNAME}-decode"'
    assert cfg.gateway_selector == f'namespace="llm",service="{FULLNAME}-gateway"'
    assert (cfg.decode_min_replicas, cfg.decode_max_replicas, cfg.max_step) == (2, 5, 1)
    assert cfg.kube_namespace == "llm" and cfg.metrics_port == 9090 and not cfg.dry_run


@pytest.mark.parametrize("values, message", [
    ({"planner": {"enabled": True}}, "planner.enabled needs planner.prometheusUrl"),
    ({**PLANNER, "workerPools": {"decode": {"autoscaling": {"enabled": True}}}},
     "planner.enabled and workerPools.decode's HPA or KEDA ScaledObject both scale"),
    ({**PLANNER, "worker": {"keda": {"enabled": True, "serverAddress": "http://p:9090"}}},
     "planner.enabled and workerPools.prefill's HPA or KEDA ScaledObject both scale"),
    ({"planner": {**PLANNER["planner"], "config": {"decode-max-replicas": 3}}},
     "planner.config.decode-max-replicas is set by the chart"),
])
def test_conflicts_fail_with_a_clear_message(helm, tmp_path, values, message):
    out = render(helm, values, tmp_path)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_a_planner_started_like_the_chart_pod_scales_the_pools(docs, tmp_path):
    """The chart's environment, with only the addresses pointed at the emulators: the decode
    pool's KV usage is high, so the planner patches it up by max-step 1 to its maximum 5."""
    emu = KubeEmulator("llm", {f"{FULLNAME}-prefill": 1, f"{FULLNAME}-decode": 2})
    prom = FakePrometheus(lambda: {"kvmesh_kv_usage_ratio": 0.97, "kvmesh_inter_token_latency_seconds": 0.01,
                                   "kvmesh_worker_time_to_first_token_seconds": 1.0,
                                   "kvmesh_worker_pending_prompt_tokens": 4096.0})
    env = {**os.environ, **planner_env(docs), "KVMESH_PROMETHEUS_URL": prom.url, "KVMESH_METRICS_PORT": "0",
           "KVMESH_INTERVAL_S": "0.1", "KVMESH_SCALE_UP_COOLDOWN_S": "0", "PYTHONPATH": str(CHART.parents[1])}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    log = tmp_path / "planner.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "planner", "--kubeconfig",
                                 str(emu.kubeconfig(tmp_path / "kubeconfig"))], cwd=CHART.parents[1], env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and emu.replicas[f"{FULLNAME}-decode"] < 5 and proc.poll() is None:
            time.sleep(0.05)
        assert emu.replicas == {f"{FULLNAME}-prefill": 1, f"{FULLNAME}-decode": 5}, log.read_text()[-3000:]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        prom.close()
        emu.close()
    assert [b["spec"]["replicas"] for *_, b, _ in emu.patches] == [3, 4, 5]
    assert any(f'service="{FULLNAME}-decode"' in q for q in prom.queries)


# The decode pool keeps its disk KV tier on a claim per worker: a StatefulSet the planner scales.
PERSISTENT = {**PLANNER, "workerPools": {"decode": {"kvOffload": {"disk": {"enabled": True, "persistent": True}}}}}


@pytest.fixture(scope="module")
def sts_docs(helm, tmp_path_factory) -> list[dict]:
    out = render(helm, PERSISTENT, tmp_path_factory.mktemp("planner-sts"))
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_a_persistent_pool_is_a_statefulset_the_planner_scales(sts_docs):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    sts = by_kind(sts_docs, "StatefulSet")[f"{FULLNAME}-decode"]
    assert f"{FULLNAME}-decode" not in by_kind(sts_docs, "Deployment")
    assert "replicas" not in sts["spec"] and sts["spec"]["podManagementPolicy"] == "Parallel"
    for doc in [sts, *(d for d in sts_docs if d["metadata"]["name"] == NAME)]:
        kubernetes_validate.validate(doc, version, strict=True)
    assert by_kind(sts_docs, "Role")[NAME]["rules"] == [
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "patch"],
         "resourceNames": [f"{FULLNAME}-prefill"]},
        {"apiGroups": ["apps"], "resources": ["statefulsets/scale"], "verbs": ["get", "patch"],
         "resourceNames": [f"{FULLNAME}-decode"]}]
    env = planner_env(sts_docs)
    assert env["KVMESH_DECODE_STATEFULSET"] == f"{FULLNAME}-decode" and "KVMESH_DECODE_DEPLOYMENT" not in env
    assert env["KVMESH_PREFILL_DEPLOYMENT"] == f"{FULLNAME}-prefill"


def test_a_planner_configured_like_the_chart_pod_scales_the_statefulset(sts_docs, tmp_path):
    """In-process, on the rendered environment: the decode StatefulSet grows on high KV usage
    through statefulsets/{name}/scale (a Deployment of that name does not exist in the emulator)."""
    emu = KubeEmulator("llm", {f"{FULLNAME}-prefill": 1, f"{FULLNAME}-decode": 2},
                       statefulsets=frozenset({f"{FULLNAME}-decode"}))
    env = {k: v for k, v in planner_env(sts_docs).items() if k.startswith("KVMESH_")}
    cfg = parse_config(PlannerConfig, [], "kvmesh planner", env={**env, "KVMESH_SCALE_UP_COOLDOWN_S": "0"})

    class Busy:
        def read_all(self, wanted):
            return {"ttft_p90_s": 1.0, "pending_prompt_tokens": 4096.0, "itl_p90_s": 0.01, "kv_usage": 0.97}

    try:
        planner = Planner(cfg, Busy(), apps_api(str(emu.kubeconfig(tmp_path / "kubeconfig")), 5.0))
        for now in range(4):
            planner.tick(float(now))
    finally:
        emu.close()
    assert emu.replicas == {f"{FULLNAME}-prefill": 1, f"{FULLNAME}-decode": 5}
    assert [b["spec"]["replicas"] for *_, b, _ in emu.patches] == [3, 4, 5]
