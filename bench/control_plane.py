"""Control-plane benchmark on CPU: how much the service stack adds on top of the engine.

    python bench/control_plane.py [--model DIR] [--concurrency 128] [--duration 8]

Starts embedded Redis, tokenizer, scheduler, one null-model worker (fake tokens, no model math)
and two gateways as real processes (one tokenizing and, as `kvmesh serve` starts it,
detokenizing in-process; one using the tokenizer service's gRPC Tokenize and detokenizer), then
measures through gateway -> scheduler -> worker -> [detokenizer ->] gateway -> client:

  * TTFT at idle (sequential streaming requests, max_tokens=1) vs the same engine in-process, for
    "hello world", for prompts of --long-prompt-words random words and for prompts of
    --prompt-tokens tokens built like `kvmesh bench serve --dataset-name random` builds them (random
    vocabulary ids decoded to text: the H200 serving run's c=1 prompts), each with the services'
    stage histograms (bench/stage_metrics.py) printed as where the mean first token went
  * inter-token latency of a lone stream vs an in-process engine step
  * requests/s with short requests, and streamed tokens/s with many long streams

The client is a minimal HTTP/1.1 reader (no JSON parsing) so that it measures the server, not
itself. Targets: < 1 ms added TTFT at idle, >= 20k streamed tokens/s.

`--vocab-size 128256` makes the tiny model with Llama-3.1-8B's vocabulary size, whose tokenizer is
the one `make-model --size 8b` writes (32768 BPE tokens; the default tiny model's has 1024), so
prompts tokenize as on the H200 serving run.

`--curve on` (the default) runs the internal planes as `kvmesh serve` does (CURVE on every ZMQ
socket, keys from a fresh trust directory); `--curve off` runs them with
--insecure-internal-planes; `--curve both` runs the whole measurement both ways `--repeat` times,
alternating the order (off-on, on-off, ...) so that a change in the machine's load hits both
alike, prints the median of each measure both ways and the difference, and writes every run to
bench/results/control_plane_curve_<time>.json (the target: at most 5% fewer streamed
tokens/s and 0.2 ms more TTFT with CURVE).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.embedded_redis import EmbeddedRedis  # noqa: E402
from services.ports import free_port  # noqa: E402
from services.security import bundle  # noqa: E402
from stage_metrics import breakdown_lines, scrape, stage_means  # noqa: E402  (bench/, this script's directory)


class RawClient:
    """One keep-alive HTTP/1.1 connection that streams SSE and counts `data:` events."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def stream(self, body: bytes) -> tuple[float, list[float], int]:
        """POST a streaming completion; returns (ttft_s, chunk arrival times, content chunks)."""
        if self.writer is None:
            await self.connect()
        assert self.reader and self.writer
        t0 = time.perf_counter()
        self.writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        if b" 200 " not in head.split(b"\r\n", 1)[0]:
            raise RuntimeError(head.decode(errors="replace"))
        chunked = b"chunked" in head.lower()
        assert chunked, "expected a chunked SSE response"
        times: list[float] = []
        events, ttft = 0, 0.0
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
            data = await self.reader.readexactly(size + 2)
            if size == 0:
                break
            now = time.perf_counter()
            n = data.count(b"data: {")
            if n:
                if not ttft:
                    ttft = now - t0
                times.append(now)
                events += n
        return ttft, times, events

    async def close(self) -> None:
        if self.writer:
            self.writer.close()


def body(max_tokens: int, prompt: str = "hello world") -> bytes:
    return json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "temperature": 0}).encode()


def in_process_baseline(vocab: int) -> tuple[float, float]:
    """(TTFT s, per-token s) of the null engine called in-process: add_request + first step; one step."""
    from gpu_worker.service.null_engine import NullEngine
    from services.protocol.sampling import SamplingParams
    eng = NullEngine(vocab_size=vocab)
    firsts, steps = [], []
    for i in range(2000):
        t0 = time.perf_counter()
        eng.add_request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
        eng.step()
        t1 = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t1)
        firsts.append(t1 - t0)
    return statistics.median(firsts), statistics.median(steps)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def long_prompt(words: int, seed: int) -> str:
    """`words` random lowercase words (~1.3 tokens each with a BPE vocabulary): a serving
    benchmark's prompt size, e.g. the 512-token prompts of the c=1 serving target."""
    import random
    rng = random.Random(seed)
    return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
                    for _ in range(words))


