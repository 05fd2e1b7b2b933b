"""Serving benchmark of the whole stack: `kvmesh serve` driven by `kvmesh bench serve` (issues #4, #6).

One device call (H200, at most ~540 s) measures, on a random-weight Llama-3.1-8B
(`kvmesh make-model --arch llama --size 8b`, bf16, made once into --model-dir and reused):

  single   one worker on the GPU (`kvmesh serve --device cuda`), vLLM's serving configurations:
             c1   concurrency 1, 512 in / 128 out (ignore_eos): median TTFT, median TPOT
                  (targets <= 20 ms / <= 4.3 ms; vLLM 23.4 ms / 4.80 ms)
             c64  concurrency 64, 1024 in / 128 out: total tok/s, mean TTFT, TPOT, p99 ITL
                  (targets >= 35k tok/s, p99 ITL <= 50 ms; vLLM 30.6k tok/s, p99 ITL 189 ms)
             ph   prefill-heavy, concurrency 64, 4096 in / 256 out (only when --single-runs names it):
                  the same metrics as c64; beside pd's it shows whether decode steps still wait
                  behind prefills
           after an unmeasured warm-up run on other random prompts (64 x 1024 in / 16 out).
  vllm     vLLM 0.26.0's own OpenAI server (bench/vllm_server.py: `--load-format dummy` on the same
           model directory, vLLM's serving defaults) on the same GPU, driven by the same client
           with the same warm-up, c1 and c64 runs (same prompts); the table gives each metric
           beside kvmesh's and the ratio. vLLM must be installed in --vllm-site first
           (../shared/peer-vllm/; `pip install --target /tmp/vsite`).
  pd       one prefill and one decode worker sharing the GPU (`kvmesh serve --workers 0
           --prefill-workers 1 --decode-workers 1`, each at --routing-gpu-mem), the same warm-up, c1
           and c64 runs as single; the table sets each figure beside single's (one mixed worker).
  routing  two workers sharing the one GPU (`kvmesh serve --workers 2 --device cuda`, each with
           KVMESH_GPU_MEMORY_UTILIZATION=--routing-gpu-mem) plus the prefix-cache index, the same
           generated-shared-prefix workload (32 groups x 8 questions, 2048-token system prompt,
           128-token question, 128 out, Poisson 8 req/s, at most 64 in flight) once per
           --routing-modes (cache_aware, round_robin: KVMESH_ROUTING for the scheduler), each on a
           fresh stack: TTFT mean/median/p99, req/s, total tok/s, prefix-cache hit rate (the
           usage's cached_tokens / prompt tokens) and how the requests and hits split per worker
           (the workers' engine counters in the Redis registry).
  migration what a mid-decode move costs a client (issue #36): two workers sharing the GPU (each
           at --routing-gpu-mem, KVMESH_DRAIN_GRACE_S=0), one streamed request at a time with a
           --migration-contexts prompt (2k, then 8k random token ids, 1024 out, ignore_eos); once
           it streams, the worker running it (its registry load) gets SIGTERM: it drains, hands the
           request back, and the other worker continues it from the tokens streamed. The client's
           gap across the move (the last chunk before it to the first after: of the gaps after the
           signal, the one the detokenizer's stall, kvmesh_detok_migration_stall_seconds on the
           gateway's /metrics, matches) less the median inter-chunk time before it, that stall,
           and the new run's cached prompt tokens (usage), on a
           fresh stack per --migration-modes: `peer` (the default stack: the draining worker sends
           the request's KV, prompt and output so far, to the other worker through the hand-off,
           shm ring on one host, and it decodes on, when that is predicted faster than a recompute:
           gpu_worker/service/move_cost.py; else the other worker recomputes it), `peer_ipc` (the
           same with --kv-transport cuda_ipc: the other worker reads the blocks out of the draining
           worker's cache, device to device), `shared` (KVMESH_DRAIN_KV_TO_PEERS=0 and
           --kv-offload-shared-dir: the draining worker writes its cached blocks there, the new
           one loads the prompt's from there) and `recompute` (neither: the new worker prefills it
           again). Between contexts it waits for
           `kvmesh serve` to restart the drained worker (its start time is recorded).

Around every measured run (c1, c64, each routing run) it scrapes the gateway's /metrics (its HTTP
port) and every scheduler's, worker's and tokenizer's (the `metrics` address in its registry
record) and reports, next to the client's mean TTFT, the mean of each histogram over the run
(difference of _sum / difference of _count; bench/stage_metrics.py): the gateway's TTFT, the
workers' TTFT and its split into queue (Dispatch received -> first scheduled) + prefill (-> first
token), decode (first -> last token) and the engine step; and the first token's path stage by
stage (services/metrics.py draws them): gateway submit (arrival -> Submit sent; tokenize inside
it), upstream (Submit sent -> first text delta read) = scheduler dispatch + worker TTFT + worker
send + detokenizer + the hops between (`hops_ms`, the remainder), the first chunk's write, the
worker's admit (socket -> engine) and how long the first token's step waited for the GPU.

Every stack gets its own embedded Redis (so this script can read the registry), waits until all
workers (and the prefix-cache index, where kvmesh serve starts one) are registered, and is stopped between parts: SIGTERM to
`kvmesh serve` (it stops its services), SIGKILL to whatever of its process group is left, also
on errors and on SIGTERM/Ctrl-C to this script. Prompts are text built with the model's tokenizer
(`--tokenizer`: exact lengths as the server counts them, its BOS among them: 512 in is 512 prompt tokens).

Usage (repository root; services run as `python3 -m services.cli ...`, no `kvmesh` script needed):

    python3 bench/serve_bench.py                          # both sections, --time-budget 520
    python3 bench/serve_bench.py --sections single        # or routing; split across device calls
    python3 bench/serve_bench.py --sections routing --routing-modes round_robin
    python3 bench/serve_bench.py --sections migration --time-budget 570   # or --migration-modes shared
    python3 bench/serve_bench.py --sections single,vllm --time-budget 560   # kvmesh, then vLLM's server
    KVMESH_ASYNC_SCHEDULING=1 python3 bench/serve_bench.py --sections single   # KVMESH_* pass through
    python3 bench/serve_bench.py --env KVMESH_MAX_NUM_BATCHED_TOKENS=4096      # same, per flag
    python3 bench/serve_bench.py --smoke                  # CPU, tiny model, tiny lengths: checks this script

Outputs: progress lines with timestamps on stdout, a table last; $OUT/serve_bench.json (OUT
defaults to ./out), rewritten after every part so a timeout keeps what ran; every stack's and
client's output in one file, $OUT/serve_bench.log. Nothing else is written to $OUT.
--time-budget (seconds from start) makes later parts skip rather than overrun the call.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # run from anywhere in the repo

from services.ports import free_port  # noqa: E402  (the gateway's port, bound later by the stack)
from stage_metrics import breakdown_lines, counter, histograms, scrape, stage_means  # noqa: E402  (bench/: this directory)
from process_group import die_with_parent, group_members, kill_group, stop_group  # noqa: E402
from vllm_server import VllmServer, http_ok  # noqa: E402

T0 = time.time()
RESULTS: dict = {"sections": {}, "errors": {}, "skipped": {}, "env": {}}
DEADLINE = float("inf")
OUT = Path(".")
LOG: "CombinedLog | None" = None
STARTS: dict[int, float] = {}   # workers -> measured seconds to start a stack (for the budget checks)

# (model config.json fields that identify a size) for the model-dir reuse check
MODEL_SHAPES = {"8b": {"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 128256},
                "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "vocab_size": 128256},
                "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 1024}}
SUMMARY_KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
                "max_concurrent_requests", "cached_token_ratio", "failure_reasons",
                "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
                "mean_tpot_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms",
                "mean_itl_ms", "median_itl_ms", "p90_itl_ms", "p99_itl_ms",
                "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms")
TARGETS = {  # (key, comparison, target, vLLM's number) per single-GPU run
    "c1": [("median_ttft_ms", "<=", 20.0, 23.4), ("median_tpot_ms", "<=", 4.3, 4.80)],
    "c64": [("total_token_throughput", ">=", 35000.0, 30600.0), ("p99_itl_ms", "<=", 50.0, 189.0)],
}


@dataclass(frozen=True)
class Scale:
    """Every size of the run; --smoke swaps in the CPU one."""

    model_size: str = "8b"
    device: str = "cuda"
    num_gpu_blocks: int = 0             # 0: the engine profiles the GPU
    c1_in: int = 512
    c1_out: int = 128
    c1_prompts: int = 48                # ~0.6 s each at the target TPOT: ~30 s
    c64_in: int = 1024
    c64_out: int = 128
    c64_prompts: int = 640              # 10 waves of 64: ~21 s at 35k tok/s, ~37 s at 20k
    c64_conc: int = 64
    ph_in: int = 4096
    ph_out: int = 256
    ph_prompts: int = 256               # ~1M prompt tokens: ~28 s of prefill at 38k tok/s, 4 waves of decode
    warm_in: int = 1024
    warm_out: int = 16
    warm_prompts: int = 64
    gsp_groups: int = 32
    gsp_per_group: int = 8
    gsp_system: int = 2048
    gsp_question: int = 128
    gsp_out: int = 128
    gsp_rate: str = "8"                 # requests/s (Poisson); 256 requests: ~32 s of arrivals
    gsp_conc: int = 64
    routing_warm_prompts: int = 32      # random 256-in / 16-out prompts spread over both workers
    mig_contexts: str = "2048,8192"     # prompt tokens of the migration runs
    mig_out: int = 1024                 # tokens each run asks for: ~6 s of decode, the move mid-way
    mig_drain_after: int = 64           # tokens streamed before the drain
    mig_shared_gb: float = 8.0          # the shared tier's bound (two 8k prompts: ~2 GiB of KV)
    # seconds, for the time-budget checks (replaced by measured start times once known)
    est_make_model: float = 150.0
    est_start_1: float = 150.0
    est_start_2: float = 200.0
    est_warmup: float = 20.0
    est_c1: float = 45.0
    est_c64: float = 50.0
    est_ph: float = 80.0
    est_routing_run: float = 50.0
    est_mig_run: float = 20.0           # one migration run: prefill, the move, the decode left
    est_worker_restart: float = 90.0    # kvmesh serve restarting the drained worker (model load)
    est_stop: float = 25.0
    request_timeout: float = 300.0


SMOKE_SCALE = Scale(model_size="tiny", device="cpu", num_gpu_blocks=1024,
                    c1_in=32, c1_out=8, c1_prompts=4, c64_in=64, c64_out=8, c64_prompts=12, c64_conc=4,
                    ph_in=128, ph_out=8, ph_prompts=8,
                    warm_in=16, warm_out=4, warm_prompts=2,
                    gsp_groups=3, gsp_per_group=4, gsp_system=64, gsp_question=8, gsp_out=8, gsp_rate="inf",
                    gsp_conc=4, routing_warm_prompts=2, mig_contexts="128,256", mig_out=384, mig_drain_after=8,
                    mig_shared_gb=0.25,
                    est_make_model=20, est_start_1=12, est_start_2=15, est_warmup=3, est_c1=4, est_c64=5, est_ph=5,
                    est_routing_run=5, est_mig_run=5, est_worker_restart=15, est_stop=5, request_timeout=60.0)


# ----------------------------------------------------------------------------- small helpers
def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.time() - T0:6.1f}s] {msg}", flush=True)


def remaining() -> float:
    return DEADLINE - time.time()


def save() -> None:
    RESULTS["elapsed_s"] = round(time.time() - T0, 1)
    (OUT / "serve_bench.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def est_start(sc: Scale, workers: int) -> float:
    """Seconds a stack of `workers` workers will take to start: measured ones once known."""
    if workers in STARTS:
        return STARTS[workers] * 1.15 + 5.0
    if workers == 2 and 1 in STARTS:
        return STARTS[1] * 1.6 + 10.0
    return sc.est_start_1 if workers == 1 else sc.est_start_2


def record_error(part: str, exc: BaseException) -> None:
    RESULTS["errors"][part] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]
    say(f"ERROR in {part}: {type(exc).__name__}: {exc}")
    save()


def skip(part: str, why: str) -> None:
    RESULTS["skipped"][part] = why
    say(f"skip {part}: {why}")
    save()


class CombinedLog:
    """$OUT/serve_bench.log: every child's output plus headers saying what runs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fh = open(path, "ab", buffering=0)

    def header(self, text: str) -> None:
        self.fh.write(f"\n===== [+{time.time() - T0:.1f}s] {text}\n".encode())

    def write(self, text: str) -> None:
        self.fh.write(text.encode(errors="replace"))


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra)
    return env


