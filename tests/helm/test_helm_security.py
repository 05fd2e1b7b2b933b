"""The chart is safe as shipped: NetworkPolicies let each port be reached only by the roles that
use it, each pod mounts only its own role's trust Secret, the bundled Redis requires a password
from a Secret file with protected mode on, the gateway requires an API key unless told not to,
the hook Job that makes the keys may touch nothing but Secrets, and the model download is real.
"""
from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest

from services.security import bundle, keys_cli
from tests.helm.chart import (CHART, FULLNAME, RELEASE, VALUE_SETS, by_kind, containers, env_of, helm,  # noqa: F401
                              render, run_helm)

ROLES = bundle.ROLES
SERVICE_LABEL = "kvmesh.io/service"


def pods(docs: list[dict]) -> dict[str, dict]:
    """Component name -> {labels, ports (name -> number), service} of every Deployment/StatefulSet."""
    out = {}
    for w in docs:
        if w["kind"] not in ("Deployment", "StatefulSet"):
            continue
        tmpl = w["spec"]["template"]
        ports = {p["name"]: p["containerPort"] for c in tmpl["spec"]["containers"] for p in c.get("ports", [])}
        labels = tmpl["metadata"]["labels"]
        out[labels["app.kubernetes.io/component"]] = {"labels": labels, "ports": ports,
                                                      "service": labels.get(SERVICE_LABEL)}
    return out


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the chart uses matchLabels only
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def peer_matches(peers: list[dict] | None, labels: dict) -> bool:
    """Whether a pod of this release's namespace with `labels` is one of `peers` (absent: everyone)."""
    if peers is None:
        return True
    return any("namespaceSelector" not in p and "ipBlock" not in p and selects(p["podSelector"], labels)
               for p in peers)


def port_matches(ports: list[dict] | None, number: int) -> bool:
    return ports is None or any(p["port"] == number and p.get("protocol", "TCP") == "TCP" for p in ports)


def policy_of(policies: list[dict], labels: dict) -> dict:
    (policy,) = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
    return policy["spec"]


def can_reach(policies: list[dict], src: dict, dst: dict, port: int) -> bool:
    """Both ends' policies allow the connection: src's egress to dst:port and dst's ingress from src."""
    out = policy_of(policies, src["labels"])
    inn = policy_of(policies, dst["labels"])
    egress = any(peer_matches(r.get("to"), dst["labels"]) and port_matches(r.get("ports"), port)
                 for r in out.get("egress", []))
    ingress = any(peer_matches(r.get("from"), src["labels"]) and port_matches(r.get("ports"), port)
                  for r in inn.get("ingress", []))
    return egress and ingress


# Every connection inside the release, as (client service, server service, server port name).
EXPECTED_EDGES = {
    ("scheduler", "gateway", "zmq"), ("tokenizer", "gateway", "zmq"), ("worker", "gateway", "zmq"),
    ("gateway", "tokenizer", "grpc"), ("worker", "tokenizer", "zmq"),
    ("gateway", "scheduler", "zmq"), ("tokenizer", "scheduler", "zmq"), ("worker", "scheduler", "zmq"),
    ("scheduler", "prefix-cache", "grpc"),
    ("scheduler", "worker", "zmq"), ("prefix-cache", "worker", "kv-events"), ("prefix-cache", "worker", "kv-snapshot"),
    ("worker", "worker", "kv-transfer"),   # prefill -> decode, and within a pool: test_kv_transfer_port_*
    *((role, "redis", "redis") for role in ROLES),
}


# ----------------------------------------------------------------------------- NetworkPolicy


def edges(docs: list[dict]) -> set[tuple[str, str, str]]:
    """(client service, server service, server port name) of every connection the policies allow."""
    policies = list(by_kind(docs, "NetworkPolicy").values())
    everyone = pods(docs)
    return {(src["service"], dst["service"], port_name)
            for src, dst in itertools.product(everyone.values(), everyone.values())
            for port_name, number in dst["ports"].items() if can_reach(policies, src, dst, number)}