def random_token_prompts(model: str, tokens: int, count: int, seed: int = 0) -> list[str]:
    """`count` texts of `tokens` tokens each, as `kvmesh bench serve --dataset-name random
    --tokenizer MODEL` builds them (random ordinary vocabulary ids, decoded, length-checked)."""
    import numpy as np
    from services.bench.tokens import TokenCounter
    counter, rng = TokenCounter(model), np.random.default_rng(seed)
    return [counter.random_text(tokens, rng) for _ in range(count)]


async def idle_ttft(port: int, n: int, prompt_of=None, stages=None) -> dict:
    """p50, p99 and mean TTFT of sequential one-token requests: "hello world", or prompt_of(i) for
    i in -20..n-1 (the negative ones warm up). With `stages` (a function scraping every service's
    histograms), also the mean first-token path over the measured requests ("stages")."""
    client = RawClient("127.0.0.1", port)

    def req(i: int) -> bytes:
        return body(1) if prompt_of is None else body(1, prompt_of(i))
    for i in range(20):                                  # warm-up
        await client.stream(req(-1 - i))
    before = stages() if stages else None
    ttfts = [(await client.stream(req(i)))[0] for i in range(n)]
    await client.close()
    out = {"p50": statistics.median(ttfts), "p99": pct(ttfts, 0.99), "mean": statistics.fmean(ttfts)}
    if stages:
        out["stages"] = stage_means(before, stages(), 1000 * out["mean"])
    return out


def wait_http(port: int, procs: list[subprocess.Popen], timeout_s: float = 120) -> None:
    import urllib.request
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):   # e.g. a free port taken by another process meanwhile
            raise SystemExit(f"a service exited while the gateway on port {port} was starting")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"gateway on port {port} did not become ready")


async def measure(port: int, args: argparse.Namespace, stages=None, token_prompts: list[str] | None = None) -> dict:
    out: dict = {}
    out["idle"] = await idle_ttft(port, args.idle_requests, stages=stages)
    if args.long_prompt_words:
        out["words"] = await idle_ttft(port, args.idle_requests,
                                       lambda i: long_prompt(args.long_prompt_words, i), stages)
    if token_prompts:
        out["tokens"] = await idle_ttft(port, args.idle_requests, lambda i: token_prompts[i + 20], stages)
    out["ttft_p50"], out["ttft_p99"] = out["idle"]["p50"], out["idle"]["p99"]
    if args.skip_throughput:
        return out
    client = RawClient("127.0.0.1", port)
    # the gateway writes every token already arrived in one chunk, so chunk gaps are not token
    # gaps: the per-token cost is measured as the lone stream's rate
    _, times, events = await client.stream(body(2000))
    out["lone_stream_tok_s"] = events / (times[-1] - times[0]) if len(times) > 1 else 0.0
    await client.close()

    async def worker(max_tokens: int, stop_at: float, counts: list[int]) -> None:
        c = RawClient("127.0.0.1", port)
        try:
            while time.perf_counter() < stop_at:
                _, _, events = await c.stream(body(max_tokens))
                counts[0] += 1
                counts[1] += events
        finally:
            await c.close()

    for name, conc, max_tokens in (("short", args.concurrency // 2, 4), ("long", args.concurrency, 256)):
        counts = [0, 0]
        t0 = time.perf_counter()
        stop_at = t0 + args.duration
        await asyncio.gather(*(worker(max_tokens, stop_at, counts) for _ in range(conc)))
        elapsed = time.perf_counter() - t0
        out[f"{name}_req_s"] = counts[0] / elapsed
        out[f"{name}_tok_s"] = counts[1] / elapsed
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model dir for the tokenizer (default: make a tiny one)")
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per throughput phase")
    ap.add_argument("--idle-requests", type=int, default=200)
    ap.add_argument("--long-prompt-words", type=int, default=400, help="TTFT at idle again with prompts of "
                    "this many random words; 0 skips it")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="TTFT at idle again with prompts of this "
                    "many tokens built like `kvmesh bench serve --dataset-name random` (the c=1 serving "
                    "target's 512); 0 skips it")
    ap.add_argument("--vocab-size", type=int, default=None, help="vocabulary size of the tiny model made "
                    "when --model is not given (128256: Llama-3.1-8B's, and the 8b model's tokenizer)")
    ap.add_argument("--skip-throughput", action="store_true", help="TTFT at idle only (no lone-stream and "
                    "throughput phases)")
    ap.add_argument("--curve", choices=("on", "off", "both"), default="on",
                    help="CURVE on the internal ZMQ planes (as `kvmesh serve` runs), off "
                         "(--insecure-internal-planes), or both: compared and saved under bench/results/")
    ap.add_argument("--repeat", type=int, default=2, help="with --curve both: runs each way, in alternating order")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="kvmesh-bench-")
    try:
        model = args.model
        if not model:
            model = str(Path(tmp.name) / "tiny")
            vocab_flag = ["--vocab-size", str(args.vocab_size)] if args.vocab_size else []
            subprocess.run([sys.executable, "-m", "services.cli", "make-model", "--arch", "llama", "--size", "tiny",
                            *vocab_flag, model], cwd=ROOT, check=True, capture_output=True)
        rounds = [[False, True] if i % 2 == 0 else [True, False] for i in range(max(args.repeat, 1))]
        modes = {"on": [True], "off": [False], "both": [m for r in rounds for m in r]}[args.curve]
        results: dict[str, list[dict]] = {"insecure": [], "curve": []}
        for curve in modes:
            try:
                res = run_stack(args, model, Path(tmp.name), curve)
            except SystemExit as exc:   # one more try: the ports are picked free, then bound later
                print(f"{exc}; starting the stack again", file=sys.stderr)
                res = run_stack(args, model, Path(tmp.name), curve)
            results["curve" if curve else "insecure"].append(res)
            print_rows(args, res, f"CURVE {'on' if curve else 'off'}")
    finally:
        tmp.cleanup()
    if args.curve == "both":
        save_comparison(args, results)
    return 0


