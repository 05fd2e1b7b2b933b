"""The optional KEDA ScaledObject per worker pool: its shape against KEDA's CRD fields (a JSON
schema written from keda.sh_scaledobjects.yaml, since kubernetes-validate knows no CRDs), its
target and query, and the refusal to render it beside the pool's own HPA."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.helm.chart import CHART, FULLNAME, RELEASE, by_kind, helm, run_helm  # noqa: F401

SCHEMA = json.loads((Path(__file__).parent / "schemas" / "keda_scaledobject.schema.json").read_text())
PROMETHEUS = "http://prometheus-operated.monitoring:9090"
KEDA = {"worker": {"keda": {"enabled": True, "serverAddress": PROMETHEUS}},
        "workerPools": {"mixed": {"enabled": True}}}


def render(helm: str, values: dict, tmp_path) -> list[dict]:
    out = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", "llm", values=values, tmp=tmp_path)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def failure(helm: str, values: dict, tmp_path) -> str:
    out = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", "llm", values=values, tmp=tmp_path)
    assert out.returncode != 0, "rendered, but should have failed"
    return out.stderr


@pytest.fixture(scope="module")
def keda_docs(helm, tmp_path_factory) -> list[dict]:
    return render(helm, KEDA, tmp_path_factory.mktemp("keda"))


def test_every_pool_gets_a_valid_scaled_object(keda_docs):
    scaled = by_kind(keda_docs, "ScaledObject")
    assert set(scaled) == {f"{FULLNAME}-{p}" for p in ("prefill", "decode", "mixed")}
    deps = by_kind(keda_docs, "Deployment")
    for name, obj in scaled.items():
        jsonschema.validate(obj, SCHEMA)
        assert obj["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert "replicas" not in deps[name]["spec"], "KEDA owns replicas: the Deployment must not reset them"
        (trigger,) = obj["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metadata"]["serverAddress"] == PROMETHEUS
        # the pool's own series, as the ServiceMonitor labels them
        assert f'namespace="llm",service="{name}"' in trigger["metadata"]["query"]
        assert "<<pool>>" not in trigger["metadata"]["query"]
    assert not by_kind(keda_docs, "HorizontalPodAutoscaler"), "KEDA makes its own HPA"


def test_pools_scale_on_their_own_signal(keda_docs):
    scaled = by_kind(keda_docs, "ScaledObject")
    trig = {p: scaled[f"{FULLNAME}-{p}"]["spec"]["triggers"][0] for p in ("prefill", "decode", "mixed")}
    assert trig["prefill"]["metadata"]["query"].startswith("sum(kvmesh_worker_pending_prompt_tokens{")
    assert (trig["prefill"]["metricType"], trig["prefill"]["metadata"]["threshold"]) == ("AverageValue", "16384")
    assert trig["decode"]["metadata"]["query"].startswith("avg(kvmesh_kv_usage_ratio{")
    assert (trig["decode"]["metricType"], trig["decode"]["metadata"]["threshold"]) == ("Value", "0.8")
    assert trig["mixed"]["metadata"]["query"].startswith("sum(kvmesh_engine_waiting{")


def test_the_schema_catches_a_malformed_object(keda_docs):
    """KEDA's metadata is a map of strings: a bare number there is refused by the API server."""
    obj = copy.deepcopy(by_kind(keda_docs, "ScaledObject")[f"{FULLNAME}-decode"])
    obj["spec"]["triggers"][0]["metadata"]["threshold"] = 0.8
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(obj, SCHEMA)
    obj = copy.deepcopy(by_kind(keda_docs, "ScaledObject")[f"{FULLNAME}-decode"])
    obj["spec"]["minReplicas"] = 1          # the HPA's spelling, not KEDA's
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(obj, SCHEMA)


def test_keda_and_the_hpa_together_fail_with_a_clear_message(helm, tmp_path):
    values = {"workerPools": {"decode": {"keda": {"enabled": True, "serverAddress": PROMETHEUS},
                                         "autoscaling": {"enabled": True}}}}
    err = failure(helm, values, tmp_path)
    assert "workerPools.decode: keda.enabled and autoscaling.enabled both scale this Deployment" in err
    assert "workerPools.decode.autoscaling.enabled=false" in err


def test_keda_needs_a_prometheus_address(helm, tmp_path):
    err = failure(helm, {"workerPools": {"prefill": {"keda": {"enabled": True}}}}, tmp_path)
    assert "workerPools.prefill.keda.enabled needs keda.serverAddress" in err


def test_one_pool_on_keda_leaves_the_others_alone(helm, tmp_path):
    docs = render(helm, {"workerPools": {"decode": {"keda": {"enabled": True, "serverAddress": PROMETHEUS,
                                                       "activationThreshold": 0.1,
                                                       "authenticationRef": "prom-auth"}}}}, tmp_path)
    (obj,) = by_kind(docs, "ScaledObject").values()
    jsonschema.validate(obj, SCHEMA)
    assert obj["metadata"]["name"] == f"{FULLNAME}-decode"
    assert obj["spec"]["triggers"][0]["metadata"]["activationThreshold"] == "0.1"
    assert obj["spec"]["triggers"][0]["authenticationRef"] == {"name": "prom-auth"}
    assert by_kind(docs, "Deployment")[f"{FULLNAME}-prefill"]["spec"]["replicas"] == 1


def test_lint_strict_with_keda(helm, tmp_path):
    out = run_helm(helm, "lint", "--strict", str(CHART), values=KEDA, tmp=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
