"""`kvmesh bench chaos`: failover measured. A stack of its own on this machine (embedded Redis, a
scheduler, --workers null-model workers: fake tokens whose value at output position p is a function
of the prompt's length, the sample and p, wherever it is drawn; two gateways, one that makes its own
text and one that streams it through a tokenizer service, each taking every other request), a
steady streaming load of --requests seeded and greedy requests, and four faults at fixed points of
it:

    20% of the requests done   kill -9 one worker
    35%                        SIGTERM another (drains: --drain-grace-s, then hands its requests back)
    50%                        Redis restarted (stopped, started again empty on the same port)
    65%                        kill -9 the scheduler, a new one started

Then it counts, against the same requests run on the healthy stack first: lost (an error), corrupted
(text, finish, usage or logprob count different: a token duplicated, missing or reordered), migrated
(the schedulers' kvmesh_scheduler_migrations_total, summed over both), the drained worker's exit
status, KV blocks still used and leases of stopped processes still registered once the load is over,
the added latency of a moved request at p50 / p99 over every moved request, with the split (exact,
chaos_stalls.py: a resumed one's wait from its last tokens before the move to the first from its new
worker, as its detokenizer logged it; a re-sent one's, sent again to the restarted scheduler before
its first token, and one moved off a stopped worker before that worker opened its stream, from its
Submit to that token, as its gateway logged it; all also read from their histograms, which must
agree; the moves no process timed, and why), and the added latency of a stalled stream as the
client saw it (one that waited past --moved-gap-s between two chunks: the moved ones, and those the
Redis and scheduler restarts paused) over the median of the others. Prints the table and writes it with every count to
--out (JSON).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from services.bench import chaos_stalls

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--lease-ms", "1500", "--heartbeat-ms", "250"]
FAULTS = ((0.20, "kill_worker"), (0.35, "drain_worker"), (0.50, "restart_redis"), (0.65, "restart_scheduler"))
PROMPT_LENGTHS = range(5, 13)
MAX_TOKENS = (16, 24, 32)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=800, help="streaming requests in the load (>= 8)")
    p.add_argument("--concurrency", type=int, default=48, help="requests in flight at once")
    p.add_argument("--workers", type=int, default=4, help="null-model workers (>= 3: one killed, one drained)")
    p.add_argument("--step-ms", type=float, default=20.0, help="the null model's step time")
    p.add_argument("--drain-grace-s", type=float, default=0.2, help="the drained worker's grace")
    p.add_argument("--moved-gap-s", type=float, default=0.5,
                   help="a stream that waited this long between two chunks counts as moved (latency columns)")
    p.add_argument("--model", default="", help="model directory for the tokenizer (default: a tiny one, made here)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="bound on the whole load")
    p.add_argument("--out", default="", help="JSON result path (default: bench/results/chaos_<time>.json)")


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.requests < 8:
        parser.error("--requests must be at least 8 (the faults come at fixed fractions of the load)")
    if args.workers < 3:
        parser.error("--workers must be at least 3: one is killed, one drained, one must be left")
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")


def request_of(i: int) -> dict:
    """The i-th request: prompt length, budget, samples and sampling vary with i."""
    body: dict[str, Any] = {"prompt": list(range(300, 300 + PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)])),
                            "max_tokens": MAX_TOKENS[(i // 3) % len(MAX_TOKENS)], "n": 2 if i % 8 == 0 else 1,
                            "temperature": 0.8 if i % 3 else 0.0}
    if i % 3:
        body["seed"] = i
    if i % 5 == 0:
        body["logprobs"] = 1
    return body


class Stack:
    """The services as real processes (`python -m services.cli ...`), with their logs in one directory."""

    def __init__(self, work: Path, model: str, args: argparse.Namespace) -> None:
        from services.embedded_redis import EmbeddedRedis
        from services.ports import free_port
        from services.security import bundle
        self.work, self.model, self.args = work, model, args
        self.trust = bundle.generate(work / "trust").root
        self.redis = EmbeddedRedis(password=bundle.Paths(self.trust).redis_password.read_text().strip()).start()
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports, self.sched_metrics, self.tok_metrics = (free_port(), free_port()), free_port(), free_port()
        self.workers = [f"chaos-{i}" for i in range(args.workers)]
        # a Redis started again by the fault thread dies with that thread (PR_SET_PDEATHSIG acts per
        # thread): the thread waits for this before it ends, set when the stack stops
        self.released = threading.Event()

    def start(self, name: str, service: str, *flags: str) -> None:
        log = open(self.work / f"{name}.log", "ab")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "services.cli", service, "--redis-url", self.redis.url, "--trust-dir",
             str(self.trust), *flags], cwd=ROOT, stdout=log, stderr=log, env=env)

    def start_scheduler(self) -> None:
        self.start("scheduler", "scheduler", *FAST, "--host", "127.0.0.1", "--port", "0", "--zmq-port", "0",
                   "--metrics-port", str(self.sched_metrics), "--routing", "least_loaded")

    def up(self) -> None:
        self.start_scheduler()
        for name in self.workers:
            self.start(name, "worker", *FAST, "--host", "127.0.0.1", "--port", "0", "--zmq-port", "0",
                       "--metrics-port", "-1", "--model", self.model, "--null-model", "--null-step-ms",
                       str(self.args.step_ms), "--max-num-seqs", "32", "--num-gpu-blocks", "2048", "--worker-id",
                       name, "--drain-grace-s", str(self.args.drain_grace_s))
        self.start("tokenizer", "tokenizer", *FAST, "--host", "127.0.0.1", "--port", "0", "--zmq-port", "0",
                   "--metrics-port", str(self.tok_metrics), "--model", self.model)
        self.start("gateway", "gateway", *FAST, "--port", str(self.ports[0]), "--zmq-port", "0",
                   "--text-in-gateway", "--model", self.model)
        self.start("gateway-tok", "gateway", *FAST, "--port", str(self.ports[1]), "--zmq-port", "0",
                   "--no-text-in-gateway")
        wait_for(lambda: all(map(self.ready, self.bases)) and len(self.records("worker")) == len(self.workers),
                 180, "the stack to be ready")

    @property
    def bases(self) -> tuple[str, ...]:
        """The gateway that makes its own text, then the one streaming through the tokenizer service."""
        return tuple(f"http://127.0.0.1:{port}" for port in self.ports)

    @staticmethod
    def ready(base: str) -> bool:
        try:
            return httpx.get(base + "/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def move_timers(self) -> tuple[list[Path], list[str]]:
        """The processes that time moved requests (the detokenizers: the gateway with
        --text-in-gateway and the tokenizer service; and both gateways): their logs and /metrics pages."""
        return ([self.work / "gateway.log", self.work / "gateway-tok.log", self.work / "tokenizer.log"],
                [*(base + "/metrics" for base in self.bases), f"http://127.0.0.1:{self.tok_metrics}/metrics"])

    def records(self, kind: str) -> list:
        from services.registry import list_records
        return list_records(self.redis.client_url, kind, None)

    def migrations(self) -> dict[str, float]:
        """This scheduler's kvmesh_scheduler_migrations_total by reason/outcome ({} when unreachable)."""
        try:
            text = httpx.get(f"http://127.0.0.1:{self.sched_metrics}/metrics", timeout=5).text
        except httpx.HTTPError:
            return {}
        from prometheus_client.parser import text_string_to_metric_families
        return {"{" + ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())) + "}": sample.value
                for family in text_string_to_metric_families(text) for sample in family.samples
                if sample.name == "kvmesh_scheduler_migrations_total"}

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.released.set()
        self.redis.stop()


