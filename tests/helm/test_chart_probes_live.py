"""The chart's probes against real services: the scheduler and the prefix-cache index (neither
needs a model) run as processes with the KVMESH_* environment the chart renders for their pods,
and a plaintext gRPC health check sent where the rendered `grpc:` probe points gets SERVING,
while the same check on the rendered gRPC port is refused (it wants a client certificate).

Pod-only values are swapped for this machine: the pod IP for 127.0.0.1, every port the chart
fixes for a free local port (the same number always maps to the same port), the Redis URL for an
embedded Redis with the trust bundle's password, /tmp paths for the test's own directory.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.ports import free_port
from tests.helm.chart import FULLNAME, ROOT, by_kind, containers, env_of, helm, render  # noqa: F401
from tests.integration.stack import redis_and_procs

START_TIMEOUT_S = 60.0
CHECK_TIMEOUT_S = 3.0
PORT_VARS = ("KVMESH_PORT", "KVMESH_HEALTH_PORT", "KVMESH_ZMQ_PORT", "KVMESH_METRICS_PORT")


def pod_environment(docs: list[dict], container: dict, local: dict) -> dict[str, str]:
    """The container's KVMESH_* variables (ConfigMap, then env), with pod-only values replaced."""
    env = {k: v for k, v in by_kind(docs, "ConfigMap")[f"{FULLNAME}-config"]["data"].items()
           if k.startswith("KVMESH_")}
    for name, e in env_of(container).items():
        if name.startswith("KVMESH_"):
            env[name] = e["value"] if "value" in e else ""
    for name in PORT_VARS:
        if name in env:
            env[name] = str(local["ports"].setdefault(int(env[name]), free_port()))
    env.update(KVMESH_HOST="127.0.0.1", KVMESH_ADVERTISE_HOST="127.0.0.1", KVMESH_REDIS_URL=local["redis_url"],
               KVMESH_TRUST_DIR=str(local["trust_dir"]),
               KVMESH_CACHE_DIR=str(local["home"] / ".cache"))
    return env


def health_status(port: int) -> int:
    """One plaintext grpc.health.v1 Check, as the kubelet's probe sends it (service "")."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=CHECK_TIMEOUT_S)
        return reply.status


def wait_serving(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the service exited with {proc.returncode}"
        try:
            if health_status(port) == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"no SERVING on the probe port {port} within {START_TIMEOUT_S:.0f} s")


@pytest.mark.parametrize("component", ["scheduler", "prefix-cache"])
def test_rendered_probes_reach_the_running_service(helm, component, tmp_path_factory, tmp_path):
    docs = render(helm, "defaults", tmp_path_factory)
    (c,) = containers(by_kind(docs, "Deployment")[f"{FULLNAME}-{component}"])
    with redis_and_procs(tmp_path) as (redis, procs):
        local = {"ports": {}, "redis_url": redis.url, "trust_dir": procs.trust_dir, "home": tmp_path}
        env = pod_environment(docs, c, local)
        base = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
        with open(tmp_path / f"{component}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "services.cli", *c["command"][1:]], cwd=ROOT,
                                    env={**base, **env}, stdout=log, stderr=log)
        procs.procs[component] = proc  # stopped with the stack, whatever happens
        probe_ports = {local["ports"][c[p]["grpc"]["port"]] for p in ("startupProbe", "livenessProbe", "readinessProbe")}
        (probe_port,) = probe_ports
        wait_serving(probe_port, proc)
        grpc_port = int(env["KVMESH_PORT"])
        with pytest.raises(grpc.RpcError) as refused:
            health_status(grpc_port)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # no TLS handshake without a certificate
        assert proc.poll() is None