# ----------------------------------------------------------------------------- the model
def _safetensors_complete(path: Path) -> bool:
    """The file is as long as its header says (a write cut short is not reused)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return size == 8 + n + end
    except (OSError, ValueError, KeyError, struct.error):
        return False


def model_ready(model_dir: Path, size: str) -> bool:
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if any(cfg.get(k) != v for k, v in MODEL_SHAPES[size].items()):
        return False
    if not (model_dir / "tokenizer.json").is_file():
        return False
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError):
            return False
        return all(_safetensors_complete(model_dir / f) for f in files)
    return _safetensors_complete(model_dir / "model.safetensors")


def ensure_model(model_dir: Path, size: str, est_s: float) -> None:
    if model_ready(model_dir, size):
        say(f"model: reusing llama-{size} in {model_dir}")
        RESULTS["env"]["model_made_s"] = 0.0
        return
    if remaining() < est_s:
        raise TimeoutError(f"no time left to make the {size} model ({remaining():.0f} s left, ~{est_s:.0f} s needed)")
    say(f"model: making a random-weight llama-{size} in {model_dir} (kvmesh make-model)")
    LOG.header(f"make-model --arch llama --size {size} {model_dir}")
    t = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "make-model", "--arch", "llama", "--size", size,
                             str(model_dir)], cwd=ROOT, env=child_env({}), stdout=LOG.fh, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=die_with_parent)
    try:
        rc = proc.wait(timeout=max(remaining(), 1.0))
    except subprocess.TimeoutExpired:
        kill_group(proc.pid, say=say)
        proc.wait()
        raise TimeoutError("make-model ran past the time budget")
    finally:
        kill_group(proc.pid, say=say)
    if rc != 0 or not model_ready(model_dir, size):
        raise RuntimeError(f"make-model failed (exit {rc}); see serve_bench.log")
    RESULTS["env"]["model_made_s"] = round(time.time() - t, 1)
    say(f"model: made in {time.time() - t:.0f} s")


# ----------------------------------------------------------------------------- the stack
class StackError(RuntimeError):
    pass


class ServeStack:
    """`python3 -m services.cli serve` in its own process group, with its own embedded Redis."""

    def __init__(self, name: str, model: Path, workers: int, sc: Scale, env: dict[str, str],
                 log_level: str, extra_flags: list[str], prefill_decode: tuple[int, int] = (0, 0)) -> None:
        """workers mixed workers, plus prefill_decode = (P, D) disaggregated ones."""
        self.name, self.model, self.workers, self.sc = name, model, workers, sc
        self.env, self.log_level, self.extra_flags = env, log_level, extra_flags
        self.prefill_decode = prefill_decode
        self.total_workers = workers + sum(prefill_decode)
        # kvmesh serve starts the prefix-cache index only where its scheduler asks it
        self.expect_prefix = self.total_workers > 1 and env.get("KVMESH_ROUTING", "cache_aware") == "cache_aware"
        self.proc: subprocess.Popen | None = None
        self.redis = None
        self.url = ""

    def command(self, port: int, ready_timeout: float) -> list[str]:
        cmd = [sys.executable, "-m", "services.cli", "serve", "--model", str(self.model), "--port", str(port),
               "--workers", str(self.workers), "--device", self.sc.device,
               "--ready-timeout-s", f"{ready_timeout:.0f}", "--log-level", self.log_level]
        if self.sc.num_gpu_blocks:
            cmd += ["--num-gpu-blocks", str(self.sc.num_gpu_blocks)]
        if any(self.prefill_decode):
            cmd += ["--prefill-workers", str(self.prefill_decode[0]), "--decode-workers", str(self.prefill_decode[1])]
        return cmd + self.extra_flags

    def start(self, timeout_s: float) -> float:
        from services.embedded_redis import EmbeddedRedis

        t = time.time()
        self.redis = EmbeddedRedis(password=secrets.token_urlsafe(16)).start()   # its URL carries it
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = self.command(port, timeout_s)
        shown = " ".join(cmd[1:]) + "".join(f"  [{k}={v}]" for k, v in sorted(self.env.items()))
        LOG.header(f"stack {self.name}: {shown}")
        say(f"stack {self.name}: starting {self.total_workers} worker(s) on {self.sc.device} ({shown})")
        # the Redis URL (with its password) through the environment: a command line is world-readable
        env = child_env({**self.env, "KVMESH_REDIS_URL": self.redis.client_url})
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=LOG.fh, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=die_with_parent)
        deadline = time.time() + timeout_s
        ready = False
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise StackError(f"kvmesh serve exited with code {self.proc.returncode} during start-up "
                                 f"(see serve_bench.log)")
            if not ready:
                ready = self._http_ok("/ready")
            if ready:
                workers = self.records("worker")
                prefix = self.records("prefix-cache") if self.expect_prefix else [None]
                if len(workers) >= self.total_workers and prefix:
                    time.sleep(1.5)     # the scheduler and the prefix index poll the registry
                    took = time.time() - t
                    say(f"stack {self.name}: ready in {took:.1f} s ({len(workers)} worker(s)"
                        f"{', prefix-cache index' if self.expect_prefix else ''})")
                    return took
            time.sleep(0.5)
        raise StackError(f"stack not ready within {timeout_s:.0f} s (gateway ready: {ready})")

    def _http_ok(self, path: str) -> bool:
        return http_ok(self.url + path)

    def page(self, path: str) -> str:
        """GET the gateway's path (e.g. /metrics); raises unless it answers 200."""
        import urllib.request
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return r.read().decode(errors="replace")

    def records(self, kind: str) -> list:
        from services.registry import list_records
        try:
            return list_records(self.redis.client_url, kind, None)
        except Exception:
            return []

    def worker_loads(self) -> dict[str, dict]:
        return {r.id: dict(r.load) for r in self.records("worker")}

    def scrape(self) -> dict[str, dict[str, tuple[float, float]]]:
        """{"gateway" | "scheduler" | "worker" | "tokenizer": {histogram: (count, sum)}}, each kind's
        processes summed (stage_metrics.scrape). Raises when an endpoint does not answer or a worker
        registered no metrics address."""
        try:
            return scrape(self.url, self.records)
        except RuntimeError as exc:
            raise StackError(str(exc)) from None

    def stop(self) -> None:
        if self.proc is not None:
            t = time.time()
            stop_group(self.proc, 60, f"stack {self.name}: kvmesh serve", say)
            LOG.header(f"stack {self.name}: stopped (exit {self.proc.returncode})")
            say(f"stack {self.name}: stopped in {time.time() - t:.1f} s (exit {self.proc.returncode})")
            self.proc = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