def test_a_gateway_making_its_own_text_reaches_the_workers_zmq_port_only(helm, tmp_path):
    """gateway.textInGateway: a stop string's Abort goes to the worker directly, so the gateway
    reaches the workers' ZMQ port, and no other worker port."""
    import yaml

    out = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", "llm",
                   values={"gateway": {"textInGateway": True}}, tmp=tmp_path)
    assert out.returncode == 0, out.stderr
    assert edges([d for d in yaml.safe_load_all(out.stdout) if d]) == EXPECTED_EDGES | {("gateway", "worker", "zmq")}


@pytest.mark.parametrize("case", ["defaults", "pools", "strict-cni", "everything"])
def test_each_port_is_reachable_only_from_the_roles_that_use_it(helm, case, tmp_path_factory):
    docs = render(helm, case, tmp_path_factory)
    policies = list(by_kind(docs, "NetworkPolicy").values())
    everyone = pods(docs)
    for pod in everyone.values():  # every pod is under exactly one policy, both directions
        spec = policy_of(policies, pod["labels"])
        assert spec["policyTypes"] == ["Ingress", "Egress"]
    reached = edges(docs)
    assert reached == EXPECTED_EDGES
    # What the issue named: the internet-facing gateway reaches no worker port and no other pod's
    # metrics; a worker's ports take only the scheduler, the prefix-cache index and (the decode
    # pool's KV-transfer port) the prefill pool.
    assert not {e for e in reached if e[0] == "gateway" and e[1] in ("worker", "prefix-cache")}
    assert {e[0] for e in reached if e[1] == "worker"} == {"scheduler", "prefix-cache", "worker"}
    assert {e[2] for e in reached if e[:2] == ("worker", "worker")} == {"kv-transfer"}
    assert not {e for e in reached if e[2] in ("metrics", "http")}


@pytest.mark.parametrize("case", ["defaults", "pd-pools", "everything"])
def test_kv_transfer_port_takes_the_prefill_pool_and_its_own_pool_only(helm, case, tmp_path_factory):
    """The decode pool's KV-transfer port: prefill pods reach it (the hand-off), and decode pods
    (a draining one moves its requests with their KV), no other pod (not the scheduler, not a
    mixed pod); a mixed pool's takes mixed pods alone; no prefill pod declares such a port."""
    docs = render(helm, case, tmp_path_factory)
    policies = list(by_kind(docs, "NetworkPolicy").values())
    everyone = pods(docs)
    port = everyone["decode"]["ports"]["kv-transfer"]
    assert port == VALUE_SETS[case].get("workerPools", {}).get("decode", {}).get("kvTransferPort", 5563)
    assert {c for c, p in everyone.items() if "kv-transfer" in p["ports"]} <= {"decode", "mixed"}
    reach = {c for c, src in everyone.items() if can_reach(policies, src, everyone["decode"], port)}
    assert reach == {"prefill", "decode"}, case
    if "mixed" in everyone:
        mixed_port = everyone["mixed"]["ports"]["kv-transfer"]
        assert {c for c, src in everyone.items() if can_reach(policies, src, everyone["mixed"], mixed_port)} == {"mixed"}


def test_no_rule_opens_every_port(helm, tmp_path_factory):
    """An absent or empty `ports` means every port; the chart never writes such a rule, even with
    no worker pool to take the worker ports from."""
    import yaml

    out = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", "llm",
                   "--set", "workerPools.prefill.enabled=false", "--set", "workerPools.decode.enabled=false")
    assert out.returncode == 0, out.stderr
    no_pools = [d for d in yaml.safe_load_all(out.stdout) if d]
    for docs in (no_pools, render(helm, "defaults", tmp_path_factory), render(helm, "external-redis", tmp_path_factory)):
        for name, policy in by_kind(docs, "NetworkPolicy").items():
            for rule in policy["spec"]["ingress"] + policy["spec"]["egress"]:
                assert rule.get("ports"), f"{name}: {rule} allows every port"