def run_stack(args: argparse.Namespace, model: str, tmp: Path, curve: bool) -> dict:
    """Start the stack (CURVE on or off), measure it, stop it; the measurements."""
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    redis = EmbeddedRedis().start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    trust = bundle.generate(tmp / f"trust-{time.monotonic_ns()}").root if curve else None
    planes = ["--trust-dir", str(trust)] if trust else ["--insecure-internal-planes"]
    common = ["--redis-url", redis.url, "--log-level", "warning", "--host", "127.0.0.1", *planes]
    internal = ["--port", "0", "--zmq-port", "0", "--metrics-port", "0"]   # metrics: the stage histograms
    port, grpc_port = free_port(), free_port()
    cmds = [["tokenizer", *common, *internal, "--model", model],
            ["scheduler", *common, *internal],
            ["worker", *common, *internal, "--model", model, "--null-model", "--served-model-name", "bench",
             "--max-num-seqs", "512"],
            ["gateway", *common, "--port", str(port), "--zmq-port", "0", "--text-in-gateway", "--model", model],
            ["gateway", *common, "--port", str(grpc_port), "--zmq-port", "0"]]
    procs = [subprocess.Popen([sys.executable, "-m", "services.cli", *c], cwd=ROOT, env=env) for c in cmds]
    try:
        wait_http(port, procs)
        wait_http(grpc_port, procs)
        base_ttft, base_step = in_process_baseline(vocab)
        token_prompts = random_token_prompts(model, args.prompt_tokens, args.idle_requests + 20) \
            if args.prompt_tokens else None
        from services.registry import list_records
        recs = {kind: list_records(redis.url, kind, None) for kind in ("scheduler", "worker", "tokenizer")}

        def stages() -> dict:
            return scrape(f"http://127.0.0.1:{port}", lambda kind: recs[kind])
        res = asyncio.run(measure(port, args, stages, token_prompts))
        grpc = asyncio.run(idle_ttft(grpc_port, args.idle_requests))
        res["grpc_ttft_p50"], res["grpc_ttft_p99"] = grpc["p50"], grpc["p99"]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        redis.stop()
    res["base_ttft"], res["base_step"] = base_ttft, base_step
    return res