# ----------------------------------------------------------------------------- the client
def measured_run(stack: ServeStack, label: str, args: list[str], sc: Scale, client_args: list[str],
                 timeout_s: float) -> dict:
    """bench_client plus the servers' stage histograms over the run (summary["stages"]); a failed
    scrape is recorded there as stages_error and does not fail the run."""
    try:
        before = stack.scrape()
    except Exception as exc:
        before, why = None, f"{type(exc).__name__}: {exc}"
    summary = bench_client(stack, label, args, sc, client_args, timeout_s)
    if before is not None:
        try:
            summary["stages"] = st = stage_means(before, stack.scrape(), summary.get("mean_ttft_ms"))
            say(f"client {label}: mean ms TTFT client {_f(st['client_ttft_ms'])}, gateway "
                f"{_f(st['gateway_ttft_ms'])}, worker {_f(st['worker_ttft_ms'])} (queue "
                f"{_f(st['worker_queue_ms'])} + prefill {_f(st['worker_prefill_ms'])}); decode "
                f"{_f(st['worker_decode_ms'])}, step {_f(st['engine_step_ms'], '{:.2f}')}")
            for line in breakdown_lines(st):
                say(f"client {label}: {line}")
            return summary
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
    summary["stages_error"] = why
    say(f"client {label}: no stage metrics ({why})")
    return summary