def test_the_public_and_metrics_ports(helm, tmp_path_factory):
    policies = by_kind(render(helm, "defaults", tmp_path_factory), "NetworkPolicy")
    gateway = policies[f"{FULLNAME}-gateway"]["spec"]
    (http,) = [r for r in gateway["ingress"] if r["ports"] == [{"port": 8000, "protocol": "TCP"}]]
    assert "from" not in http  # the public entry: anyone, by default
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    for name in ("tokenizer", "scheduler", "prefix-cache", "prefill", "decode"):
        rules = [r for r in policies[f"{FULLNAME}-{name}"]["spec"]["ingress"]
                 if {"port": 9090, "protocol": "TCP"} in r["ports"]]
        assert [r["from"] for r in rules] == [monitoring], name
    assert policies[f"{FULLNAME}-redis"]["spec"]["egress"] == []

    restricted = by_kind(render(helm, "own-keys-hostpath", tmp_path_factory), "NetworkPolicy")
    rules = restricted[f"{FULLNAME}-gateway"]["spec"]["ingress"]
    http_rules = [r for r in rules if r["ports"] == [{"port": 8000, "protocol": "TCP"}]]
    assert [r["from"] for r in http_rules] == [[{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "ingress-nginx"}}}]]
    for name in ("tokenizer", "prefill", "decode"):  # metricsFrom: [] opens no metrics port
        assert not [r for r in restricted[f"{FULLNAME}-{name}"]["spec"]["ingress"]
                    if {"port": 9090, "protocol": "TCP"} in r["ports"]]


def test_egress_leaves_the_release_only_for_dns_and_the_model_download(helm, tmp_path_factory):
    def outside(case: str) -> dict[str, list]:
        policies = by_kind(render(helm, case, tmp_path_factory), "NetworkPolicy")
        found = {}
        for name, policy in policies.items():
            for rule in policy["spec"].get("egress", []):
                peers = rule.get("to")
                assert peers is not None, f"{name} has an egress rule to anywhere: {rule}"
                if any("namespaceSelector" in p or "ipBlock" in p for p in peers):
                    found.setdefault(name.removeprefix(f"{FULLNAME}-"), []).append(
                        sorted((p["port"], p["protocol"]) for p in rule["ports"]))
        return found

    dns = [(53, "TCP"), (53, "UDP")]
    assert outside("defaults") == {"gateway": [dns], "tokenizer": [dns, [(443, "TCP")]], "scheduler": [dns],
                                   "prefix-cache": [dns], "prefill": [dns, [(443, "TCP")]],
                                   "decode": [dns, [(443, "TCP")]]}
    assert outside("own-keys-hostpath") == {n: [dns] for n in ("gateway", "tokenizer", "scheduler",
                                                                "prefix-cache", "prefill", "decode")}


def test_external_redis_egress(helm, tmp_path_factory):
    policies = by_kind(render(helm, "external-redis", tmp_path_factory), "NetworkPolicy")
    assert f"{FULLNAME}-redis" not in policies
    for name, policy in policies.items():
        assert {"ports": [{"port": 6379, "protocol": "TCP"}]} in policy["spec"]["egress"], name


# ----------------------------------------------------------------------------- trust Secrets


def expected_items(role: str, tmp_path) -> dict[str, str]:
    """Secret key -> mounted path of a role, from what `kvmesh keys` puts in that role's Secret."""
    paths = bundle.generate(tmp_path / "bundle")
    rel = [str(f.relative_to(paths.root)) for f in keys_cli.role_files(paths, role)]
    return {keys_cli.flat_key(r): r for r in rel}


def secret_volumes(pod_spec: dict) -> dict[str, dict]:
    return {v["name"]: v["secret"] for v in pod_spec.get("volumes", []) if "secret" in v}


