"""kvmesh bench's speculation report: kvmesh's and vLLM's counters parsed from real /metrics text
(summed over methods and endpoints, per position apart), a run's increase turned into acceptance
rate and mean accepted length, nothing shown for a run that verified no draft."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from services.bench import spec_metrics

KVMESH = """# TYPE kvmesh_spec_decode_num_drafts counter
kvmesh_spec_decode_num_drafts_total{method="draft_model"} 10.0
kvmesh_spec_decode_num_drafts_created{method="draft_model"} 1.7e9
# TYPE kvmesh_spec_decode_num_draft_tokens counter
kvmesh_spec_decode_num_draft_tokens_total{method="draft_model"} 30.0
# TYPE kvmesh_spec_decode_num_accepted_tokens counter
kvmesh_spec_decode_num_accepted_tokens_total{method="draft_model"} 18.0
# TYPE kvmesh_spec_decode_num_accepted_tokens_per_pos counter
kvmesh_spec_decode_num_accepted_tokens_per_pos_total{method="draft_model",position="0"} 9.0
kvmesh_spec_decode_num_accepted_tokens_per_pos_total{method="draft_model",position="1"} 6.0
kvmesh_spec_decode_num_accepted_tokens_per_pos_total{method="draft_model",position="2"} 3.0
"""
VLLM = """# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 4.0
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 12.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 6.0
"""


def _serve(pages: dict[str, str]):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = pages.get(self.path, "").encode()
            self.send_response(200 if self.path in pages else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_counters_summed_over_pages_and_turned_into_a_run_report():
    server, base = _serve({"/a": KVMESH, "/b": VLLM})
    try:
        before = {"num_drafts": 2.0, "num_draft_tokens": 6.0, "num_accepted_tokens": 3.0,
                  "num_accepted_tokens_per_pos": {0: 2.0, 1: 1.0}}
        after, failed = spec_metrics.scrape([f"{base}/a", f"{base}/b", f"{base}/missing"])
        assert [url for url, _ in failed] == [f"{base}/missing"]
        assert after["num_drafts"] == 14.0 and after["num_draft_tokens"] == 42.0 and after["num_accepted_tokens"] == 24.0
        assert after["num_accepted_tokens_per_pos"] == {0: 9.0, 1: 6.0, 2: 3.0}
        run = spec_metrics.run_stats(before, after)
        assert run["spec_num_drafts"] == 12 and run["spec_num_draft_tokens"] == 36
        assert run["spec_acceptance_rate"] == 21 / 36 and run["spec_mean_accepted_length"] == 1 + 21 / 12
        assert run["spec_acceptance_rate_per_pos"] == [round(7 / 12, 4), round(5 / 12, 4), round(3 / 12, 4)]
        text = "\n".join(spec_metrics.format_lines(run))
        assert "Acceptance rate (%):" in text and "58.33" in text and "2.75" in text
        assert spec_metrics.run_stats(after, after) is None
    finally:
        server.shutdown()
