"""`kvmesh serve` shows every local service's metrics on one page too: it prints where, and the
page holds the gateway's, the scheduler's and each worker's series under their own names, each
labelled with the service (and worker) it came from."""
from __future__ import annotations

import os
import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.serve_proc import Serve
from tests.integration.stack import wait_for


def fleet_url(log: str) -> str:
    m = re.search(r"every service's metrics on one page: (http://127\.0\.0\.1:\d+/metrics)", log)
    assert m, log[-2000:]
    return m.group(1)


def samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_serve_prints_one_page_with_every_service(tiny_model, tmp_path):
    serve = Serve(tmp_path, "--model", tiny_model, "--workers", "2", "--null-model")
    try:
        serve.wait_serving()
        url = fleet_url(serve.log())
        r = serve.openai().completions.create(model=os.path.basename(tiny_model), prompt="hello", max_tokens=4)
        assert r.choices[0].text is not None

        def every_page_up() -> bool:
            up = {labels: v for (name, labels), v in samples(url).items() if name == "kvmesh_fleet_page_up"}
            return len(up) >= 4 and all(v == 1 for v in up.values())
        wait_for(every_page_up, 30, "every local service's page on the fleet page")
        got = samples(url)
        names = {name for name, _ in got}
        by_service = {}
        for name, labels in got:
            by_service.setdefault(dict(labels).get("service"), set()).add(name)
        assert "kvmesh_requests_total" in by_service["gateway"]
        assert "kvmesh_scheduler_workers" in by_service["scheduler"]
        workers = {dict(labels).get("worker") for name, labels in got
                   if name == "kvmesh_engine_running" and dict(labels)["service"] == "worker"}
        assert workers == {"worker-0", "worker-1"}
        assert got[("kvmesh_scheduler_workers", (("service", "scheduler"),))] == 2
        # names unchanged: each service's own page's series are all on the fleet page
        worker_page = re.search(r"^  worker-0\s+(http://\S+/metrics)$", serve.log(), re.M).group(1)
        own = {s.name for f in text_string_to_metric_families(httpx.get(worker_page, timeout=10).text)
               for s in f.samples}
        assert own <= names
    finally:
        assert serve.stop() == 0