@pytest.mark.parametrize("case,prefix", [("defaults", FULLNAME), ("pools", FULLNAME), ("own-keys-hostpath", "corp")])
def test_each_pod_mounts_only_its_roles_trust_secret(helm, case, prefix, tmp_path_factory, tmp_path):
    docs = render(helm, case, tmp_path_factory)
    trust_names = {f"{prefix}-trust-{r}" for r in (*ROLES, "redis")}
    seen = set()
    for dep in by_kind(docs, "Deployment").values():
        spec = dep["spec"]["template"]["spec"]
        role = dep["spec"]["template"]["metadata"]["labels"][SERVICE_LABEL]
        volumes = secret_volumes(spec)
        assert {v["secretName"] for v in volumes.values()} & trust_names == {f"{prefix}-trust-{role}"}
        trust = volumes["trust"]
        assert trust["defaultMode"] == 0o400
        items = {i["key"]: i["path"] for i in trust["items"]}
        assert items == expected_items(role, tmp_path / role), role
        for other in ROLES:
            if other != role:
                assert not [k for k in items if k in (f"curve-{other}.secret", f"tls-{other}.key")], (role, other)
        for c in spec["containers"]:
            mount = {m["name"]: m for m in c["volumeMounts"]}["trust"]
            assert mount["readOnly"] is True and env_of(c)["KVMESH_TRUST_DIR"]["value"] == mount["mountPath"]
            assert "KVMESH_INSECURE_INTERNAL_PLANES" not in env_of(c)
        for c in spec.get("initContainers", []):  # the model download holds no keys
            assert "trust" not in {m["name"] for m in c["volumeMounts"]}
        seen.add(role)
    assert seen == set(ROLES)
    redis = by_kind(docs, "StatefulSet")[f"{FULLNAME}-redis"]["spec"]["template"]["spec"]
    assert {v["secretName"] for v in secret_volumes(redis).values()} == {f"{prefix}-trust-redis"}


def test_insecure_mode_is_explicit_and_mounts_nothing(helm, tmp_path_factory):
    docs = render(helm, "insecure", tmp_path_factory)
    assert f"{FULLNAME}-keys" not in by_kind(docs, "Job")
    for w in [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]:
        spec = w["spec"]["template"]["spec"]
        assert not [v for v in secret_volumes(spec).values() if "-trust-" in v["secretName"]]
        c = spec["containers"][0]
        if c["command"][0] == "kvmesh":
            assert env_of(c)["KVMESH_INSECURE_INTERNAL_PLANES"]["value"] == "true"
            assert "KVMESH_TRUST_DIR" not in env_of(c)
    out = run_helm(helm, "template", RELEASE, str(CHART), "--set", "security.insecureInternalPlanes=maybe")
    assert out.returncode != 0 and "schema" in out.stderr.lower()


# ----------------------------------------------------------------------------- Redis


def test_bundled_redis_requires_the_password_from_a_secret_file(helm, tmp_path_factory):
    docs = render(helm, "defaults", tmp_path_factory)
    spec = by_kind(docs, "StatefulSet")[f"{FULLNAME}-redis"]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    args = c["args"]
    assert args[0] == "/etc/redis/kvmesh/redis.conf"  # redis-server's config file: requirepass
    assert args[args.index("--protected-mode") + 1] == "yes"
    assert args[args.index("--bind") + 1: args.index("--bind") + 3] == ["$(POD_IP)", "127.0.0.1"]
    assert "--requirepass" not in args and not any("PASSWORD" in a for a in args)
    assert not [e for e in c.get("env", []) if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]]
    auth = secret_volumes(spec)["auth"]
    assert auth["secretName"] == f"{FULLNAME}-trust-redis" and auth["defaultMode"] == 0o400
    assert {i["key"] for i in auth["items"]} == {"redis.conf", "redis.password"}
    assert {m["name"]: m for m in c["volumeMounts"]}["auth"]["mountPath"] == "/etc/redis/kvmesh"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        command = c[probe]["exec"]["command"]
        assert command[:2] == ["sh", "-c"] and "/etc/redis/kvmesh/redis.password" in command[2]
        assert "grep -qx PONG" in command[2] and "$(" not in command[2]  # no kubelet $(VAR) expansion
    # The file `kvmesh keys` writes is one redis.conf accepts.
    assert keys_cli.redis_server_conf(b"abc-_123") == b'requirepass "abc-_123"\n'


# ----------------------------------------------------------------------------- API key


