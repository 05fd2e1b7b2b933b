"""gateway.textInGateway: the gateway pods get KVMESH_TEXT_IN_GATEWAY, the model volume (and its
download's egress), and a way to the workers' ZMQ port (a stop string's Abort), to no other worker port."""
from __future__ import annotations

import yaml

from tests.helm.chart import CHART, FULLNAME, RELEASE, by_kind, containers, env_of, helm, run_helm  # noqa: F401


def render(helm: str, tmp_path, values: dict) -> list[dict]:
    out = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", "llm", values=values, tmp=tmp_path)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_text_in_gateway_sets_the_flag_and_mounts_the_model(helm, tmp_path):
    for on in (False, True):
        docs = render(helm, tmp_path, {"gateway": {"textInGateway": on}})
        gw_pod = by_kind(docs, "Deployment")[f"{FULLNAME}-gateway"]
        (gw,) = containers(gw_pod)
        assert ("KVMESH_TEXT_IN_GATEWAY" in env_of(gw)) is on
        mounts = {m["name"] for m in gw.get("volumeMounts", [])}
        assert ("model" in mounts) is on
        policy = by_kind(docs, "NetworkPolicy")[f"{FULLNAME}-gateway"]["spec"]
        download = [r for r in policy["egress"] if r.get("ports") == [{"port": 443, "protocol": "TCP"}]]
        assert bool(download) is on
        to_workers = [r for r in policy["egress"] for peer in r.get("to", [])
                      if peer.get("podSelector", {}).get("matchLabels", {}).get("kvmesh.io/service") == "worker"]
        assert [r["ports"] for r in to_workers] == ([[{"port": 5559, "protocol": "TCP"}]] if on else [])
        for pool in ("prefill", "decode"):
            ingress = by_kind(docs, "NetworkPolicy")[f"{FULLNAME}-{pool}"]["spec"]["ingress"]
            from_gateway = [r for r in ingress for peer in r.get("from", [])
                            if peer.get("podSelector", {}).get("matchLabels", {}).get("kvmesh.io/service") == "gateway"]
            assert [r["ports"] for r in from_gateway] == ([[{"port": 5559, "protocol": "TCP"}]] if on else [])
    assert env_of(gw)["KVMESH_TEXT_IN_GATEWAY"]["value"] == "true"
