"""services/fleet_metrics.py on real exporters: several processes' pages as one, names unchanged,
each series labelled with its service (and worker), a page that does not answer marked down."""
from __future__ import annotations

import socket

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from services.fleet_metrics import FleetCollector, Page


def exporter(build) -> tuple[object, str]:
    registry = CollectorRegistry()
    build(registry)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    return server, f"http://127.0.0.1:{server.server_address[1]}/metrics"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def page_of(pages: list[Page]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(lambda: pages))
    return generate_latest(registry).decode()


def worker(usage: float):
    def build(registry):
        Gauge("kvmesh_kv_usage_ratio", "KV usage", registry=registry).set(usage)
        Histogram("kvmesh_engine_step_seconds", "step", buckets=(0.01, 0.1), registry=registry).observe(0.05)
    return build


def gateway(registry):
    Counter("kvmesh_requests", "requests", ["route", "status"], registry=registry).labels("chat", "200").inc(3)


def test_pages_merge_into_one_labelled_page():
    servers = []
    try:
        pages = []
        for service, ident, build in (("gateway", "", gateway), ("worker", "worker-0", worker(0.25)),
                                      ("worker", "worker-1", worker(0.75))):
            server, url = exporter(build)
            servers.append(server)
            pages.append(Page(service, ident, url))
        pages.append(Page("worker", "worker-2", f"http://127.0.0.1:{closed_port()}/metrics"))
        text = page_of(pages)
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    types = [line for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types)), "each family once, whichever processes show it"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("kvmesh_kv_usage_ratio", (("service", "worker"), ("worker", "worker-0")))] == 0.25
    assert samples[("kvmesh_kv_usage_ratio", (("service", "worker"), ("worker", "worker-1")))] == 0.75
    assert samples[("kvmesh_requests_total", (("route", "chat"), ("service", "gateway"), ("status", "200")))] == 3
    assert samples[("kvmesh_engine_step_seconds_bucket",
                    (("le", "0.1"), ("service", "worker"), ("worker", "worker-1")))] == 1
    assert samples[("kvmesh_fleet_page_up", (("service", "worker"), ("worker", "worker-2")))] == 0
    assert samples[("kvmesh_fleet_page_up", (("service", "gateway"), ("worker", "")))] == 1
    assert not any(dict(labels).get("worker") == "worker-2" for name, labels in samples
                   if name != "kvmesh_fleet_page_up")


def test_a_label_the_page_already_has_is_kept():
    """The scheduler's per-worker gauges carry `worker` themselves: the page's value stays."""
    def scheduler(registry):
        Gauge("kvmesh_worker_running_requests", "running", ["worker"], registry=registry).labels("worker-7").set(2)
    server, url = exporter(scheduler)
    try:
        text = page_of([Page("scheduler", "", url)])
    finally:
        server.shutdown()
        server.server_close()
    assert 'kvmesh_worker_running_requests{service="scheduler",worker="worker-7"} 2.0' in text
