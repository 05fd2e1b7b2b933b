"""Workers joining and dying while the stack serves. Runs after the other modules (it kills worker-0)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx

from tests.integration.stack import wait_for


def _totals(stack) -> dict[str, int]:
    from tests.integration.stack import records
    return {r.id: r.load.get("requests_total", 0) for r in records(stack.redis_url, "worker")}


NEW = "w1-late"   # sorts before "worker-0": least-loaded alone would break ties in its favour


def test_second_worker_takes_load_then_a_killed_workers_stream_moves_to_the_survivor(stack):
    prompt = list(range(300, 400))                    # cached on worker-0 only (the only worker yet)
    client = stack.openai()
    client.completions.create(model=stack.model_name, prompt=prompt, max_tokens=1)

    # -- a worker started later is discovered without restarting anything and takes load
    stack.procs.start_worker(NEW, stack.model)
    wait_for(lambda: stack.worker(NEW), 120, f"{NEW} to register")

    # -- cache-aware routing: with both idle, the prompt goes back to the worker holding its
    #    prefix (the prefix-cache index's answer), not to the tie-break winner
    wait_for(lambda: all(w and w.load.get("requests") == 0 for w in (stack.worker("worker-0"), stack.worker(NEW))),
             10, "both workers idle")
    r = client.completions.create(model=stack.model_name, prompt=prompt, max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens >= 64

    before = _totals(stack)
    results: list = []

    def one(i: int) -> None:
        results.append(client.completions.create(model=stack.model_name, prompt=f"p{i}", max_tokens=24,
                                                 temperature=0, extra_body={"ignore_eos": True}))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 8
    after = wait_for(lambda: (a := _totals(stack)) and sum(a.values()) - sum(before.values()) >= 8 and a, 5,
                     "the load reports")
    assert after[NEW] > before.get(NEW, 0), (before, after)
    assert after["worker-0"] > before.get("worker-0", 0), (before, after)

    # -- kill -9 the worker serving a stream: the stream goes on at the survivor from the tokens
    #    already streamed (greedy: the same text as a run that never moved), never an error
    wait_for(lambda: all(w and w.load.get("requests") == 0 for w in (stack.worker("worker-0"), stack.worker(NEW))),
             10, "both workers idle (fresh load reports)")
    body = {"model": stack.model_name, "prompt": "long " * 5, "max_tokens": 300, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    events: list[str] = []
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", stack.base_url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            victim = None
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if victim is None and len(events) >= 3:
                    busy = [w for w in (stack.worker("worker-0"), stack.worker(NEW))
                            if w and w.load.get("requests")]
                    if busy:
                        victim = busy[0]
                        os.kill(victim.info["pid"], signal.SIGKILL)
    assert victim is not None
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks[-3:]
    assert chunks[-1]["usage"]["completion_tokens"] == 300
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    stack.procs.procs.pop(victim.id).wait(10)
    healthy = stack.openai().completions.create(model=stack.model_name, prompt="long " * 5, max_tokens=300,
                                                temperature=0, extra_body={"ignore_eos": True})
    assert text == healthy.choices[0].text

    # -- the next requests go to the survivor
    survivor = NEW if victim.id == "worker-0" else "worker-0"
    wait_for(lambda: stack.worker(victim.id) is None, 10, "the dead worker's lease to expire")
    for _ in range(3):
        r = stack.openai().completions.create(model=stack.model_name, prompt="again", max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length")
    wait_for(lambda: stack.worker(survivor).load["requests_total"] >= after[survivor] + 3, 5,
             "the survivor to report the new requests")
