"""`kvmesh planner` as a process against an HTTP Kubernetes API emulator (the official client,
a kubeconfig pointing at 127.0.0.1) and a Prometheus query endpoint, or the pools' /metrics pages:
it patches the Deployments' scale as the signals ask, within [min, max], and not at all with
--dry-run."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server

from tests.services.planner.kube_emulator import FakePrometheus, KubeEmulator

ROOT = Path(__file__).resolve().parents[3]
NS = "llm"
PREFILL, DECODE = "prod-kvmesh-prefill", "prod-kvmesh-decode"
WAIT_S = 30.0


@contextmanager
def planner(tmp_path: Path, *args: str):
    log = tmp_path / "planner.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "planner", "--kube-namespace", NS,
                                 "--interval-s", "0.1", "--metrics-port", "0", *args],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        yield proc, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def wait_until(check, proc, log: Path, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if check():
            return
        assert proc.poll() is None, f"the planner exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
        time.sleep(0.05)
    pytest.fail(f"{what} within {WAIT_S} s:\n{log.read_text()[-3000:]}")


@pytest.fixture
def kube(tmp_path):
    emu = KubeEmulator(NS, {PREFILL: 1, DECODE: 4})
    yield emu, emu.kubeconfig(tmp_path / "kubeconfig")
    emu.close()


def test_scales_prefill_up_and_decode_down_from_prometheus(kube, tmp_path):
    emu, kubeconfig = kube
    hot = threading.Event()   # set after two ticks: the first patch has a tick before it (see the end)
    prom = FakePrometheus(lambda: {"kvmesh_worker_time_to_first_token_seconds": 6.0 if hot.is_set() else 0.5,  # 3x up
                                   "kvmesh_worker_pending_prompt_tokens": 100.0,
                                   "kvmesh_inter_token_latency_seconds": 0.01,
                                   "kvmesh_kv_usage_ratio": 0.1})
    try:
        with planner(tmp_path, "--prometheus-url", prom.url, "--kubeconfig", str(kubeconfig),
                     "--prefill-deployment", PREFILL, "--decode-deployment", DECODE,
                     "--prefill-selector", f'namespace="{NS}",service="{PREFILL}"',
                     "--decode-selector", f'service="{DECODE}"', "--gateway-selector", 'service="gw"',
                     "--prefill-max-replicas", "4", "--decode-min-replicas", "2", "--max-step", "2",
                     "--scale-up-cooldown-s", "0.6", "--stabilization-window-s", "0.6") as (proc, log):
            wait_until(lambda: sum(name == PREFILL for _, name in emu.reads) >= 2, proc, log, "two reads of the scale")
            hot.set()
            wait_until(lambda: emu.replicas == {PREFILL: 4, DECODE: 2}, proc, log, "prefill at 4, decode at 2")
            time.sleep(1.0)    # a few more rounds: at max and at min nothing more is patched
            assert emu.replicas == {PREFILL: 4, DECODE: 2}
            port = re.search(r"metrics port (\d+)", log.read_text()).group(1)
            page = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            assert 'kvmesh_planner_replicas{pool="prefill"} 4.0' in page
            assert 'kvmesh_planner_scale_events_total{direction="down",pool="decode"} 2.0' in page
    finally:
        prom.close()
    prefill = [(t, body["spec"]["replicas"]) for t, name, body, _ in emu.patches if name == PREFILL]
    decode = [(t, body["spec"]["replicas"]) for t, name, body, _ in emu.patches if name == DECODE]
    assert [r for _, r in prefill] == [3, 4]            # max step 2 from 1, then clamped at 4
    assert [r for _, r in decode] == [3, 2]             # one pod per window, down to the minimum
    # the cooldown and the window run on the planner's clock, which the emulator does not see; a
    # tick reads its clock after the previous tick's reads, before its own (one read of each
    # workload's scale per tick, then its patch): a patch was decided after its second-last read
    for patches, workload in ((prefill, PREFILL), (decode, DECODE)):
        reads = [t for t, name in emu.reads if name == workload and t < patches[0][0]]
        gap = patches[1][0] - reads[-2]
        assert gap >= 0.6, f"{workload}: patched again {gap:.3f} s after the first patch's decision at the latest"
    assert {kind for *_, kind in emu.patches} == {"application/merge-patch+json"}
    assert any(f'{{namespace="{NS}",service="{PREFILL}"}}' in q for q in prom.queries)
    assert any('kvmesh_kv_usage_ratio{service="prod-kvmesh-decode"}' in q for q in prom.queries)
    assert "scaled deployment/prod-kvmesh-prefill from 1 to 3" in log.read_text()


def test_dry_run_changes_nothing(kube, tmp_path):
    emu, kubeconfig = kube
    prom = FakePrometheus(lambda: {"kvmesh_kv_usage_ratio": 0.99, "kvmesh_inter_token_latency_seconds": 0.01})
    try:
        with planner(tmp_path, "--prometheus-url", prom.url, "--kubeconfig", str(kubeconfig),
                     "--decode-deployment", DECODE, "--dry-run", "--scale-up-cooldown-s", "0") as (proc, log):
            wait_until(lambda: "dry run: would scale deployment/prod-kvmesh-decode from 4 to 5" in log.read_text(),
                       proc, log, "a dry-run decision logged")
            time.sleep(0.5)
    finally:
        prom.close()
    assert emu.patches == [] and emu.replicas[DECODE] == 4


def test_no_data_holds_and_a_missing_deployment_is_reported(kube, tmp_path):
    """Prometheus answers nothing for the decode pool's KV usage: unknown, so no scale-down; a
    Deployment the API server does not have is logged, and the planner keeps running."""
    emu, kubeconfig = kube
    prom = FakePrometheus(lambda: {"kvmesh_inter_token_latency_seconds": 0.0})
    try:
        with planner(tmp_path, "--prometheus-url", prom.url, "--kubeconfig", str(kubeconfig),
                     "--decode-deployment", DECODE, "--prefill-deployment", "no-such-pool",
                     "--stabilization-window-s", "0") as (proc, log):
            wait_until(lambda: "cannot read the scale of deployment/no-such-pool" in log.read_text(), proc, log,
                       "the missing Deployment reported")
            time.sleep(0.5)
            assert proc.poll() is None
    finally:
        prom.close()
    assert emu.patches == []


def worker_page(kv_usage: float):
    """A decode worker's page: a real prometheus_client exporter on 127.0.0.1."""
    registry = CollectorRegistry()
    Gauge("kvmesh_kv_usage_ratio", "KV usage", registry=registry).set(kv_usage)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    return server, server.server_address[1]


