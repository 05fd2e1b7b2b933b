"""The gateway Deployment scales: nothing in it assumes one pod. Each pod advertises its own ZMQ
inbox (its pod IP), takes its registry name from its process (no fixed id in the environment),
binds no host port, and the one Service selects every pod (several real gateway processes on one
stack: tests/integration/test_control_plane_restarts.py)."""
from __future__ import annotations

from tests.helm.chart import FULLNAME, by_kind, containers, env_of, helm, render  # noqa: F401


def test_the_gateway_deployment_runs_several_pods_that_each_advertise_their_own_inbox(helm, tmp_path_factory):
    docs = render(helm, "defaults", tmp_path_factory)
    gateway = by_kind(docs, "Deployment")[f"{FULLNAME}-gateway"]
    assert gateway["spec"]["replicas"] >= 2
    [container] = containers(gateway)
    env = env_of(container)
    assert env["KVMESH_HOST"]["value"] == "$(POD_IP)"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert not [name for name in env if name.endswith("_ID")]            # no fixed registry name
    assert not [p for p in container.get("ports", []) if "hostPort" in p]
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    service = by_kind(docs, "Service")[f"{FULLNAME}-gateway"]
    assert service["spec"]["selector"].items() <= labels.items()
