"""One Prometheus page for a whole local stack (`kvmesh serve`): every scrape reads each local
service's own /metrics and returns them together, names unchanged, each series labelled with the
`service` it came from (gateway, scheduler, worker, tokenizer, prefix-cache) and, on a worker's,
the `worker` id. A page that does not answer in time is left out and marked by
`kvmesh_fleet_page_up{service,worker} 0`.

On Kubernetes Prometheus scrapes each pod itself (the chart's ServiceMonitor); this page is for
one machine, where the services' ports are chosen at start and change when one restarts.
"""
from __future__ import annotations

import logging
import urllib.request
from typing import Callable, Iterator, NamedTuple

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("kvmesh.metrics")

PAGE_TIMEOUT_S = 2.0
MAX_PAGE_BYTES = 16 << 20


class Page(NamedTuple):
    service: str       # the service kind: gateway, scheduler, worker, ...
    worker: str        # the worker id on a worker's page, else ""
    url: str


def _read(url: str) -> str:
    with urllib.request.urlopen(url, timeout=PAGE_TIMEOUT_S) as r:
        body = r.read(MAX_PAGE_BYTES + 1)
    if len(body) > MAX_PAGE_BYTES:
        raise ValueError(f"{url}: page over {MAX_PAGE_BYTES} bytes")
    return body.decode()


class FleetCollector:
    """Collects `pages()` (asked again at every scrape: a restarted service has a new port)."""

    def __init__(self, pages: Callable[[], list[Page]]) -> None:
        self.pages = pages

    def describe(self) -> list:
        return []    # names are only known by scraping; nothing to reserve

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("kvmesh_fleet_page_up", "1 when a local service's /metrics answered this scrape "
                               "of the fleet page, else 0 (its series are then missing)", labels=["service", "worker"])
        merged: dict[str, Metric] = {}
        for page in self.pages():
            try:
                families = list(text_string_to_metric_families(_read(page.url)))
            except (OSError, ValueError) as exc:
                log.debug("fleet page: %s (%s) did not answer: %s", page.service, page.url, exc)
                up.add_metric([page.service, page.worker], 0)
                continue
            up.add_metric([page.service, page.worker], 1)
            added = {"service": page.service, **({"worker": page.worker} if page.worker else {})}
            for family in families:
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                if into.type != family.type:
                    continue      # one name, two types in two processes: keep the first one's
                for s in family.samples:
                    into.add_sample(s.name, {**added, **s.labels}, s.value, s.timestamp, s.exemplar)
        yield up
        yield from merged.values()


def serve_fleet_metrics(host: str, port: int, pages: Callable[[], list[Page]]) -> int:
    """The fleet page on http://host:port/metrics (0: any free port, -1: off, returns -1).
    Returns the bound port."""
    if port < 0:
        return -1
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(pages))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server.server_address[1]