def test_api_key_is_required_by_default_and_generated_once(helm, tmp_path_factory):
    docs = render(helm, "defaults", tmp_path_factory)
    (gw,) = containers(by_kind(docs, "Deployment")[f"{FULLNAME}-gateway"])
    assert env_of(gw)["KVMESH_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": f"{FULLNAME}-api-key",
                                                                        "key": "api-key"}
    import base64
    import re

    key = base64.b64decode(by_kind(docs, "Secret")[f"{FULLNAME}-api-key"]["data"]["api-key"]).decode()
    assert re.fullmatch(r"sk-[A-Za-z0-9]{48}", key)
    template = (CHART / "templates" / "api-key.yaml").read_text()
    assert 'lookup "v1" "Secret"' in template  # an upgrade reuses the stored key

    off = render(helm, "insecure", tmp_path_factory)
    (gw,) = containers(by_kind(off, "Deployment")[f"{FULLNAME}-gateway"])
    assert "KVMESH_API_KEY" not in env_of(gw)
    assert f"{FULLNAME}-api-key" not in by_kind(off, "Secret")


def test_api_key_disabled_with_a_key_secret_is_refused(helm):
    """Both set: the operator expects the Secret's keys to be required; the gateway would be open."""
    out = run_helm(helm, "template", RELEASE, str(CHART), "--set", "gateway.apiKey.disabled=true",
                   "--set", "gateway.apiKey.existingSecret=my-keys")
    assert out.returncode != 0 and "gateway.apiKey.disabled" in out.stderr and "existingSecret" in out.stderr, out.stderr


@pytest.mark.parametrize("values, where", [
    (["gateway.config.api-key="], "gateway.config.api-key"),          # after the Secret's: it would win
    (["gateway.apiKey.disabled=true", "config.api_key="], "config.api_key"),
    (["gateway.extraEnv[0].name=KVMESH_API_KEY", "gateway.extraEnv[0].value="], "gateway.extraEnv"),
])
def test_an_api_key_set_outside_gateway_api_key_is_refused(helm, values, where):
    """An empty KVMESH_API_KEY is no key: the gateway would serve anyone (it refuses one at start
    too, but the render is where the operator is looking)."""
    out = run_helm(helm, "template", RELEASE, str(CHART), *[a for v in values for a in ("--set", v)])
    assert out.returncode != 0 and where in out.stderr and "gateway.apiKey" in out.stderr, out.stderr


def test_notes_say_how_to_read_the_key(helm):
    out = run_helm(helm, "install", RELEASE, str(CHART), "--namespace", "llm", "--dry-run=client")
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    assert f"kubectl -n llm get secret {FULLNAME}-api-key -o jsonpath='{{.data.api-key}}' | base64 -d" in notes
    off = run_helm(helm, "install", RELEASE, str(CHART), "--namespace", "llm", "--dry-run=client",
                   "--set", "gateway.apiKey.disabled=true")
    assert "WARNING: gateway.apiKey.disabled=true" in off.stdout.split("NOTES:", 1)[1]


# ----------------------------------------------------------------------------- the keys hook Job


def test_keys_hook_job_may_only_get_and_create_its_secrets(helm, tmp_path_factory):
    docs = render(helm, "defaults", tmp_path_factory)
    name = f"{FULLNAME}-keys"
    hooked = [d for d in docs if d["metadata"]["name"] == name]
    assert {d["kind"] for d in hooked} == {"ServiceAccount", "Role", "RoleBinding", "Job"}
    for d in hooked:
        notes = d["metadata"]["annotations"]
        assert notes["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert "hook-succeeded" in notes["helm.sh/hook-delete-policy"]
    hook_weight = {d["kind"]: int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) for d in hooked}
    assert hook_weight["Job"] > max(hook_weight["Role"], hook_weight["RoleBinding"], hook_weight["ServiceAccount"])
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")

    role = by_kind(docs, "Role")[name]
    verbs = {}
    for rule in role["rules"]:
        assert rule["apiGroups"] == [""] and rule["resources"] == ["secrets"], rule
        for verb in rule["verbs"]:
            verbs[verb] = rule.get("resourceNames")
    assert set(verbs) == {"create", "get"}
    assert set(verbs["get"]) == {f"{FULLNAME}-trust-{r}" for r in (*ROLES, "redis")}
    binding = by_kind(docs, "RoleBinding")[name]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": "llm"}]

    job = by_kind(docs, "Job")[name]["spec"]["template"]["spec"]
    assert job["serviceAccountName"] == name and job["automountServiceAccountToken"] is True
    (c,) = job["containers"]
    assert c["command"][:7] == ["kvmesh", "keys", "k8s-secrets", "--namespace", "llm", "--prefix", FULLNAME]
    args = keys_cli.parser().parse_args(c["command"][2:])  # the command line `kvmesh keys` accepts
    assert dict(args.label)["app.kubernetes.io/instance"] == RELEASE
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    for dep in by_kind(docs, "Deployment").values():  # no service pod holds an API token
        assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert not by_kind(render(helm, "own-keys-hostpath", tmp_path_factory), "Job")


