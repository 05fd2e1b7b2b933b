"""Every port a kvmesh service binds is fixed by the chart and declared on its container; the
kubelet's gRPC probes go to the plaintext health port (the gRPC port requires a client
certificate they cannot present), and the NetworkPolicies open that port to `probeFrom` only,
never to another pod, while the gRPC ports stay restricted to their callers.
"""
from __future__ import annotations

import base64
import dataclasses

import pytest
import yaml

from prefix_cache_svc.config import PrefixCacheConfig
from services.config import GatewayConfig, SchedulerConfig, TokenizerConfig, WorkerConfig
from tests.helm.chart import (CHART, FULLNAME, VALUE_SETS, by_kind, containers, env_of, helm, render,  # noqa: F401
                              run_helm)

CONFIG_OF = {"gateway": GatewayConfig, "tokenizer": TokenizerConfig, "scheduler": SchedulerConfig,
             "prefix-cache": PrefixCacheConfig, "worker": WorkerConfig}
GRPC_SERVICES = ("tokenizer", "scheduler", "prefix-cache", "worker")
# Ports only some worker roles bind (WorkerConfig's help names the role): set and declared on
# those pools' pods, absent elsewhere.
ROLE_PORTS = {"kv_transfer_port": ("decode", "mixed")}
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def kvmesh_pods(docs: list[dict]) -> dict[str, tuple[str, dict]]:
    """Deployment name -> (service, its one container)."""
    out = {}
    for name, dep in by_kind(docs, "Deployment").items():
        (c,) = containers(dep)
        out[name] = (dep["spec"]["template"]["metadata"]["labels"]["kvmesh.io/service"], c)
    return out


def settings(docs: list[dict], container: dict) -> dict[str, str]:
    """The KVMESH_* values a container starts with: the shared ConfigMap, then its own env."""
    values = dict(by_kind(docs, "ConfigMap")[f"{FULLNAME}-config"]["data"])
    values.update({name: e["value"] for name, e in env_of(container).items() if "value" in e})
    return values


@pytest.mark.parametrize("case", ["defaults", "strict-cni", "everything"])
def test_every_port_a_service_binds_is_fixed_and_declared(helm, case, tmp_path_factory):
    """Read from the config classes, so a port a service gains later fails here until the chart
    fixes it: a port left at 0 (any free port) could be named by no NetworkPolicy."""
    docs = render(helm, case, tmp_path_factory)
    for name, (service, c) in kvmesh_pods(docs).items():
        values = settings(docs, c)
        declared = {p["containerPort"] for p in c["ports"]}
        role = values.get("KVMESH_ROLE")
        for field in dataclasses.fields(CONFIG_OF[service]):
            if not field.name.endswith("_port"):     # not kv_transport
                continue
            env = f"KVMESH_{field.name.upper()}"
            if field.name in ROLE_PORTS and role not in ROLE_PORTS[field.name]:
                assert env not in values, f"{case}: {name} ({role}) sets {env}, which only {ROLE_PORTS[field.name]} bind"
                continue
            assert env in values, f"{case}: {name} leaves --{field.name.replace('_', '-')} at its default"
            assert int(values[env]) > 0 and int(values[env]) in declared, (case, name, env, values[env])
        assert len(declared) == len(c["ports"]), f"{case}: {name} declares a port twice"


@pytest.mark.parametrize("bad, message", [
    (["--set", "gateway.port=5560"], "gateway binds port 5560 twice"),                # its zmqPort
    (["--set", "tokenizer.healthPort=50051"], "tokenizer binds port 50051 twice"),    # its gRPC port
    (["--set", "workerPools.decode.kvTransferPort=9090"], "decode binds port 9090 twice"),  # metrics.port
])
def test_two_ports_of_one_pod_the_same_fail_at_template_time(helm, bad, message):
    """The second bind fails inside the pod (a crash loop); the chart names the clash instead."""
    out = run_helm(helm, "template", "prod", str(CHART), *bad)
    assert out.returncode != 0 and message in out.stderr, out.stderr


@pytest.mark.parametrize("case", ["defaults", "strict-cni", "everything"])
def test_grpc_probes_go_to_the_health_port(helm, case, tmp_path_factory):
    docs = render(helm, case, tmp_path_factory)
    seen = set()
    for name, (service, c) in kvmesh_pods(docs).items():
        if service == "gateway":
            assert all("httpGet" in c[p] for p in PROBES)
            continue
        seen.add(service)
        env = env_of(c)
        health, grpc = int(env["KVMESH_HEALTH_PORT"]["value"]), int(env["KVMESH_PORT"]["value"])
        assert health != grpc
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["health"] == health
        for probe in PROBES:
            assert c[probe]["grpc"] == {"port": health}, f"{case}: {name} {probe}"
    assert seen == set(GRPC_SERVICES)


