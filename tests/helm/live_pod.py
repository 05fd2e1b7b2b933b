"""Start a kvmesh worker as the chart's pod of one pool would run, on this machine: the pool's
rendered KVMESH_* environment (tests/helm/test_chart_probes_live.py's pod_environment) with every
port the chart fixes swapped for a free loopback port, and the null model instead of weights."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from services.ports import free_port
from tests.helm.chart import FULLNAME, ROOT, by_kind, containers
from tests.helm.test_chart_probes_live import PORT_VARS, pod_environment
from tests.integration.stack import Procs


def start_pool_worker(docs: list[dict], pool: str, name: str, procs: Procs, redis_url: str, model: Path,
                      logs: Path, **overrides: str) -> tuple[subprocess.Popen, dict[str, str]]:
    """Returns the process (stopped with `procs`) and the environment it runs with. `redis_url`:
    the embedded Redis's URL without a password (the services read it from the trust directory)."""
    (c,) = containers(by_kind(docs, "Deployment")[f"{FULLNAME}-{pool}"])
    local = {"ports": {}, "redis_url": redis_url, "trust_dir": procs.trust_dir, "home": logs}
    env = pod_environment(docs, c, local)
    for var in env:
        if var.endswith("_PORT") and var not in PORT_VARS and int(env[var]) > 0:   # KV events, transfer
            env[var] = str(local["ports"].setdefault(int(env[var]), free_port()))
    env.update(KVMESH_NULL_MODEL="true", KVMESH_MODEL=str(model), KVMESH_WORKER_ID=name, **overrides)
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    with open(logs / f"{name}.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", *c["command"][1:]], cwd=ROOT,
                                env={**base, **env}, stdout=log, stderr=log)
    procs.procs[name] = proc
    return proc, env
