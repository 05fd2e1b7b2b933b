"""`kvmesh serve` as a supervisor: a worker, the embedded Redis or a required service that exits is
restarted while the rest keeps serving; a crash loop stops the stack with the reason."""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx

from services.redis_client import RedisAuth
from services.registry import list_records
from tests.integration.serve_proc import Serve, children, is_zombie
from tests.integration.stack import wait_for

STREAMS = 20
STREAM_TOKENS = 400        # x 20 ms a null-model step: a stream lasts ~8 s, long enough to be cut


def _redis_url(serve: Serve) -> str:
    """The stack's Redis URL with its password: serve hands services the URL through their
    environment and the password through the trust directory (neither is on argv)."""
    pid = serve.child(" scheduler ")
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split("=", 1) for item in f.read().decode().split("\0") if "=" in item)
    password = RedisAuth.from_dir(argv[argv.index("--trust-dir") + 1]).password
    return env["KVMESH_REDIS_URL"].replace("redis://", f"redis://:{password}@", 1)


def _worker_pid_in_registry(redis_url: str, worker_id: str) -> int | None:
    try:
        record = next((r for r in list_records(redis_url, "worker", None) if r.id == worker_id), None)
    except Exception:      # Redis restarting
        return None
    return record.info.get("pid") if record else None