def wait_for(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")


async def stream_one(http: httpx.AsyncClient, model: str, body: dict) -> dict:
    """One streamed request: text and finish per sample, usage, logprob tokens, timing, error."""
    t0 = last = time.monotonic()
    out: dict[str, Any] = {"texts": {}, "finish": {}, "logprobs": 0, "completion_tokens": None, "error": None,
                           "max_gap": 0.0}
    try:
        async with http.stream("POST", "/v1/completions", json={
                "model": model, "stream": True, "stream_options": {"include_usage": True}, **body}) as r:
            if r.status_code != 200:
                out["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic()
                out["max_gap"], last = max(out["max_gap"], now - last), now
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = chunk["error"].get("code") or "error"
                if chunk.get("usage"):
                    out["completion_tokens"] = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices", []):
                    out["texts"][c["index"]] = out["texts"].get(c["index"], "") + c["text"]
                    if c.get("finish_reason"):
                        out["finish"][c["index"]] = c["finish_reason"]
                    if c.get("logprobs"):
                        out["logprobs"] += len(c["logprobs"].get("tokens") or [])
    except httpx.HTTPError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.monotonic() - t0
    return out


def corrupted(body: dict, result: dict, reference: list[str]) -> bool:
    n, budget = body["n"], body["max_tokens"]
    return ([result["texts"].get(i) for i in range(n)] != reference
            or any(result["finish"].get(i) != "length" for i in range(n))
            or result["completion_tokens"] != n * budget
            or ("logprobs" in body and result["logprobs"] != n * budget))


async def references(http: httpx.AsyncClient, model: str, bodies: list[dict]) -> dict[tuple, list[str]]:
    """Each distinct request's text per sample on the healthy stack (greedy, not streamed: the null
    model's tokens do not depend on sampling)."""
    keys = {(len(b["prompt"]), b["max_tokens"], b["n"]): b for b in bodies}

    async def one(b: dict) -> list[str]:
        r = await http.post("/v1/completions", json={"model": model, "prompt": b["prompt"], "n": b["n"],
                                                     "max_tokens": b["max_tokens"], "temperature": 0.0})
        r.raise_for_status()
        return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    return dict(zip(keys, await asyncio.gather(*(one(b) for b in keys.values()))))


def inject(stack: Stack, done: list[int], total: int, fired: dict[str, float], counted: list[dict],
           deadline: float) -> None:
    """The faults, each once the load has done its fraction of the requests; then waits for the
    stack to stop (the Redis it started again lives as long as this thread)."""
    try:
        _inject(stack, done, total, fired, counted, deadline)
    finally:
        stack.released.wait()


def _inject(stack: Stack, done: list[int], total: int, fired: dict[str, float], counted: list[dict],
            deadline: float) -> None:
    killed, drained = stack.workers[1], stack.workers[2]
    for fraction, fault in FAULTS:
        while len(done) < fraction * total and time.monotonic() < deadline:
            time.sleep(0.02)
        if time.monotonic() >= deadline:
            return
        if fault == "kill_worker":
            stack.procs[killed].send_signal(signal.SIGKILL)
        elif fault == "drain_worker":
            stack.procs[drained].send_signal(signal.SIGTERM)
        elif fault == "restart_redis":
            stack.redis.stop()
            time.sleep(0.5)
            stack.redis.start()
        else:
            counted.append(stack.migrations())           # the dying scheduler's counts
            stack.procs["scheduler"].send_signal(signal.SIGKILL)
            stack.procs["scheduler"].wait(10)
            stack.start_scheduler()
        fired[fault] = time.monotonic()


def settle(stack: Stack, alive: set[str], timeout_s: float = 30.0) -> tuple[int, int]:
    """(KV blocks still used on the live workers, leases of stopped processes) once both reach 0, or
    when timeout_s runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            workers = {r.id: r for r in stack.records("worker")}
            schedulers = stack.records("scheduler")
            used = sum(int(r.load.get("total_blocks", 0)) - int(r.load.get("free_blocks", 0))
                       for r in workers.values())
            busy = sum(int(r.load.get("requests", 0)) for r in workers.values())
            stale = len(set(workers) - alive) + max(len(schedulers) - 1, 0)
        except Exception:         # Redis still coming back: look again
            used = busy = stale = -1
        if (used == 0 and busy == 0 and stale == 0) or time.monotonic() > deadline:
            return used, stale
        time.sleep(0.2)


def run(args: argparse.Namespace) -> dict:
    """The stack's logs stay in its work directory when something was lost or corrupted (named in
    the result as `logs`), which is removed otherwise."""
    work = Path(tempfile.mkdtemp(prefix="kvmesh-chaos-"))
    res: dict = {}
    try:
        model = args.model
        if not model:
            from gpu_worker.make_model import make_model
            model = str(make_model(work / "tiny", arch="llama", size="tiny", progress=False))
        stack = Stack(work, model, args)
        try:
            stack.up()
            res = measure(stack, args, os.path.basename(model.rstrip("/")))
        finally:
            stack.stop()
    finally:
        if res and res["lost"] == 0 and res["corrupted"] == 0:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"the stack's logs: {work}", file=sys.stderr)
            res["logs"] = str(work)
    return res


def measure(stack: Stack, args: argparse.Namespace, model: str) -> dict:
    bodies = [request_of(i) for i in range(args.requests)]
    done: list[int] = []
    fired: dict[str, float] = {}
    counted: list[dict] = []
    deadline = time.monotonic() + args.timeout_s

    async def load() -> tuple[dict, list[dict]]:
        limits = httpx.Limits(max_connections=args.concurrency + 8)
        async with httpx.AsyncClient(base_url=stack.bases[0], timeout=120, limits=limits) as local, \
                httpx.AsyncClient(base_url=stack.bases[1], timeout=120, limits=limits) as via_tokenizer:
            refs = await references(local, model, bodies)
            gate = asyncio.Semaphore(args.concurrency)

            async def one(i: int) -> dict:
                async with gate:
                    result = await stream_one((local, via_tokenizer)[i % 2], model, bodies[i])
                    done.append(i)
                    return result
            results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(args.requests))),
                                             args.timeout_s)
            return refs, results

    injector = threading.Thread(target=inject, args=(stack, done, args.requests, fired, counted, deadline),
                                daemon=True)
    t0 = time.monotonic()
    injector.start()
    refs, results = asyncio.run(load())
    wall = time.monotonic() - t0
    wait_for(lambda: len(fired) == len(FAULTS), 30, "the faults to be injected")
    alive = set(stack.workers) - {stack.workers[1], stack.workers[2]}
    try:                       # a drain ends in a clean exit (0), its requests handed back
        drained_exit: int | None = stack.procs[stack.workers[2]].wait(30)
    except subprocess.TimeoutExpired:
        drained_exit = None
    leaked_blocks, leaked_leases = settle(stack, alive)
    moved: dict[str, float] = {}
    for counts in (*counted, stack.migrations()):
        for key, value in counts.items():
            moved[key] = moved.get(key, 0.0) + value
    lost = [i for i, r in enumerate(results) if r["error"] is not None]
    bad = [i for i, r in enumerate(results) if r["error"] is None and corrupted(
        bodies[i], r, refs[(len(bodies[i]["prompt"]), bodies[i]["max_tokens"], bodies[i]["n"])])]
    healthy = [r["seconds"] for r in results if r["max_gap"] < args.moved_gap_s and r["error"] is None]
    base = statistics.median(healthy) if healthy else 0.0
    added = sorted(r["seconds"] - base for r in results if r["max_gap"] >= args.moved_gap_s and r["error"] is None)
    logs, pages = stack.move_timers
    timed = chaos_stalls.summary(logs, chaos_stalls.scrape(pages))
    migrated_total = sum(v for k, v in moved.items() if 'outcome="moved"' in k)
    return timed | {
        "requests": args.requests, "workers": args.workers, "concurrency": args.concurrency,
        "step_ms": args.step_ms, "drain_grace_s": args.drain_grace_s, "moved_gap_s": args.moved_gap_s,
        "wall_s": round(wall, 2),
        "faults": sorted(fired), "lost": len(lost), "corrupted": len(bad),
        "migrated": {k.strip("{}"): v for k, v in sorted(moved.items())},
        "migrated_total": migrated_total,
        **{f"moved_untimed{'' if k == 'total' else '_' + k}": v
           for k, v in chaos_stalls.untimed(migrated_total, timed["moved_streams"], timed["moved_timed"]).items()},
        "leaked_kv_blocks": leaked_blocks, "leaked_leases": leaked_leases, "drained_exit": drained_exit,
        "stalled_streams": len(added),
        "added_latency_p50_ms": round(1000 * statistics.median(added), 1) if added else 0.0,
        "added_latency_p99_ms": round(1000 * added[min(len(added) - 1, int(0.99 * len(added)))], 1) if added else 0.0,
        "lost_examples": [str(results[i]["error"]) for i in lost[:5]],
        "corrupted_examples": [{"request": bodies[i], "texts": results[i]["texts"]} for i in bad[:3]],
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def table(res: dict) -> str:
    moved = ", ".join(f"{k} {v}" for k, v in res["moved_streams"].items()) or "none"
    return (f"chaos: {res['requests']} streaming requests, {res['workers']} null-model workers "
            f"({res['step_ms']:g} ms/step), faults: {', '.join(res['faults'])}; {res['wall_s']:.1f} s\n"
            "| requests | lost | corrupted | migrated | leaked KV blocks / leases | "
            "added latency of a moved request p50 / p99 | "
            f"of a stalled stream (gap > {res['moved_gap_s']:g} s) p50 / p99 |\n|---|---|---|---|---|---|---|\n"
            f"| {res['requests']} | {res['lost']} | {res['corrupted']} | {res['migrated_total']:.0f} | "
            f"{res['leaked_kv_blocks']} / {res['leaked_leases']} | "
            f"{res['moved_added_latency_p50_ms']:.0f} ms / {res['moved_added_latency_p99_ms']:.0f} ms | "
            f"{res['added_latency_p50_ms']:.0f} ms / {res['added_latency_p99_ms']:.0f} ms |\n"
            f"moved requests timed: {res['moved_timed']} of {res['migrated_total']:.0f} moves "
            f"({res['moved_stall_logged']} resumed: "
            f"{res['resumed_added_latency_p50_ms']:.0f} / {res['resumed_added_latency_p99_ms']:.0f} ms; "
            f"{res['resent_wait_logged']} re-sent before their first token: "
            f"{res['resent_added_latency_p50_ms']:.0f} / {res['resent_added_latency_p99_ms']:.0f} ms; "
            f"{res['moved_early_logged']} moved before their worker opened their stream: "
            f"{res['moved_early_added_latency_p50_ms']:.0f} / {res['moved_early_added_latency_p99_ms']:.0f} ms); "
            f"the histograms' p50 / p99: {res['moved_added_latency_hist_p50_ms']:.0f} / "
            f"{res['moved_added_latency_hist_p99_ms']:.0f} ms\n"
            + (f"{res['moved_untimed']} moves not timed: {res['moved_untimed_again']} moved a stream again within "
               f"one wait (timed once), {res['moved_untimed_no_wait']} moved one that ended or was aborted before "
               "its new worker's tokens (no wait)\n" if res["moved_untimed"] else "")
            + f"moved streams at the detokenizers: {moved}")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    check(args, parser)
    res = run(args)
    print(table(res))
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / (
        "chaos_" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if res["lost"] == 0 and res["corrupted"] == 0 else 1