# ----------------------------------------------------------------------------- model download


def test_model_is_downloaded_into_a_pvc_by_default(helm, tmp_path_factory):
    docs = render(helm, "defaults", tmp_path_factory)
    assert f"{FULLNAME}-model" in by_kind(docs, "PersistentVolumeClaim")
    for comp in ("tokenizer", "prefill", "decode"):
        spec = by_kind(docs, "Deployment")[f"{FULLNAME}-{comp}"]["spec"]["template"]["spec"]
        (init,) = spec["initContainers"]
        assert init["name"] == "model-download" and init["command"][:2] == ["python", "-c"]
        env = env_of(init)
        assert env["MODEL_REPO"]["value"] == "Qwen/Qwen2.5-0.5B-Instruct" and env["MODEL_DIR"]["value"] == "/models/model"
        assert "HF_TOKEN" not in env
        assert {m["name"]: m for m in init["volumeMounts"]}["model"].get("readOnly") is not True
        assert {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}["model"]["readOnly"] is True
        assert {v["name"]: v for v in spec["volumes"]}["model"]["persistentVolumeClaim"]["claimName"] == f"{FULLNAME}-model"
    gw = by_kind(docs, "Deployment")[f"{FULLNAME}-gateway"]["spec"]["template"]["spec"]
    assert "initContainers" not in gw

    gated = by_kind(render(helm, "download-emptydir", tmp_path_factory), "Deployment")[f"{FULLNAME}-decode"]
    (init,) = gated["spec"]["template"]["spec"]["initContainers"]
    env = env_of(init)
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert env["HF_ENDPOINT"]["value"] == "https://hf-mirror.internal"
    host = by_kind(render(helm, "own-keys-hostpath", tmp_path_factory), "Deployment")[f"{FULLNAME}-decode"]
    assert "initContainers" not in host["spec"]["template"]["spec"]


def test_model_download_script_skips_a_model_already_there(helm, tmp_path_factory, tmp_path):
    """Run the init container's own script: with the marker of the same repo@revision it exits at
    once, without touching the network (HF_ENDPOINT points at a closed port)."""
    dep = by_kind(render(helm, "defaults", tmp_path_factory), "Deployment")[f"{FULLNAME}-decode"]
    (init,) = dep["spec"]["template"]["spec"]["initContainers"]
    env = {k: v["value"] for k, v in env_of(init).items() if "value" in v}
    env.update(MODEL_DIR=str(tmp_path), HOME=str(tmp_path), HF_HOME=str(tmp_path / "hf"),
               HF_ENDPOINT="http://127.0.0.1:9", PATH=os.environ["PATH"])
    (tmp_path / ".kvmesh-download").write_text(f"{env['MODEL_REPO']}@{env['MODEL_REVISION']}")
    out = subprocess.run([sys.executable, *init["command"][1:]], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "is already in" in out.stdout

    (tmp_path / ".kvmesh-download").write_text("other/repo@main")  # another model: it downloads (and fails here)
    out = subprocess.run([sys.executable, *init["command"][1:]], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "downloading Qwen/Qwen2.5-0.5B-Instruct@main" in out.stdout
    assert (tmp_path / ".kvmesh-download").read_text() == "other/repo@main"


def test_model_init_and_download_are_exclusive(helm):
    out = run_helm(helm, "template", RELEASE, str(CHART), "--set", "model.init.enabled=true")
    assert out.returncode != 0 and "model.download.enabled and model.init.enabled" in out.stderr
    out = run_helm(helm, "template", RELEASE, str(CHART), "--set", "model.download.repo=")
    assert out.returncode != 0 and "model.download.repo" in out.stderr
