"""A drain that moves a stream to the other worker with its KV (`kvmesh serve --workers 2`, the
tiny model, real processes): SIGTERM on the worker streaming a greedy request mid-decode; the
client sees one stream with the text of the same request on an undisturbed stack, the peer logs
that it decodes on from the received KV (nothing recomputed), and both workers end with no
request held. Seeded sampling, refusals, aborts and a silent holder: the worker cores over the
same sockets, tests/gpu_worker/service/test_peer_moves.py."""
from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from tests.integration.serve_proc import Serve
from tests.integration.stack import wait_for
from tests.integration.test_serve_supervision import _redis_url
from services.registry import list_records

PROMPT = "drain " * 40
MAX_TOKENS = 700           # the tiny model streams ~1 token per few ms on CPU: long enough to be cut
MOVED = "with its KV ("
# the one fallback this stack can take: the drained worker's last step output reached the client
# after the scheduler's move had read the client's tokens (one hop against two), so the worker
# cancels and the peer recomputes the same tokens (gpu_worker/service/peer_moves.py)
RACED = "its client has other tokens than its held KV"


@pytest.fixture
def serve(tiny_model, tmp_path):
    s = Serve(tmp_path, "--model", tiny_model, "--workers", "2", "--device", "cpu", "--num-gpu-blocks", "256", "--log-level", "info",
              env={"KVMESH_DRAIN_GRACE_S": "0"})
    try:
        s.wait_serving()
        yield s
    finally:
        s.stop()


def _workers(redis_url: str) -> list:
    return [r for r in list_records(redis_url, "worker", None) if not r.info.get("draining")]


def _drained_stream(serve: Serve, redis_url: str, extra: dict) -> str:
    body = {"model": serve.openai().models.list().data[0].id, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
            "stream": True, "ignore_eos": True, **extra}
    events: list[str] = []
    victim = None
    with httpx.Client(timeout=120) as http, http.stream("POST", serve.base_url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if victim is None and len(events) >= 20:      # its worker's load shows it within a heartbeat
                busy = [w for w in _workers(redis_url) if w.load.get("requests")]
                if busy:
                    victim = busy[0]
                    os.kill(victim.info["pid"], signal.SIGTERM)
    assert victim is not None and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks[-3:]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def test_a_drained_stream_goes_on_at_the_peer_with_its_kv(serve):
    redis_url = _redis_url(serve)
    client = serve.openai()
    model = client.models.list().data[0].id
    wait_for(lambda: len(_workers(redis_url)) == 2, 60, "two workers")
    text = _drained_stream(serve, redis_url, {"temperature": 0})
    wait_for(lambda: MOVED in serve.log() or RACED in serve.log(), 10,
             "the peer's log line: " + "".join(ln for ln in serve.log().splitlines(True) if "request r-" in ln)[-2000:])
    healthy = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert text == healthy.choices[0].text
    # the draining worker priced the move: the tiny model's KV beats recomputing it (move_cost.py)
    assert "handed back: 1 move to peers with their KV, 0 are recomputed" in serve.log()
    if RACED not in serve.log():
        assert "recomputing" not in serve.log()
    wait_for(lambda: all(not w.load.get("requests") for w in _workers(redis_url)), 10, "no request held")