def test_health_port_values_reach_each_component(helm, tmp_path_factory):
    docs = render(helm, "strict-cni", tmp_path_factory)
    health = {name: int(env_of(c)["KVMESH_HEALTH_PORT"]["value"]) for name, (_, c) in kvmesh_pods(docs).items()
              if "KVMESH_HEALTH_PORT" in env_of(c)}
    assert health == {f"{FULLNAME}-tokenizer": 8181, f"{FULLNAME}-scheduler": 8081, f"{FULLNAME}-prefix-cache": 8081,
                      f"{FULLNAME}-prefill": 8081, f"{FULLNAME}-decode": 8182}
    for name, service in by_kind(docs, "Service").items():  # probes reach pods directly: no Service has it
        assert not {p["name"] for p in service["spec"]["ports"]} & {"health"}, name


def ingress_ports_from(spec: dict, peer: dict) -> set[int]:
    return {p["port"] for rule in spec.get("ingress", []) if peer in rule.get("from", []) for p in rule["ports"]}


def test_probe_peers_reach_the_health_ports_only(helm, tmp_path_factory):
    docs = render(helm, "strict-cni", tmp_path_factory)
    (nodes,) = VALUE_SETS["strict-cni"]["networkPolicy"]["probeFrom"]
    policies = by_kind(docs, "NetworkPolicy")
    pods = kvmesh_pods(docs)
    # each worker pool has a policy of its own, named like its Deployment
    components = [*(s for s in GRPC_SERVICES if s != "worker"), "prefill", "decode"]
    for component in components:
        (_, c) = pods[f"{FULLNAME}-{component}"]
        health = {int(env_of(c)["KVMESH_HEALTH_PORT"]["value"])}
        spec = policies[f"{FULLNAME}-{component}"]["spec"]
        assert ingress_ports_from(spec, nodes) == health, component
        (rule,) = [r for r in spec["ingress"] if nodes in r["from"]]
        assert rule["from"] == [nodes]
    for other in ("gateway", "redis"):
        assert ingress_ports_from(policies[f"{FULLNAME}-{other}"]["spec"], nodes) == set()


def test_no_rule_names_the_health_ports_by_default(helm, tmp_path_factory):
    """Kubernetes lets a pod's own node reach it, so the default opens nothing for the probes
    (tests/helm/test_helm_security.py checks that no pod reaches a health port)."""
    docs = render(helm, "defaults", tmp_path_factory)
    for name, policy in by_kind(docs, "NetworkPolicy").items():
        for rule in policy["spec"]["ingress"]:
            assert 8081 not in {p["port"] for p in rule["ports"]}, (name, rule)


# ----------------------------------------------------------------------------- Redis


def test_redis_probes_carry_no_password_on_a_command_line(helm, tmp_path_factory):
    """redis-cli reads REDISCLI_AUTH from its environment, set for that one call from the
    Secret's file: the password is in no process's argv, and not in redis-server's environment."""
    redis = by_kind(render(helm, "defaults", tmp_path_factory), "StatefulSet")[f"{FULLNAME}-redis"]
    (c,) = containers(redis)
    for probe in PROBES:
        (script,) = c[probe]["exec"]["command"][2:]
        assert script.startswith('REDISCLI_AUTH="`cat /etc/redis/kvmesh/redis.password`" redis-cli ')
        assert " -a " not in script and "--pass" not in script
        assert "AUTH" not in script.replace("REDISCLI_AUTH=", "", 1)  # no AUTH command either
    assert "REDISCLI_AUTH" not in env_of(c)


def test_external_redis_url_reaches_pods_only_through_a_secret(helm, tmp_path_factory):
    url = VALUE_SETS["external-redis"]["redis"]["url"]  # it carries a password
    docs = render(helm, "external-redis", tmp_path_factory)
    secrets = by_kind(docs, "Secret")
    assert base64.b64decode(secrets[f"{FULLNAME}-secrets"]["data"]["redis-url"]).decode() == url
    for doc in docs:
        if doc["kind"] != "Secret":
            text = yaml.safe_dump(doc)
            assert "redis.example" not in text and "secret@" not in text, doc["metadata"]["name"]
    for case in ("external-redis", "external-redis-secret"):
        for name, (_, c) in kvmesh_pods(render(helm, case, tmp_path_factory)).items():
            assert "secretKeyRef" in env_of(c)["KVMESH_REDIS_URL"]["valueFrom"], (case, name)
            assert not any("redis" in a for a in c.get("args", [])), (case, name)
