"""`kvmesh serve --prefill-workers 1 --decode-workers 1 --workers 0`: the disaggregated stack on one
machine; a long prompt goes through the prefill worker to the decode worker."""
from __future__ import annotations

import re

import pytest

from tests.integration.pd_stack import metric
from tests.integration.serve_proc import Serve

pytestmark = pytest.mark.timeout(600)


def test_serve_runs_prefill_and_decode_pools(tiny_model, tmp_path):
    serve = Serve(tmp_path, "--model", tiny_model, "--device", "cpu", "--prefill-workers", "1",
                  "--decode-workers", "1", "--workers", "0", "--pd-min-prefill-tokens", "32",
                  "--num-gpu-blocks", "256")
    try:
        serve.wait_serving()
        assert serve.child("--worker-id prefill-0") and serve.child("--worker-id decode-0")
        assert serve.child("--worker-id worker-0") is None          # --workers 0: the pools alone
        assert "--role prefill" in _cmdline(serve, "prefill-0") and "--role decode" in _cmdline(serve, "decode-0")
        client = serve.openai()
        r = client.completions.create(model=client.models.list().data[0].id, prompt=list(range(40, 120)),
                                      max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5
        log = serve.log()               # every service's page, logged then listed, not the one-page view
        pages = set(re.findall(r"http://127\.0\.0\.1:\d+/metrics", log)) - set(re.findall(r"one page: (\S+)", log))
        assert sum(metric(p, "kvmesh_scheduler_pd_routes_total", 'route="pd"') for p in pages) == 1
        assert sum(metric(p, "kvmesh_worker_kv_handoffs_total", 'outcome="ack"') for p in pages) == 1
    finally:
        assert serve.stop() == 0


def _cmdline(serve: Serve, worker_id: str) -> str:
    from tests.integration.serve_proc import cmdline
    return cmdline(serve.child(f"--worker-id {worker_id}"))