def print_rows(args: argparse.Namespace, res: dict, title: str) -> None:
    base_ttft, base_step = res["base_ttft"], res["base_step"]
    ms = 1000.0
    rows = [
        ("TTFT at idle p50 (stack)", f"{res['ttft_p50'] * ms:.3f} ms"),
        ("TTFT at idle p99 (stack)", f"{res['ttft_p99'] * ms:.3f} ms"),
        ("TTFT at idle p50/p99, Tokenize over gRPC", f"{res['grpc_ttft_p50'] * ms:.3f} / {res['grpc_ttft_p99'] * ms:.3f} ms"),
        *([(f"TTFT at idle p50/p99, {args.long_prompt_words}-word prompts",
            f"{res['words']['p50'] * ms:.3f} / {res['words']['p99'] * ms:.3f} ms")] if args.long_prompt_words else []),
        *([(f"TTFT at idle p50/p99, {args.prompt_tokens}-token prompts",
            f"{res['tokens']['p50'] * ms:.3f} / {res['tokens']['p99'] * ms:.3f} ms")] if args.prompt_tokens else []),
        ("TTFT in-process engine", f"{base_ttft * ms:.3f} ms"),
        ("added TTFT at idle (p50)", f"{(res['ttft_p50'] - base_ttft) * ms:.3f} ms   (target < 1 ms)"),
    ]
    if not args.skip_throughput:
        rows += [
            ("lone stream tokens/s", f"{res['lone_stream_tok_s']:.0f}"),
            ("lone stream time per token (1/rate)", f"{1 / max(res['lone_stream_tok_s'], 1e-9) * ms:.4f} ms"),
            ("in-process engine step", f"{base_step * ms:.4f} ms"),
            ("added per token", f"{(1 / max(res['lone_stream_tok_s'], 1e-9) - base_step) * ms:.4f} ms"),
            (f"short requests/s (c={args.concurrency // 2}, 4 tok)", f"{res['short_req_s']:.0f}"),
            (f"streamed tokens/s (c={args.concurrency}, 256 tok)", f"{res['long_tok_s']:.0f}   (target >= 20000)"),
            (f"long requests/s (c={args.concurrency})", f"{res['long_req_s']:.1f}"),
        ]
    width = max(len(r[0]) for r in rows)
    print(f"\nkvmesh control plane, {title} (null-model worker, {os.cpu_count()} CPUs)")
    print("-" * (width + 30))
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    phases = (("idle", '"hello world"'), ("words", f"{args.long_prompt_words}-word prompts"),
              ("tokens", f"{args.prompt_tokens}-token prompts"))
    for key, what in phases:
        if key in res:
            print(f"\nwhere the mean first token went, {what} (ms; bench/stage_metrics.py):")
            print("\n".join(breakdown_lines(res[key]["stages"], "  ")))


def save_comparison(args: argparse.Namespace, results: dict) -> None:
    """Print CURVE against no CURVE (medians over the runs) and write every run to
    bench/results/control_plane_curve_<time>.json."""
    off, on = (_median_of(results[mode]) for mode in ("insecure", "curve"))
    ms = 1000.0
    rows = [("TTFT at idle p50", off["ttft_p50"] * ms, on["ttft_p50"] * ms, "ms"),
            ("TTFT at idle p99", off["ttft_p99"] * ms, on["ttft_p99"] * ms, "ms"),
            ("TTFT at idle p50, Tokenize over gRPC", off["grpc_ttft_p50"] * ms, on["grpc_ttft_p50"] * ms, "ms")]
    if not args.skip_throughput:
        rows += [("lone stream tokens/s", off["lone_stream_tok_s"], on["lone_stream_tok_s"], ""),
                 (f"streamed tokens/s (c={args.concurrency}, 256 tok)", off["long_tok_s"], on["long_tok_s"], ""),
                 (f"short requests/s (c={args.concurrency // 2})", off["short_req_s"], on["short_req_s"], "")]
    print(f"\nCURVE vs --insecure-internal-planes, medians of {len(results['curve'])} runs each "
          f"({os.cpu_count()} CPUs; target: <= 5% fewer streamed tokens/s, <= 0.2 ms added TTFT)")
    width = max(len(r[0]) for r in rows)
    print(f"{'':<{width}}  {'off':>10}  {'on':>10}  {'change':>14}")
    for name, a, b, unit in rows:
        change = f"{b - a:+.3f} {unit}" if unit else f"{100 * (b - a) / max(a, 1e-9):+.1f}%"
        print(f"{name:<{width}}  {a:>10.3f}  {b:>10.3f}  {change:>14}" if unit else
              f"{name:<{width}}  {a:>10.0f}  {b:>10.0f}  {change:>14}")
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    out = ROOT / "bench" / "results" / f"control_plane_curve_{stamp}.json"
    out.write_text(json.dumps({"command": " ".join(["python", "bench/control_plane.py", *sys.argv[1:]]),
                               "cpus": os.cpu_count(), "load_average": os.getloadavg(),
                               "median": {"insecure": off, "curve": on},
                               "runs": {mode: [_jsonable(r) for r in runs] for mode, runs in results.items()}},
                              indent=2) + "\n")
    print(f"\nwrote {out.relative_to(ROOT)}")


def _median_of(runs: list[dict]) -> dict:
    """Each scalar measure's median over runs of one mode."""
    return {k: statistics.median(r[k] for r in runs) for k, v in runs[0].items() if isinstance(v, (int, float))}


def _jsonable(res: dict) -> dict:
    """The scalar measurements (the stage breakdowns stay in the printed report)."""
    out = {k: v for k, v in res.items() if isinstance(v, (int, float))}
    for phase in ("idle", "words", "tokens"):
        if phase in res:
            out[phase] = {k: v for k, v in res[phase].items() if isinstance(v, (int, float))}
    return out


if __name__ == "__main__":
    sys.exit(main())