def test_scales_decode_from_the_pages_without_prometheus(kube, tmp_path):
    """No --prometheus-url: the planner reads the decode workers' and the gateway's /metrics
    itself; inter-token latency from the buckets observed between two reads."""
    emu, kubeconfig = kube
    servers = []
    gateway = CollectorRegistry()
    itl = Histogram("kvmesh_inter_token_latency_seconds", "ITL", buckets=(0.01, 0.1, 0.5, 1.0), registry=gateway)
    gw_server, _ = start_http_server(0, addr="127.0.0.1", registry=gateway)
    gw_port = gw_server.server_address[1]
    servers.append(gw_server)
    urls = []
    for usage in (0.3, 0.5):
        server, port = worker_page(usage)
        servers.append(server)
        urls.append(f"http://127.0.0.1:{port}/metrics")
    try:
        with planner(tmp_path, "--kubeconfig", str(kubeconfig), "--decode-deployment", DECODE,
                     "--decode-metrics-urls", ",".join(urls),
                     "--gateway-metrics-urls", f"http://127.0.0.1:{gw_port}/metrics",
                     "--decode-max-replicas", "6", "--scale-up-cooldown-s", "0") as (proc, log):
            # KV usage 0.4 on average, ITL fast: inside the band, nothing happens
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                itl.observe(0.005)
                time.sleep(0.02)
            assert emu.patches == [], log.read_text()[-2000:]
            # chunks now come 0.3 s apart: p90 above --itl-p90-up-s (0.1), so the pool grows
            def slow_and_grown() -> bool:
                for _ in range(20):
                    itl.observe(0.3)
                return emu.replicas[DECODE] >= 6
            wait_until(slow_and_grown, proc, log, "decode grown to its maximum on slow inter-token latency")
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    # 3x over the threshold asks for 8 more pods: max_step (2) gives 6, the maximum
    assert [body["spec"]["replicas"] for *_, body, _ in emu.patches] == [6]


def test_missing_credentials_exit_with_a_message(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    out = subprocess.run([sys.executable, "-m", "services.cli", "planner", "--decode-deployment", DECODE,
                          "--kubeconfig", str(tmp_path / "missing"), "--prometheus-url", "http://127.0.0.1:9"],
                         cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "kvmesh planner: cannot load Kubernetes credentials" in out.stderr and "Traceback" not in out.stderr