def bench_client(stack: ServeStack, label: str, args: list[str], sc: Scale, client_args: list[str],
                 timeout_s: float) -> dict:
    """One `kvmesh bench serve` run against the stack; its summary numbers (vLLM's key names).
    The client's own vLLM-style table goes to the combined log only (stdout stays short)."""
    if stack.proc is None or stack.proc.poll() is not None:
        raise StackError(f"stack {stack.name} is not running (exit {stack.proc and stack.proc.returncode}); "
                         "see serve_bench.log")
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-serve-bench-"))
    cmd = [sys.executable, "-m", "services.cli", "bench", "serve", "--base-url", stack.url,
           "--tokenizer", str(stack.model), "--save-result", "--result-dir", str(tmp),
           "--result-filename", "result.json", "--no-plots", "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--request-timeout", f"{sc.request_timeout:.0f}", "--label", label, *args, *client_args]
    LOG.header(f"client {label}: {' '.join(cmd[1:])}")
    say(f"client {label}: {' '.join(args)}")
    t = time.time()
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env({}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent, text=True, errors="replace")
        try:
            out, _ = proc.communicate(timeout=max(timeout_s, 5.0))
        except subprocess.TimeoutExpired:
            kill_group(proc.pid, say=say)
            out, _ = proc.communicate()
            LOG.write(out or "")
            raise TimeoutError(f"client {label} ran past {timeout_s:.0f} s (time budget)") from None
        finally:
            kill_group(proc.pid, 5.0, say)
        LOG.write(out)
        if proc.returncode != 0:
            raise RuntimeError(f"client {label} exited with {proc.returncode}: {out.strip()[-1500:]}")
        data = json.loads((tmp / "result.json").read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {k: data[k] for k in SUMMARY_KEYS if k in data}
    summary["wall_s"] = round(time.time() - t, 1)
    summary["client_args"] = args
    say(f"client {label}: {summary.get('completed')} ok, {summary.get('failed')} failed in "
        f"{summary.get('duration', 0):.1f} s; {summary.get('total_token_throughput', 0):.0f} tok/s, "
        f"TTFT mean/median/p99 {summary.get('mean_ttft_ms', 0):.1f}/{summary.get('median_ttft_ms', 0):.1f}/"
        f"{summary.get('p99_ttft_ms', 0):.1f} ms, TPOT median {summary.get('median_tpot_ms', 0):.2f} ms, "
        f"ITL p99 {summary.get('p99_itl_ms', 0):.1f} ms, cached {100 * (summary.get('cached_token_ratio') or 0):.1f}%")
    if summary.get("failed"):
        say(f"client {label}: failures {summary.get('failure_reasons')}")
    return summary


def random_args(n_in: int, n_out: int, prompts: int, conc: int, seed: int) -> list[str]:
    return ["--dataset-name", "random", "--random-input-len", str(n_in), "--random-output-len", str(n_out),
            "--num-prompts", str(prompts), "--max-concurrency", str(conc), "--request-rate", "inf",
            "--ignore-eos", "--seed", str(seed)]


def worker_delta(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """Per worker: what its engine counters (registry load record) gained during a run."""
    out = {}
    for wid, load in sorted(after.items()):
        prev = before.get(wid, {})
        d = {k: int(load.get(k, 0)) - int(prev.get(k, 0))
             for k in ("requests_total", "tokens_out", "prefix_query_tokens", "prefix_hit_tokens")}
        d["prefix_hit_ratio"] = round(d["prefix_hit_tokens"] / d["prefix_query_tokens"], 4) \
            if d["prefix_query_tokens"] > 0 else None
        d["total_blocks"] = int(load.get("total_blocks", 0))
        out[wid] = d
    return out


# ----------------------------------------------------------------------------- sections
def section_single(args, sc: Scale) -> None:
    res = RESULTS["sections"].setdefault("single", {})
    est = est_start(sc, 1) + sc.est_warmup + sc.est_c1 + sc.est_stop
    if remaining() < est:
        return skip("single", f"{remaining():.0f} s left, ~{est:.0f} s needed")
    env = dict(args.env)
    if args.single_gpu_mem:
        env["KVMESH_GPU_MEMORY_UTILIZATION"] = str(args.single_gpu_mem)
    stack = ServeStack("single", args.model_dir, 1, sc, env, args.log_level, args.serve_flag)
    res["stack"] = {"workers": 1, "device": sc.device, "env": env, "serve_flags": args.serve_flag}
    try:
        res["stack_start_s"] = STARTS[1] = round(stack.start(min(remaining() - sc.est_stop, args.ready_timeout)), 1)
        save()

        def measure(key: str, label: str, cargs: list[str], budget_s: float) -> dict:
            run = measured_run(stack, label, cargs, sc, args.client_arg, budget_s)
            if not args.smoke and key in TARGETS:
                run["targets"] = [{"metric": m, "op": op, "target": tgt, "vllm": v, "value": run.get(m),
                                   "met": _met(run.get(m), op, tgt)} for m, op, tgt, v in TARGETS[key]]
            return run
        warmup_and_runs(stack, "single", res, args, sc, measure)
    finally:
        stack.stop()
        save()


def section_pd(args, sc: Scale) -> None:
    """One prefill and one decode worker sharing the GPU (each KVMESH_GPU_MEMORY_UTILIZATION=
    --routing-gpu-mem), the same warm-up and runs as `single`: what disaggregation costs or gains
    on one GPU against one mixed worker (the table sets each figure beside single's)."""
    res = RESULTS["sections"].setdefault("pd", {})
    est = est_start(sc, 2) + sc.est_warmup + sc.est_c1 + sc.est_stop
    if remaining() < est:
        return skip("pd", f"{remaining():.0f} s left, ~{est:.0f} s needed")
    env = two_worker_env(args, {})
    stack = ServeStack("pd", args.model_dir, 0, sc, env, args.log_level, args.serve_flag, prefill_decode=(1, 1))
    res["stack"] = {"prefill_workers": 1, "decode_workers": 1, "device": sc.device, "env": env,
                    "serve_flags": args.serve_flag}
    try:
        res["stack_start_s"] = STARTS[2] = round(stack.start(min(remaining() - sc.est_stop, args.ready_timeout)), 1)
        save()
        warmup_and_runs(stack, "pd", res, args, sc,
                        lambda _key, label, cargs, budget_s: measured_run(stack, label, cargs, sc, args.client_arg,
                                                                          budget_s))
    finally:
        stack.stop()
        save()


def two_worker_env(args, extra: dict[str, str]) -> dict[str, str]:
    """The environment of a two-worker stack (pd, routing, migration): --env, `extra`, and each
    worker's share of the GPU (--routing-gpu-mem; 0 leaves the stack's default)."""
    env = {**args.env, **extra}
    if args.routing_gpu_mem:
        env["KVMESH_GPU_MEMORY_UTILIZATION"] = str(args.routing_gpu_mem)
    return env


def single_runs(args, sc: Scale) -> list[tuple[str, float, list[str]]]:
    """(key, estimated seconds, client arguments) of the runs both `single` and `vllm` make."""
    # distinct seeds: same-seed random prompts of two lengths would share a prefix (cache hits)
    runs = (("c1", sc.est_c1, random_args(sc.c1_in, sc.c1_out, args.c1_prompts or sc.c1_prompts, 1, 1)),
            ("c64", sc.est_c64, random_args(sc.c64_in, sc.c64_out, args.c64_prompts or sc.c64_prompts,
                                            sc.c64_conc, 2)),
            ("ph", sc.est_ph, random_args(sc.ph_in, sc.ph_out, args.ph_prompts or sc.ph_prompts, sc.c64_conc, 3)))
    return [r for r in runs if r[0] in args.single_runs]


def warmup_and_runs(stack, part: str, res: dict, args, sc: Scale, measure) -> None:
    """The unmeasured warm-up, then each run of single_runs that fits the time left, into res;
    measure(key, label, client args, seconds left) -> the run's summary."""
    budget = lambda: remaining() - sc.est_stop  # noqa: E731
    try:
        res["warmup"] = bench_client(stack, f"{part}-warmup",
                                     random_args(sc.warm_in, sc.warm_out, sc.warm_prompts, sc.warm_prompts, 1000),
                                     sc, args.client_arg, budget())
    except Exception as exc:
        record_error(f"{part}/warmup", exc)
    save()
    for key, est_s, cargs in single_runs(args, sc):
        if budget() < est_s:
            skip(f"{part}/{key}", f"{remaining():.0f} s left, ~{est_s + sc.est_stop:.0f} s needed")
            continue
        try:
            res[key] = measure(key, f"{part}-{key}", cargs, budget())
        except Exception as exc:
            record_error(f"{part}/{key}", exc)
        save()


def section_vllm(args, sc: Scale) -> None:
    """vLLM's own server on the same model directory and GPU, driven by the same client runs as
    `single` (same prompts: same dataset, seeds and lengths), after the same warm-up."""
    res = RESULTS["sections"].setdefault("vllm", {})
    runs = single_runs(args, sc)
    est = args.vllm_start_estimate + sc.est_warmup + (runs[0][1] if runs else 0.0) + sc.est_stop  # one run at least
    if remaining() < est:
        return skip("vllm", f"{remaining():.0f} s left, ~{est:.0f} s needed")
    server = VllmServer(args.model_dir, args.vllm_site, args.vllm_max_model_len, args.vllm_gpu_mem, LOG, say,
                        args.vllm_flag)
    res["server"] = {"command": server.command(0)[1:], "site": str(args.vllm_site)}
    try:
        res["start_s"] = round(server.start(min(remaining() - sc.est_stop, args.ready_timeout)), 1)
        save()
        warmup_and_runs(server, "vllm", res, args, sc,
                        lambda _key, label, cargs, budget_s: bench_client(server, label, cargs, sc, args.client_arg,
                                                                          budget_s))
    finally:
        server.stop()
        save()


def _met(value, op: str, target: float) -> bool | None:
    if value is None:
        return None
    return value <= target if op == "<=" else value >= target


def section_routing(args, sc: Scale) -> None:
    res = RESULTS["sections"].setdefault("routing", {})
    gsp = ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(args.gsp_groups or sc.gsp_groups),
           "--gsp-prompts-per-group", str(args.gsp_per_group or sc.gsp_per_group),
           "--gsp-system-prompt-len", str(sc.gsp_system), "--gsp-question-len", str(sc.gsp_question),
           "--gsp-output-len", str(sc.gsp_out), "--request-rate", args.gsp_rate or sc.gsp_rate,
           "--max-concurrency", str(sc.gsp_conc), "--ignore-eos", "--seed", "0"]
    res["workload"] = gsp
    for mode in args.routing_modes:
        part = f"routing/{mode}"
        est = est_start(sc, 2) + sc.est_routing_run + sc.est_stop
        if remaining() < est:
            skip(part, f"{remaining():.0f} s left, ~{est:.0f} s needed")
            continue
        env = two_worker_env(args, {"KVMESH_ROUTING": mode})
        stack = ServeStack(f"routing-{mode}", args.model_dir, 2, sc, env, args.log_level, args.serve_flag)
        r = res.setdefault(mode, {"stack": {"workers": 2, "device": sc.device, "env": env,
                                            "serve_flags": args.serve_flag}})
        try:
            r["stack_start_s"] = STARTS[2] = round(stack.start(min(remaining() - sc.est_stop, args.ready_timeout)), 1)
            save()
            budget = lambda: remaining() - sc.est_stop  # noqa: E731
            if sc.routing_warm_prompts:
                try:
                    conc = sc.routing_warm_prompts
                    r["warmup"] = bench_client(stack, f"{mode}-warmup",
                                               random_args(256 if not args.smoke else 16, 16 if not args.smoke else 4,
                                                           conc, conc, 1000), sc, args.client_arg, budget())
                except Exception as exc:
                    record_error(f"{part}/warmup", exc)
            time.sleep(1.2)     # let the workers' load records catch up (heartbeat)
            before = stack.worker_loads()
            try:
                r["run"] = measured_run(stack, f"{mode}", gsp, sc, args.client_arg, budget())
            except Exception as exc:
                record_error(part, exc)
            time.sleep(1.2)
            r["workers"] = worker_delta(before, stack.worker_loads())
            say(f"{part}: per worker {json.dumps(r['workers'])}")
        except Exception as exc:
            record_error(part, exc)
        finally:
            stack.stop()
            save()


# ----------------------------------------------------------------------------- migration
MIG_MODES = ("peer", "shared", "recompute", "peer_ipc")   # (the index seeds the prompts: new ones last)
# the gateway's detokenizer (kvmesh serve's default: text in the gateway) times each moved stream
MIG_STALL = "kvmesh_detok_migration_stall_seconds"


def section_migration(args, sc: Scale) -> None:
    """One fresh two-worker stack per --migration-modes; in each, one run per context (module docstring)."""
    res = RESULTS["sections"].setdefault("migration", {})
    contexts = [int(c) for c in (args.migration_contexts or sc.mig_contexts).split(",") if c.strip()]
    vocab = MODEL_SHAPES[sc.model_size]["vocab_size"]
    for mode in args.migration_modes:
        part = f"migration/{mode}"
        est = est_start(sc, 2) + sc.est_mig_run + sc.est_stop
        if remaining() < est:
            skip(part, f"{remaining():.0f} s left, ~{est:.0f} s needed")
            continue
        env = two_worker_env(args, {"KVMESH_DRAIN_GRACE_S": "0"})   # the move at once, mid-decode
        if not mode.startswith("peer"):                   # the KV from a tier, or none
            env["KVMESH_DRAIN_KV_TO_PEERS"] = "0"
        shared = Path(tempfile.mkdtemp(prefix="kvmesh-mig-shared-")) if mode == "shared" else None
        flags = list(args.serve_flag) + (["--kv-offload-shared-dir", str(shared / "tier"),
                                          "--kv-offload-shared-gb", str(sc.mig_shared_gb)] if shared else [])
        if mode == "peer_ipc":                            # the peer reads the drained worker's cache
            flags += ["--kv-transport", "cuda_ipc"]
        stack = ServeStack(f"migration-{mode}", args.model_dir, 2, sc, env, args.log_level, flags)
        r = res.setdefault(mode, {"stack": {"workers": 2, "device": sc.device, "env": env, "serve_flags": flags}})
        try:
            r["stack_start_s"] = STARTS[2] = round(stack.start(min(remaining() - sc.est_stop, args.ready_timeout)), 1)
            save()
            for i, ctx in enumerate(contexts):
                key = f"ctx{ctx}"
                est = (sc.est_worker_restart if i else 0.0) + sc.est_mig_run + sc.est_stop
                if remaining() < est:
                    skip(f"{part}/{key}", f"{remaining():.0f} s left, ~{est:.0f} s needed")
                    continue
                try:
                    if i:
                        r.setdefault("worker_restart_s", []).append(
                            round(wait_for_workers(stack, remaining() - sc.est_mig_run - sc.est_stop), 1))
                    r[key] = migrate_one(stack, ctx, sc, vocab, seed=1000 * (1 + MIG_MODES.index(mode)) + ctx)
                except Exception as exc:
                    record_error(f"{part}/{key}", exc)
                save()
        except Exception as exc:
            record_error(part, exc)
        finally:
            stack.stop()
            if shared is not None:
                shutil.rmtree(shared, ignore_errors=True)
            save()


def wait_for_workers(stack: ServeStack, timeout_s: float) -> float:
    """Seconds until two workers are registered and neither is draining (kvmesh serve restarts the
    drained one under its id), plus a scheduler poll."""
    t = time.time()
    while time.time() - t < timeout_s:
        if stack.proc is None or stack.proc.poll() is not None:
            raise StackError(f"stack {stack.name} stopped (see serve_bench.log)")
        live = [w for w in stack.records("worker") if not w.info.get("draining")]
        if len(live) >= 2:
            time.sleep(1.5)
            return time.time() - t
        time.sleep(0.5)
    raise TimeoutError(f"the drained worker was not back within {timeout_s:.0f} s")


def worker_tokens(stack: ServeStack) -> dict[str, float]:
    """Tokens each worker has generated, from its own /metrics: live, where its registry record's
    load lags by a heartbeat (long enough on a busy host for a short request to end unseen)."""
    return {w.id: counter(w.addrs["metrics"], "kvmesh_worker_generated_tokens")
            for w in stack.records("worker") if "metrics" in w.addrs}


def worker_pid(stack: ServeStack, worker_id: str) -> int:
    """The pid of the stack's worker process started with --worker-id worker_id."""
    for pid in group_members(stack.proc.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--worker-id" in argv and argv[argv.index(b"--worker-id") + 1:][:1] == [worker_id.encode()]:
            return pid
    raise StackError(f"no process of stack {stack.name} runs worker {worker_id}")


def _stream(url: str, body: dict, timeout_s: float, chunks: list, done: dict) -> None:
    """POST a streamed completion; each content chunk's arrival time into chunks, the usage and
    finish reason (or the error) into done. urllib: the device's wheels have no httpx."""
    import urllib.error
    import urllib.request
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            for raw in resp:          # one SSE line as it arrives
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if msg.get("error"):
                    done["error"] = msg["error"]
                for c in msg.get("choices") or []:
                    if c.get("text"):
                        chunks.append(time.perf_counter())
                    if c.get("finish_reason"):
                        done["finish_reason"] = c["finish_reason"]
                if msg.get("usage"):
                    done["usage"] = msg["usage"]
    except urllib.error.HTTPError as exc:
        done["error"] = f"HTTP {exc.code}: {exc.read()[:500]!r}"
    except Exception as exc:
        done["error"] = f"{type(exc).__name__}: {exc}"


def migrate_one(stack: ServeStack, ctx: int, sc: Scale, vocab: int, seed: int) -> dict:
    """One request of ctx random prompt tokens, streamed; its worker drained once it streams; the
    client's gap across the move and what the servers say of it."""
    import random
    import threading

    rng = random.Random(seed)     # a prompt of its own: no prefix shared with another run's
    model = json.loads(stack.page("/v1/models"))["data"][0]["id"]
    body = {"model": model, "prompt": [rng.randrange(10, vocab - 10) for _ in range(ctx)], "max_tokens": sc.mig_out,
            "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    stall0 = histograms(stack.url + "/metrics").get(MIG_STALL, (0.0, 0.0))
    tokens0 = worker_tokens(stack)
    chunks: list[float] = []
    done: dict = {}
    say(f"migration {stack.name}: {ctx} prompt tokens, {sc.mig_out} out")
    client = threading.Thread(target=_stream, args=(stack.url, body, sc.request_timeout, chunks, done), daemon=True)
    client.start()
    held_by, deadline = "", time.time() + sc.request_timeout
    while time.time() < deadline and client.is_alive() and not held_by:
        if len(chunks) >= sc.mig_drain_after:     # the worker generating its tokens (the only request)
            held_by = next((w for w, n in worker_tokens(stack).items() if n > tokens0.get(w, 0.0)), "")
        time.sleep(0.01)
    if not held_by:
        client.join(5)
        if "error" in done:
            raise RuntimeError(f"the request failed before the drain: {done['error']}")
        raise RuntimeError(f"the stream ended ({len(chunks)} chunks) before its worker was found; raise mig_out")
    pid = worker_pid(stack, held_by)
    signalled, before = time.perf_counter(), len(chunks)
    os.kill(pid, signal.SIGTERM)
    client.join(max(deadline - time.time(), 1.0))
    if client.is_alive() or "error" in done:
        raise RuntimeError(f"the moved stream did not finish cleanly: {done.get('error', 'timed out')}")
    if before >= len(chunks):
        raise RuntimeError(f"the stream ended ({len(chunks)} chunks) before the drain reached it; raise mig_out")
    stall1 = histograms(stack.url + "/metrics").get(MIG_STALL, (0.0, 0.0))
    stalls, stall_s = int(stall1[0] - stall0[0]), stall1[1] - stall0[1]
    gaps = [b - a for a, b in zip(chunks, chunks[1:])]
    itl = statistics.median(gaps[:before - 1]) if before > 1 else 0.0   # between the chunks before the drain
    # the move, as the client saw it: of the gaps from the signal on, the one the detokenizer timed
    # (its stall, from the last tokens before the move to the first after, is one of them plus the
    # hop to the client). Neither the first wide gap (the drained worker streams a few more chunks,
    # unevenly) nor the widest (on a busy host, a later hiccup: the drained worker restarting
    # beside the one decoding) is that gap reliably.
    after = [b - a for a, b in zip(chunks, chunks[1:]) if b >= signalled]
    move = min(after, key=lambda g: abs(g - stall_s)) if after and stalls == 1 else max(after, default=math.nan)
    usage = done.get("usage") or {}
    out = {"prompt_tokens": ctx, "drained_worker": held_by, "chunks_before_drain": before,
           "chunks": len(chunks), "completion_tokens": usage.get("completion_tokens"),
           "finish_reason": done.get("finish_reason"),
           "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
           "client_gap_ms": round(1000 * move, 1), "itl_before_ms": round(1000 * itl, 2),
           "max_gap_after_ms": round(1000 * max(after, default=float("nan")), 1),
           "extra_latency_ms": round(1000 * (move - itl), 1),
           "detok_stalls": stalls, "detok_stall_ms": round(1000 * stall_s, 1)}
    say(f"migration {stack.name} ctx {ctx}: gap {out['client_gap_ms']} ms (ITL before {out['itl_before_ms']} ms, "
        f"detokenizer stall {out['detok_stall_ms']} ms), {out['completion_tokens']} tokens, "
        f"{out['cached_tokens']} cached prompt tokens")
    return out


# ----------------------------------------------------------------------------- report
def _f(value, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def run_titles(who: str, sc: dict) -> list[tuple[str, str]]:
    """(run key, row title) of each run single, vllm and pd make, for the table."""
    return [("c1", f"{who} c=1 {sc.get('c1_in')}/{sc.get('c1_out')}"),
            ("c64", f"{who} c={sc.get('c64_conc')} {sc.get('c64_in')}/{sc.get('c64_out')}"),
            ("ph", f"{who} c={sc.get('c64_conc')} {sc.get('ph_in')}/{sc.get('ph_out')}")]


def table() -> str:
    lines = ["", "kvmesh serve benchmark (%s)" % RESULTS["env"].get("gpu", "?"),
             f"{'run':<22} {'metric':<26} {'value':>12}  note"]
    lines.append("-" * len(lines[-1]) + "-" * 30)
    single = RESULTS["sections"].get("single", {})
    sc = RESULTS.get("config", {}).get("scale", {})
    for key, title in run_titles("single", sc):
        run = single.get(key)
        if not run:
            continue
        if key == "c1":
            metrics = [("median TTFT ms", "median_ttft_ms"), ("median TPOT ms", "median_tpot_ms"),
                       ("p99 ITL ms", "p99_itl_ms"), ("out tok/s", "output_throughput")]
        else:
            metrics = [("total tok/s", "total_token_throughput"), ("out tok/s", "output_throughput"),
                       ("mean TTFT ms", "mean_ttft_ms"), ("median TTFT ms", "median_ttft_ms"),
                       ("mean TPOT ms", "mean_tpot_ms"), ("median TPOT ms", "median_tpot_ms"),
                       ("p99 ITL ms", "p99_itl_ms")]
        targets = {t["metric"]: t for t in run.get("targets", [])}
        for name, k in metrics:
            note = ""
            if k in targets:
                t = targets[k]
                note = f"target {t['op']} {t['target']:g} ({'met' if t['met'] else 'MISSED'}); vLLM {t['vllm']:g}"
            lines.append(f"{title:<22} {name:<26} {_f(run.get(k), '{:.2f}'):>12}  {note}")
        lines += _stage_lines(title, run)
        if run.get("failed"):
            lines.append(f"{title:<22} {'failed requests':<26} {run['failed']:>12}  {run.get('failure_reasons')}")
    for key, title in run_titles("vllm", sc):
        lines += _vllm_lines(key, title, single.get(key), RESULTS["sections"].get("vllm", {}).get(key))
    for key, title in run_titles("1P+1D", sc):
        run = RESULTS["sections"].get("pd", {}).get(key)
        if run:
            lines += _beside_lines(key, title, run, single.get(key), "single")
            lines += _stage_lines(title, run)
    routing = RESULTS["sections"].get("routing", {})
    for mode in ("cache_aware", "round_robin", "least_loaded"):
        run = (routing.get(mode) or {}).get("run")
        if not run:
            continue
        title = f"2 workers {mode}"
        for name, k, fmt in (("TTFT mean ms", "mean_ttft_ms", "{:.1f}"), ("TTFT median ms", "median_ttft_ms", "{:.1f}"),
                             ("TTFT p99 ms", "p99_ttft_ms", "{:.1f}"), ("req/s", "request_throughput", "{:.2f}"),
                             ("total tok/s", "total_token_throughput", "{:.0f}"),
                             ("median TPOT ms", "median_tpot_ms", "{:.2f}")):
            lines.append(f"{title:<22} {name:<26} {_f(run.get(k), fmt):>12}")
        ratio = run.get("cached_token_ratio")
        split = " / ".join(f"{w['requests_total']} req, hit {_f(w['prefix_hit_ratio'] and 100 * w['prefix_hit_ratio'])}%"
                           for w in (routing[mode].get("workers") or {}).values())
        lines.append(f"{title:<22} {'prefix-cache hit %':<26} {_f(ratio and 100 * ratio):>12}  per worker: {split}")
        lines += _stage_lines(title, run)
        if run.get("failed"):
            lines.append(f"{title:<22} {'failed requests':<26} {run['failed']:>12}  {run.get('failure_reasons')}")
    lines += _migration_lines(RESULTS["sections"].get("migration", {}))
    for part, why in RESULTS["skipped"].items():
        lines.append(f"{part:<22} {'skipped':<26} {'':>12}  {why}")
    for part, err in RESULTS["errors"].items():
        last = [ln for ln in err.strip().splitlines() if ln.strip()][-1:] or ["?"]
        lines.append(f"{part:<22} {'ERROR':<26} {'':>12}  {last[0][:150]}")
    lines.append(f"elapsed {time.time() - T0:.0f} s; details in {OUT / 'serve_bench.json'}, logs in {OUT / 'serve_bench.log'}")
    return "\n".join(lines)


VLLM_METRICS = {"c1": (("median TTFT ms", "median_ttft_ms", False), ("median TPOT ms", "median_tpot_ms", False),
                        ("p99 ITL ms", "p99_itl_ms", False), ("out tok/s", "output_throughput", True)),
                 "c64": (("total tok/s", "total_token_throughput", True), ("mean TTFT ms", "mean_ttft_ms", False),
                         ("median TTFT ms", "median_ttft_ms", False), ("median TPOT ms", "median_tpot_ms", False),
                         ("p99 ITL ms", "p99_itl_ms", False))}
VLLM_METRICS["ph"] = VLLM_METRICS["c64"]


def _vllm_lines(key: str, title: str, ours: dict | None, theirs: dict | None) -> list[str]:
    """vLLM's run next to ours: its value and how many times better kvmesh is (>1: kvmesh ahead)."""
    if not theirs:
        return []
    lines = []
    for name, k, higher_better in VLLM_METRICS[key]:
        a, b = (ours or {}).get(k), theirs.get(k)
        note = ""
        if a and b:
            note = f"kvmesh {a:.2f}: {(a / b if higher_better else b / a):.3f}x vLLM (same GPU, same requests)"
        lines.append(f"{title:<22} {name:<26} {_f(b, '{:.2f}'):>12}  {note}")
    if theirs.get("failed"):
        lines.append(f"{title:<22} {'failed requests':<26} {theirs['failed']:>12}  {theirs.get('failure_reasons')}")
    return lines


def _beside_lines(key: str, title: str, run: dict, other: dict | None, other_name: str) -> list[str]:
    """A run's metrics, each beside another kvmesh run's (>1: this run ahead)."""
    lines = []
    for name, k, higher_better in VLLM_METRICS[key]:
        a, b = run.get(k), (other or {}).get(k)
        note = f"{other_name} {b:.2f}: {(a / b if higher_better else b / a):.3f}x" if a and b else ""
        lines.append(f"{title:<22} {name:<26} {_f(a, '{:.2f}'):>12}  {note}")
    if run.get("failed"):
        lines.append(f"{title:<22} {'failed requests':<26} {run['failed']:>12}  {run.get('failure_reasons')}")
    return lines


def _migration_lines(res: dict) -> list[str]:
    """Per context, the move's extra latency with the KV from the peer, from the shared tier, recomputed."""
    lines = []
    for key in sorted({k for mode in MIG_MODES for k in res.get(mode, {}) if k.startswith("ctx")},
                      key=lambda k: int(k[3:])):
        for mode in MIG_MODES:
            run = res.get(mode, {}).get(key)
            if run:
                lines.append(f"{'moved ' + key[3:] + ' ' + mode:<22} {'extra latency ms':<26} "
                             f"{_f(run['extra_latency_ms']):>12}  gap {run['client_gap_ms']} - ITL "
                             f"{run['itl_before_ms']}; detok stall {run['detok_stall_ms']} ms; cached prompt tokens "
                             f"{run['cached_tokens']}; {run['completion_tokens']} tokens")
    return lines


def _stage_lines(title: str, run: dict) -> list[str]:
    """Where the mean TTFT went: client, gateway, worker (queue + prefill); decode; step."""
    st = run.get("stages")
    if not st:
        return [f"{title:<22} {'stage means':<26} {'-':>12}  {run.get('stages_error', '')[:120]}"] \
            if run.get("stages_error") else []
    f = lambda k: _f(st.get(k), "{:.2f}")  # noqa: E731
    return [f"{title:<22} {'TTFT mean ms (client)':<26} {f('client_ttft_ms'):>12}  gateway {f('gateway_ttft_ms')}, "
            f"worker {f('worker_ttft_ms')} = queue {f('worker_queue_ms')} + prefill {f('worker_prefill_ms')}",
            f"{title:<22} {'gateway submit mean ms':<26} {f('gateway_submit_ms'):>12}  tokenize "
            f"{f('gateway_tokenize_ms')}; upstream {f('gateway_upstream_ms')} = scheduler {f('scheduler_dispatch_ms')} "
            f"+ worker TTFT + send {f('worker_first_send_ms')} + detok {f('detok_first_token_ms')} + hops "
            f"{f('hops_ms')}; first chunk write {f('gateway_first_write_ms')}",
            f"{title:<22} {'worker admit mean ms':<26} {f('worker_admit_ms'):>12}  first-token step waited "
            f"{f('worker_first_sync_ms')} for the device",
            f"{title:<22} {'worker decode mean ms':<26} {f('worker_decode_ms'):>12}  "
            f"engine step mean {f('engine_step_ms')} ms"]


def environment(args, sc: Scale) -> None:
    env = RESULTS["env"]
    env.update({"smoke": args.smoke, "model_dir": str(args.model_dir), "model_size": sc.model_size,
                "python": sys.version.split()[0], "cpus": os.cpu_count(),
                "kvmesh_env": {k: v for k, v in os.environ.items() if k.startswith("KVMESH_")},
                "argv": sys.argv[1:], "started": time.strftime("%Y-%m-%d %H:%M:%S")})
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        env["gpu"] = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else "none"
    except (OSError, subprocess.TimeoutExpired, IndexError):
        env["gpu"] = "none"
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        env["commit"] = git.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        env["commit"] = None


def parse_env(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("KVMESH_"):
            raise SystemExit(f"--env expects KVMESH_NAME=VALUE, got {item!r}")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    global DEADLINE, OUT, LOG
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="single,routing",
                    help="comma-separated: single, vllm (vLLM's server, the same runs as single), pd (1 prefill + "
                         "1 decode worker on the GPU, the same runs as single), routing, migration (a request's "
                         "added latency when its worker drains mid-decode)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny lengths: checks this script")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="model made once here and reused (default /tmp/kvmesh-llama-8b; smoke: /tmp/kvmesh-serve-bench-tiny)")
    ap.add_argument("--time-budget", type=float, default=520.0, help="seconds from start; later parts skip")
    ap.add_argument("--single-runs", default="c1,c64",
                    help="which runs single, vllm and pd make: c1, c64, ph (prefill-heavy 4096 in / 256 out)")
    ap.add_argument("--c1-prompts", type=int, default=0, help="requests of the concurrency-1 run (default 48)")
    ap.add_argument("--c64-prompts", type=int, default=0, help="requests of the concurrency-64 run (default 640)")
    ap.add_argument("--ph-prompts", type=int, default=0, help="requests of the prefill-heavy run (default 256)")
    ap.add_argument("--routing-modes", default="cache_aware,round_robin",
                    help="scheduler --routing values, one fresh 2-worker stack each")
    ap.add_argument("--routing-gpu-mem", type=float, default=0.42,
                    help="KVMESH_GPU_MEMORY_UTILIZATION of each of the two workers, routing, pd and migration "
                         "(0: leave unset)")
    ap.add_argument("--migration-modes", default="peer,shared,recompute",
                    help="where a moved request's KV comes from, one fresh 2-worker stack each: peer (the "
                         "drained worker sends it, where that beats a recompute), peer_ipc (the same, the peer "
                         "reading the drained worker's cache: --kv-transport cuda_ipc), shared (the shared KV "
                         "tier the drained worker writes), recompute (neither)")
    ap.add_argument("--migration-contexts", default="",
                    help="comma-separated prompt tokens of the migration runs (default 2048,8192)")
    ap.add_argument("--single-gpu-mem", type=float, default=0.0,
                    help="KVMESH_GPU_MEMORY_UTILIZATION of the single worker (0: the stack's default)")
    ap.add_argument("--gsp-groups", type=int, default=0, help="shared-prefix groups (default 32)")
    ap.add_argument("--gsp-per-group", type=int, default=0, help="questions per group (default 8)")
    ap.add_argument("--gsp-rate", default="", help="request rate of the routing runs (default 8 req/s)")
    ap.add_argument("--env", action="append", default=[], metavar="KVMESH_X=V",
                    help="extra KVMESH_* variable for every stack (repeatable); KVMESH_* already set pass through")
    ap.add_argument("--serve-flag", action="append", default=[], metavar="FLAG",
                    help="extra `kvmesh serve` argument (repeatable, e.g. --serve-flag=--max-num-seqs=256)")
    ap.add_argument("--client-arg", action="append", default=[], metavar="ARG",
                    help="extra `kvmesh bench serve` argument for every run (repeatable)")
    ap.add_argument("--vllm-site", type=Path, default=Path("/tmp/vsite"),
                    help="folder holding vLLM 0.26.0 and its wheels (section vllm; ../shared/peer-vllm/)")
    ap.add_argument("--vllm-max-model-len", type=int, default=16384, help="vLLM's --max-model-len (section vllm)")
    ap.add_argument("--vllm-gpu-mem", type=float, default=0.9, help="vLLM's --gpu-memory-utilization (section vllm)")
    ap.add_argument("--vllm-start-estimate", type=float, default=150.0,
                    help="seconds vLLM is expected to take to start (its torch.compile and graph capture)")
    ap.add_argument("--vllm-flag", action="append", default=[], metavar="FLAG",
                    help="extra vLLM server argument (repeatable, e.g. --vllm-flag=--max-num-batched-tokens=2048)")
    ap.add_argument("--ready-timeout", type=float, default=300.0, help="seconds a stack may take to start")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    args = ap.parse_args(argv)
    sc = SMOKE_SCALE if args.smoke else Scale()
    args.model_dir = args.model_dir or Path("/tmp/kvmesh-serve-bench-tiny" if args.smoke else "/tmp/kvmesh-llama-8b")
    args.env = parse_env(args.env)
    args.routing_modes = [m.strip() for m in args.routing_modes.split(",") if m.strip()]
    args.single_runs = [m.strip() for m in args.single_runs.split(",") if m.strip()]
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in ("single", "vllm", "pd", "routing", "migration")]
    if bad:
        ap.error(f"unknown section(s) {bad}; choose from single, vllm, pd, routing, migration")
    args.migration_modes = [m.strip() for m in args.migration_modes.split(",") if m.strip()]
    if not args.migration_modes or any(m not in MIG_MODES for m in args.migration_modes):
        ap.error(f"--migration-modes takes {', '.join(MIG_MODES)} (comma-separated), got {args.migration_modes}")
    try:
        contexts = [int(c) for c in args.migration_contexts.split(",") if c.strip()]
    except ValueError:
        contexts = [0]
    if any(c < 16 for c in contexts):
        ap.error(f"--migration-contexts takes prompt lengths of at least 16 tokens, got {args.migration_contexts!r}")
    DEADLINE = T0 + args.time_budget
    OUT = Path(os.environ.get("OUT", "./out"))
    OUT.mkdir(parents=True, exist_ok=True)
    LOG = CombinedLog(OUT / "serve_bench.log")

    def on_term(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)

    environment(args, sc)
    RESULTS["config"] = {"scale": sc.__dict__, "sections": sections, "routing_modes": args.routing_modes,
                         "time_budget": args.time_budget}
    save()
    say(f"serve_bench: sections {sections}, {'SMOKE (cpu, tiny)' if args.smoke else 'llama-8b'}, "
        f"gpu {RESULTS['env']['gpu']}, budget {args.time_budget:.0f} s, out {OUT}")
    code = 0
    try:
        try:
            ensure_model(args.model_dir, sc.model_size, sc.est_make_model)
        except Exception as exc:
            record_error("model", exc)
            sections = []
            code = 1
        for name, fn in (("single", section_single), ("vllm", section_vllm), ("pd", section_pd),
                         ("routing", section_routing), ("migration", section_migration)):
            if name in sections:
                try:
                    fn(args, sc)
                except Exception as exc:
                    record_error(name, exc)
    except KeyboardInterrupt as exc:
        record_error("interrupted", exc)
        code = 130
    finally:
        save()
        print(table(), flush=True)
    if RESULTS["errors"]:
        code = code or 1
    return code


if __name__ == "__main__":
    sys.exit(main())