def _stream(client, model: str, i: int, started: threading.Semaphore, out: dict) -> None:
    """One streamed completion through the official client, read as raw SSE lines so the test sees
    the error chunk and `[DONE]` themselves."""
    events: list[str] = []
    try:
        with client.completions.with_streaming_response.create(
                model=model, prompt=f"stream {i}", max_tokens=STREAM_TOKENS, stream=True,
                extra_body={"ignore_eos": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        started.release()
    finally:
        out[i] = (events, time.monotonic())


def _streams_through(client, model: str, pids: list[int], within_s: float) -> dict[int, str]:
    """STREAMS streams; once every one is under way, SIGKILL `pids`: each stream's outcome."""
    started, results = threading.Semaphore(0), {}
    threads = [threading.Thread(target=_stream, args=(client, model, i, started, results), daemon=True)
               for i in range(STREAMS)]
    for t in threads:
        t.start()
    for _ in range(STREAMS):
        assert started.acquire(timeout=90), "not every stream started"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    for t in threads:
        t.join(max(t_kill + within_s - time.monotonic(), 0.1))
    assert len(results) == STREAMS, f"{STREAMS - len(results)} streams hung"
    return {i: _outcome(events) for i, (events, _) in results.items()}


def _outcome(events: list[str]) -> str:
    assert events and events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    if "error" in last:
        assert last["error"]["code"] == "worker_failed", last
        return "failed"
    assert any(json.loads(e)["choices"] and json.loads(e)["choices"][0].get("finish_reason") == "length"
               for e in events[:-1]), events[-3:]
    return "completed"


def _poll_ready(base_url: str, seen: list, polling: threading.Event) -> None:
    with httpx.Client(timeout=5) as http:
        deadline = time.monotonic() + 120
        while polling.is_set() and time.monotonic() < deadline:
            try:
                r = http.get(base_url + "/ready")
                seen.append((time.monotonic(), r.status_code, r.json()))
            except httpx.HTTPError:
                seen.append((time.monotonic(), 0, {}))
            time.sleep(0.02)


def _completes(serve: Serve, model: str) -> bool:
    import openai
    try:
        r = serve.openai().completions.create(model=model, prompt="hi", max_tokens=4)
    except openai.APIStatusError as exc:
        assert exc.status_code == 503, exc
        return False
    except openai.APIConnectionError:      # the gateway is not listening again yet
        return False
    return r.choices[0].finish_reason in ("stop", "length")


def _metrics_pages(log: str) -> dict[str, str]:
    block = log.split("metrics (Prometheus", 1)[1].splitlines()[1:]
    pages = {}
    for line in block:
        m = re.match(r"^  (\S+)\s+(http://\S+/metrics)$", line)
        if not m:
            break
        pages[m.group(1)] = m.group(2)
    return pages


def test_a_killed_or_drained_worker_is_restarted_while_the_other_keeps_serving(tiny_model, tmp_path):
    serve = Serve(tmp_path, "--model", tiny_model, "--workers", "2", "--null-model", "--null-step-ms", "20")
    try:
        serve.wait_serving()
        model = os.path.basename(tiny_model)

        # -- the banner lists every local service's /metrics, and each answers
        pages = _metrics_pages(serve.log())
        assert set(pages) >= {"gateway", "scheduler", "worker-0", "worker-1"}, pages
        assert "tokenizer" not in pages     # the gateway makes the text: no tokenizer service runs
        for name, page in pages.items():
            r = httpx.get(page, timeout=10)
            assert r.status_code == 200 and "# TYPE" in r.text, (name, page, r.status_code)

        # -- 20 streams across both workers; SIGKILL worker-0 once every stream is under way
        gateway, victim = serve.child(" gateway "), serve.child("--worker-id worker-0")
        redis_url = _redis_url(serve)
        client = serve.openai()
        outcomes = _streams_through(client, model, [victim], 60)
        assert "failed" not in outcomes.values(), outcomes   # the killed worker's streams moved on to the other

        # -- the stack stayed up, the worker is restarted under the same id, and new requests succeed
        assert serve.proc.poll() is None and serve.child(" gateway ") == gateway
        assert re.search(rf"worker-0 \(pid {victim}\) exited with signal SIGKILL; restarting it in", serve.log())
        wait_for(lambda: (p := serve.child("--worker-id worker-0")) not in (None, victim)
                 and _worker_pid_in_registry(redis_url, "worker-0") == p, 90, "worker-0 to be back")
        for i in range(3):
            r = client.completions.create(model=model, prompt=f"after {i}", max_tokens=4)
            assert r.choices[0].finish_reason in ("stop", "length")

        # -- both workers killed at once: the streams wait for the restarted ones and go on
        #    (--migration-wait-s), none fails
        killed = {w: serve.child(f"--worker-id {w}") for w in ("worker-0", "worker-1")}
        outcomes = _streams_through(client, model, list(killed.values()), 90)
        assert "failed" not in outcomes.values(), outcomes
        for w, pid in killed.items():
            wait_for(lambda: (p := serve.child(f"--worker-id {w}")) not in (None, pid)
                     and _worker_pid_in_registry(redis_url, w) == p, 90, f"{w} to be back")

        # -- SIGTERM drains worker-1 (code 0): also restarted, the stack stays up
        drained = serve.child("--worker-id worker-1")
        os.kill(drained, signal.SIGTERM)
        wait_for(lambda: f"worker-1 (pid {drained}) exited with code 0; restarting it in" in serve.log(), 60,
                 "worker-1's exit to be reported")
        wait_for(lambda: (p := serve.child("--worker-id worker-1")) not in (None, drained)
                 and _worker_pid_in_registry(redis_url, "worker-1") == p, 90, "worker-1 to be back")
        assert serve.proc.poll() is None and serve.child(" gateway ") == gateway
        r = client.completions.create(model=model, prompt="after the drain", max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length")

        t0 = time.monotonic()
        assert serve.stop() == 0
        assert time.monotonic() - t0 < 25
    finally:
        serve.stop()


def test_a_killed_embedded_redis_is_restarted_and_ready_says_so(tiny_model, tmp_path):
    serve = Serve(tmp_path, "--model", tiny_model, "--null-model")
    try:
        serve.wait_serving()
        model = os.path.basename(tiny_model)
        redis_url = _redis_url(serve)
        redis_pid = serve.child("-server ")                      # redis-server or valkey-server
        assert redis_pid is not None
        log_before = len(serve.log())
        seen: list[tuple[float, int, dict]] = []      # /ready, polled without pause from before the kill
        polling = threading.Event()
        poller = threading.Thread(target=_poll_ready, args=(serve.base_url, seen, polling), daemon=True)
        polling.set()
        poller.start()
        try:
            time.sleep(0.3)
            os.kill(redis_pid, signal.SIGKILL)
            wait_for(lambda: any(code == 503 for _, code, _ in seen), 20, "/ready to answer 503")
            assert httpx.get(serve.base_url + "/health", timeout=5).status_code == 200   # the process is alive
            wait_for(lambda: seen[-1][1] == 200 and any(c == 503 for _, c, _ in seen), 60,
                     "/ready to answer 200 again")
        finally:
            polling.clear()
            poller.join(10)
        down = [body for _, code, body in seen if code == 503]
        assert "Redis" in down[0].get("reason", ""), down[:3]
        assert serve.child("-server ") not in (None, redis_pid)               # a new server, same port
        for kind in ("scheduler", "worker", "gateway"):                      # everyone registered again
            wait_for(lambda: list_records(redis_url, kind, None), 30, f"the {kind} to register again")
        r = serve.openai().completions.create(model=model, prompt="after Redis", max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length")

        # -- no flood: a repeated warning is written at most once per 10 s per process
        time.sleep(2)
        lines = [line.split(" ", 2)[2] for line in serve.log()[log_before:].splitlines()
                 if " WARNING " in line or " ERROR " in line]
        sites: dict[str, int] = {}
        for line in lines:                       # "worker[N] kvmesh.worker: heartbeat failed: Error N conn"
            key = re.sub(r"\d+", "N", line)[:60]
            sites[key] = sites.get(key, 0) + 1
        assert sites and all(n <= 2 for n in sites.values()), sites

        # -- Ctrl-C (SIGINT to the whole process group, as a terminal sends it): everything stops,
        #    nothing is restarted, and it does not hang
        everyone, log_at_stop = children(serve.proc.pid), len(serve.log())
        os.killpg(serve.proc.pid, signal.SIGINT)
        assert serve.proc.wait(30) == 0
        assert "restarting" not in serve.log()[log_at_stop:], serve.log()[log_at_stop:]
        assert all(not os.path.exists(f"/proc/{pid}") or is_zombie(pid) for pid in everyone)
    finally:
        assert serve.stop() == 0


def test_a_killed_scheduler_or_gateway_comes_back_and_a_crash_loop_stops_the_stack(tiny_model, tmp_path):
    serve = Serve(tmp_path, "--model", tiny_model, "--null-model")
    try:
        serve.wait_serving()
        everyone = children(serve.proc.pid)
        first = serve.child(" scheduler ")
        os.kill(first, signal.SIGKILL)                                  # one exit: restarted
        wait_for(lambda: serve.child(" scheduler ") not in (None, first), 30, "the scheduler to restart")
        # a request that meets the old scheduler's record waits for the new one (its gateway sends
        # it again); one sent while no scheduler is registered gets a retryable 503
        wait_for(lambda: _completes(serve, os.path.basename(tiny_model)), 60, "a request through the new scheduler",
                 interval=0.5)

        gateway = serve.child(" gateway ")                              # the gateway too, on the same port
        os.kill(gateway, signal.SIGKILL)
        wait_for(lambda: serve.child(" gateway ") not in (None, gateway), 30, "the gateway to restart")
        wait_for(lambda: _completes(serve, os.path.basename(tiny_model)), 60, "a request through the new gateway",
                 interval=0.5)

        killed = {first}
        deadline = time.monotonic() + 120
        while serve.proc.poll() is None and time.monotonic() < deadline:   # kill each new one at once
            pid = serve.child(" scheduler ")
            if pid is not None and pid not in killed:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            time.sleep(0.05)
        assert serve.proc.wait(30) == 1
        assert len(killed) == 5, killed
        assert re.search(r"scheduler \(pid \d+\) exited with signal SIGKILL: it exited 5 times within 60 s; "
                         r"stopping the stack", serve.log()), serve.log()[-3000:]
        for pid in everyone:                                             # every other service stopped too
            assert not os.path.exists(f"/proc/{pid}") or is_zombie(pid)
    finally:
        serve.stop()
