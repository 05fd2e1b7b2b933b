"""The chart's disk KV tier (worker.kvOffload.disk): an emptyDir per pod by default, or, with
`persistent`, a StatefulSet pool whose every worker keeps its own claim across restarts, scaled
and drained as a Deployment's pods are. Schemas: test_helm_chart.py renders the `kv-tier` values
through kubernetes-validate with the other value sets."""
from __future__ import annotations

import pytest
import yaml

from tests.helm.chart import CHART, FULLNAME, RELEASE, by_kind, containers, env_of, helm, render, run_helm  # noqa: F401

TIER_DIR = "/var/cache/kvmesh/kv-tier"


def _tier(pod_spec: dict) -> tuple[dict, dict]:
    """(the worker container's env, its kv-tier volume mount)."""
    (c,) = pod_spec["containers"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "kv-tier"]
    return env_of(c), mount


def test_a_persistent_tier_makes_the_pool_a_statefulset_with_a_claim_per_worker(helm, tmp_path_factory):
    docs = render(helm, "kv-tier", tmp_path_factory)
    sets, deps = by_kind(docs, "StatefulSet"), by_kind(docs, "Deployment")
    services = by_kind(docs, "Service")
    for pool, replicas in (("prefill", None), ("mixed", None)):       # autoscaled: replicas left to HPA / KEDA
        sts = sets[f"{FULLNAME}-{pool}"]
        assert f"{FULLNAME}-{pool}" not in deps
        spec = sts["spec"]
        assert "replicas" not in spec and "strategy" not in spec
        assert spec["serviceName"] == f"{FULLNAME}-{pool}" and services[spec["serviceName"]]["spec"]["clusterIP"] == "None"
        assert spec["podManagementPolicy"] == "Parallel"             # scale-down drains pods at once
        (claim,) = spec["volumeClaimTemplates"]
        assert claim["metadata"]["name"] == "kv-tier"
        assert claim["spec"]["storageClassName"] == "local-nvme"
        assert claim["spec"]["resources"]["requests"]["storage"] == "210Gi"     # 200 GiB of files + 5%
        pod = spec["template"]["spec"]
        assert "kv-tier" not in {v["name"] for v in pod["volumes"]}    # the claim is the volume
        env, mount = _tier(pod)
        assert mount["mountPath"] == "/var/cache/kvmesh"
        assert env["KVMESH_KV_OFFLOAD_DIR"]["value"] == TIER_DIR and env["KVMESH_KV_OFFLOAD_DISK_GB"]["value"] == "200"
        assert env["KVMESH_KV_OFFLOAD_CPU_GB"]["value"] == "32"
        assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    hpa = by_kind(docs, "HorizontalPodAutoscaler")[f"{FULLNAME}-prefill"]
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    keda = by_kind(docs, "ScaledObject")[f"{FULLNAME}-mixed"]
    assert keda["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    pdb = by_kind(docs, "PodDisruptionBudget")[f"{FULLNAME}-prefill"]
    assert pdb["spec"]["selector"]["matchLabels"] == sets[f"{FULLNAME}-prefill"]["spec"]["selector"]["matchLabels"]


def test_a_statefulset_pool_drains_like_a_deployment(helm, tmp_path_factory):
    """kubectl scale statefulset: the leaving pods get the same SIGTERM drain, grace period and
    preStop (none) as a Deployment pool's."""
    docs = render(helm, "kv-tier", tmp_path_factory)
    sts = by_kind(docs, "StatefulSet")[f"{FULLNAME}-prefill"]["spec"]["template"]["spec"]
    dep = by_kind(docs, "Deployment")[f"{FULLNAME}-decode"]["spec"]["template"]["spec"]
    assert sts["terminationGracePeriodSeconds"] == dep["terminationGracePeriodSeconds"]
    assert sts["containers"][0].get("lifecycle") == dep["containers"][0].get("lifecycle")


def test_a_tier_that_is_not_persistent_is_an_emptydir(helm, tmp_path_factory):
    docs = render(helm, "kv-tier", tmp_path_factory)
    dep = by_kind(docs, "Deployment")[f"{FULLNAME}-decode"]
    assert dep["spec"]["replicas"] == 3 and f"{FULLNAME}-decode" not in by_kind(docs, "StatefulSet")
    pod = dep["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == "kv-tier"]
    assert vol["emptyDir"] == {"sizeLimit": "210Gi"}
    env, _ = _tier(pod)
    assert env["KVMESH_KV_OFFLOAD_DIR"]["value"] == TIER_DIR
    # the default chart has no tier and no StatefulSet pool
    defaults = render(helm, "defaults", tmp_path_factory)
    assert not [s for s in by_kind(defaults, "StatefulSet") if "redis" not in s]
    for dep in by_kind(defaults, "Deployment").values():
        assert "KVMESH_KV_OFFLOAD_DIR" not in env_of(containers(dep)[0])


def test_the_tier_env_names_are_the_workers(helm, tmp_path_factory):
    known = pytest.importorskip("services.config").known_env_names()
    sts = by_kind(render(helm, "kv-tier", tmp_path_factory), "StatefulSet")[f"{FULLNAME}-prefill"]
    names = {n for n in env_of(containers(sts)[0]) if n.startswith("KVMESH_")}
    assert names - known == set()


@pytest.mark.parametrize("args, message", [
    (["--set", "worker.kvOffload.disk.enabled=true", "--set", "worker.engine.kv-offload-dir=/x"],
     "engine.kv-offload-dir and kvOffload.disk"),
    (["--set", "worker.kvOffload.disk.sizeGi=0"], "schema"),
    (["--set", "worker.kvOffload.disk.accessModes[0]=Sometimes"], "schema"),
    (["--set", "workerPools.decode.kvOffload.disk.nosuchkey=1"], "schema"),
])
def test_settings_that_cannot_work_are_refused(helm, args, message):
    out = run_helm(helm, "template", RELEASE, str(CHART), *args)
    assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]


def _shared_kv_key_source(pod_spec: dict) -> str:
    """The Secret a worker derives its shared-tier MAC key from: the worker CURVE secret of the
    trust volume mounted where KVMESH_TRUST_DIR points (services/security/bundle.shared_kv_key)."""
    (trust,) = [v["secret"] for v in pod_spec["volumes"] if v["name"] == "trust"]
    assert {"key": "curve-worker.secret", "path": "curve/worker.secret"} in trust["items"]
    (c,) = pod_spec["containers"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "trust"]
    assert env_of(c)["KVMESH_TRUST_DIR"]["value"] == mount["mountPath"]
    assert "KVMESH_INSECURE_INTERNAL_PLANES" not in env_of(c)
    return trust["secretName"]


def test_the_shared_tier_is_a_node_directory_or_an_existing_claim(helm, tmp_path_factory):
    docs = render(helm, "kv-tier", tmp_path_factory)
    decode = by_kind(docs, "Deployment")[f"{FULLNAME}-decode"]["spec"]["template"]["spec"]
    mixed = by_kind(docs, "StatefulSet")[f"{FULLNAME}-mixed"]["spec"]["template"]["spec"]
    for pod, volume in ((decode, {"hostPath": {"path": "/var/lib/kvmesh", "type": "Directory"}}),
                        (mixed, {"persistentVolumeClaim": {"claimName": "kv-shared"}})):
        (vol,) = [v for v in pod["volumes"] if v["name"] == "kv-shared"]
        assert {k: v for k, v in vol.items() if k != "name"} == volume
        (c,) = pod["containers"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "kv-shared"]
        env = env_of(c)
        assert mount["mountPath"] == "/var/cache/kvmesh-shared"
        assert env["KVMESH_KV_OFFLOAD_SHARED_DIR"]["value"] == "/var/cache/kvmesh-shared/kv-shared"
        assert _shared_kv_key_source(pod) == f"{FULLNAME}-trust-worker"      # one key for every pool
    assert env_of(decode["containers"][0])["KVMESH_KV_OFFLOAD_SHARED_GB"]["value"] == "50"
    prefill = by_kind(docs, "StatefulSet")[f"{FULLNAME}-prefill"]["spec"]["template"]["spec"]
    assert "kv-shared" not in {v["name"] for v in prefill["volumes"]}       # off by default
    assert "KVMESH_KV_OFFLOAD_SHARED_DIR" not in env_of(prefill["containers"][0])


@pytest.mark.parametrize("args, message", [
    (["--set", "worker.kvOffload.shared.enabled=true", "--set", "worker.engine.kv-offload-shared-gb=3"],
     "engine.kv-offload-shared-gb and kvOffload.shared"),
    (["--set", "worker.kvOffload.shared.hostPath=relative"], "schema"),
    (["--set", "workerPools.decode.kvOffload.shared.enabled=true", "--set", "security.insecureInternalPlanes=true"],
     "workerPools.decode: kvOffload.shared needs the trust Secrets"),
])
def test_shared_tier_settings_that_cannot_work_are_refused(helm, args, message):
    out = run_helm(helm, "template", RELEASE, str(CHART), *args)
    assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]


def test_the_shared_tier_runs_with_several_gpus_per_pod(helm):
    """Each rank bounds its own subdirectory to sizeGi / gpus (the engine splits it): the pod gets
    the pool's whole size, as with one GPU."""
    out = run_helm(helm, "template", RELEASE, str(CHART), "--set", "worker.kvOffload.shared.enabled=true",
                   "--set", "worker.kvOffload.shared.sizeGi=40", "--set", "worker.gpus=2",
                   "--set", "workerPools.prefill.enabled=false", "--set", "workerPools.decode.enabled=false",
                   "--set", "workerPools.mixed.enabled=true")
    assert out.returncode == 0, out.stderr[-2000:]
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")
            and "kv-shared" in {v["name"] for v in d["spec"]["template"]["spec"].get("volumes", [])}]
    assert pods
    for pod in pods:
        env = env_of(pod["containers"][0])
        assert env["KVMESH_KV_OFFLOAD_SHARED_GB"]["value"] == "40"
        assert env["KVMESH_TENSOR_PARALLEL_SIZE"]["value"] == "2"
