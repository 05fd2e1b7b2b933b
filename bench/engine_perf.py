"""Engine speed on one GPU: a random-weight Llama-3.1-8B through gpu_worker.Engine.

    python bench/engine_perf.py [--model-dir /tmp/m8b] [--budget 420] [--skip sharegpt] [--async-scheduling]
    python bench/engine_perf.py --smoke --model-dir /tmp/tiny     # CPU, tiny model: checks the script
    python bench/engine_perf.py --skip ablation,profile,prefill --fp8 fp8ops,decode1,async,prefill  # + fp8

Order (each part guarded and time-boxed; the table is printed last, also to $OUT/engine_perf.json):
  parity     greedy tokens and per-step logits, CUDA-graph replay vs eager, on 4 prompts
  decode1    batch-1 decode at 128 and 8k context: wall tok/s, and the GPU time of one graph
             replay (CUDA events), so wall - GPU = host overhead per step
  ablation   batch-1 at 128 eager (no graphs), and eager without the fused Triton kernels
  profile    per-kernel CUDA time of one eager batch-1 decode step (torch.profiler)
  decodeB    decode at batch 64 and 256 (prompt 128): out tok/s, host time split per step
  async      batch-1 at 128 and batch 256 again with async_scheduling (step N+1 launched before
             step N's tokens are read back)
  prefill    prefill at 512 / 2k / 8k prompts (max_tokens 1): prompt tok/s, at ~32k prompt tokens
             per length and at vLLM's peer run's 16,384
  behind     chunks behind a cached prefix: 4 prompts of 8k prefilled in 2,048-token chunks, and 32
             prompts of 512 new tokens behind 1.5k cached (prefix-cache hits after a first turn);
             prompt tok/s, the fresh_prefill_attention kernel against paged_prefill_attention's
             v2 (KernelTuning.fresh_prefix off), alternating, two rounds
  sharegpt   1,000 requests of ShareGPT-like lengths (default: vLLM's peer run's own, 211 in / 182
             out on average), ignore_eos, temperature 1 (--sharegpt-temperature): total tok/s
  sharegpt_async  the same with async_scheduling on (and `sharegpt_N` for each --sharegpt-seqs N);
             each also reports its steps by kind and rows: wall, device and device-idle ms
  closedloop the serving benchmark's concurrency-64 run (640 x 1,024 in / 128 out) on the engine,
             once per --closedloop-budgets step token budget: total tok/s, p99 ITL, TTFT
             (--closedloop-piecewise-ab: each also with the piecewise graphs hidden, which
             --piecewise-max-tokens 2048 captures)
  --fp8      fp8ops (one layer: bf16 vs fp8 _scaled_mm vs fp8 GEMV, first), then a second engine
             with quantization="fp8" runs the listed parts (parity, decode1, async, prefill, decodeB)

Weight roofline for batch-1: ~15.0 GB of weights read per step at ~4.2 TB/s -> ~3.6 ms/step.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from gpu_timing import event_median_ms  # noqa: E402  (bench/, the script's folder)
from offline_bench import PREFILL_LENS as PEER_PREFILL_LENS, PREFILL_TOKENS as PEER_PREFILL_TOKENS  # noqa: E402
from offline_bench import vllm_peer_sharegpt_lengths  # noqa: E402

T0 = time.time()
ROWS: list[tuple[str, str, str]] = []
RESULTS: dict = {}
OUT = Path(os.environ.get("OUT", "/tmp/engine_perf_out"))
ASYNC_DEFAULT = False    # --async-scheduling
SMOKE = False    # --smoke: a tiny model on the CPU with every size / 32, to check this script


def S(n: int) -> int:
    return max(4, n // 32) if SMOKE else n


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


ROW_SUFFIX = ""   # " fp8" while the fp8 engine runs
SHAREGPT_TEMPERATURE = 1.0   # --sharegpt-temperature
SHAREGPT_WORKLOAD = "vllm"   # --sharegpt-workload
CLOSEDLOOP_BUDGETS = [1536]  # --closedloop-budgets
SHAREGPT_GRAPH_CAPS: list[int] = []   # --sharegpt-graph-cap
LIVE_PROFILE: tuple[str, int, int, int] | None = None   # --live-profile [KIND:]LO:HI[:MINROWS]
FREEZE_GC = True             # --no-freeze-gc
SHAREGPT_GC_AB = False       # --sharegpt-gc-ab
CLOSEDLOOP_PIECEWISE_AB = False   # --closedloop-piecewise-ab
CLOSEDLOOP_KERNEL_AB = False      # --closedloop-kernel-ab
PROFILE_CASES = ["1:128:short", "1:8192", "128:256"]   # --profile-cases
PROFILE_CASES_ONLY = False            # --profile-cases given: no prefill profile
PROFILE_PREFILL_LENS = [2048]         # --profile-prefill-lens: prompt lengths of the prefill profile
PREFILL_VARIANTS = ["default"]        # --prefill-variants: the prefill part once per variant


def row(metric: str, value: str, note: str = "") -> None:
    if ROW_SUFFIX and ROW_SUFFIX not in metric:
        metric += ROW_SUFFIX
    ROWS.append((metric, value, note))
    RESULTS[metric] = {"value": value, "note": note}
    log(f"{metric:44s} {value}  {note}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "engine_perf.json").write_text(json.dumps(RESULTS, indent=1))


def ensure_model(model_dir: Path) -> Path:
    if (model_dir / "config.json").exists() and list(model_dir.glob("*.safetensors")):
        return model_dir
    log(f"making a random-weight llama 8b in {model_dir} ...")
    subprocess.run([sys.executable, "-m", "services.cli", "make-model", "--arch", "llama", "--size", "8b",
                    str(model_dir)], check=True, cwd=Path(__file__).resolve().parents[1], timeout=300)
    return model_dir


class Bench:
    def __init__(self, eng):
        from services.protocol.sampling import SamplingParams
        self.eng, self.SP = eng, SamplingParams
        self.rng = random.Random(0)
        self.ids = iter(range(10**9))

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(300, self.eng.vocab_size) for _ in range(n)]   # no prefix hits

    def add(self, prompt, n_out: int, **kw) -> str:
        rid = f"r{next(self.ids)}"
        params = dict(temperature=0.0, ignore_eos=True, max_tokens=n_out)
        params.update(kw)
        self.eng.add_request(rid, prompt, self.SP(**params))
        return rid

    def drain(self, deadline: float | None = None) -> int:
        n = 0
        while self.eng.has_unfinished_requests():
            n += sum(len(d.new_token_ids) for d in self.eng.step())
            if deadline is not None and time.time() > deadline:
                for r in list(self.eng.requests):
                    self.eng.abort_request(r)
                break
        return n

    def generate(self, prompts, n_out: int, record=None) -> list[list[int]]:
        """Greedy tokens of each prompt (all in one batch)."""
        rids = [self.add(p, n_out) for p in prompts]
        toks = {r: [] for r in rids}
        while self.eng.has_unfinished_requests():
            for d in self.eng.step():
                toks[d.request_id] += d.new_token_ids
        return [toks[r] for r in rids]


GRAPH_KINDS = ("decode_graphs", "short_decode_graphs", "prefill_graphs", "piecewise_graphs")


@contextlib.contextmanager
def graphs_off(runner, *kinds: str):
    """The runner's graphs of these kinds hidden (those steps run eagerly), then restored."""
    saved = {k: getattr(runner, k, None) for k in kinds}
    try:
        for k in kinds:
            setattr(runner, k, None)
        yield
    finally:
        for k, v in saved.items():
            setattr(runner, k, v)


def sync() -> None:
    if not SMOKE:
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------- parts
def part_parity(b: Bench) -> None:
    runner = b.eng.runner
    if runner.decode_graphs is None:
        row("parity graphs vs eager", "SKIPPED", "no graphs were captured")
        return
    # "long": one context past the short graphs' bound (SHORT_CONTEXT, 1,024) keeps every decode
    # step of the batch on the long graphs, so the eager run can split as they do
    parity_case(b, "long", [S(n) if n > 128 else n for n in (17, 128, 300, 1100)], runner.decode_graphs)
    if runner.short_decode_graphs is not None:
        parity_case(b, "short", [17, 100, 300], runner.short_decode_graphs)


def parity_case(b: Bench, label: str, lengths: list[int], graphs) -> None:
    """Greedy tokens and decode logits with graphs, then eagerly with the graph's decode split
    count: the same kernels in the same order, so they must agree to the bit (other split counts
    differ by bf16 rounding, which random weights amplify: ~3e-2 was seen on an 8B)."""
    eng, runner = b.eng, b.eng.runner
    prompts = [b.prompt(n) for n in lengths]
    recorded: list[torch.Tensor] = []
    forward, attention = runner.forward, runner.attention

    def rec(batch):
        out = forward(batch)
        if batch.is_pure_decode:
            recorded.append(out.detach().clone())
        return out

    runner.forward = rec
    try:
        eng.reset_prefix_cache()
        with_graphs = b.generate(prompts, 24)
        logits_g = list(recorded)
        recorded.clear()
        eng.reset_prefix_cache()
        if attention.pins_decode_splits and not SMOKE:
            # the eager steps split as the graph of their bucket does (its captured size and
            # context bound: split count and tiles), not as an eager step would
            from gpu_worker.kernels.paged_decode_attention import choose_decode_split
            cache = runner.kv_caches[0][0]
            split = choose_decode_split(graphs.bucket(len(prompts)), cache.shape[2], graphs.max_context_len,
                                        runner.device, runner.config.num_heads // cache.shape[2], cache.dtype,
                                        attention.decode_tuning)
            attention.decode_split = lambda batch, q, k_cache: split
        with graphs_off(runner, "decode_graphs", "short_decode_graphs", "piecewise_graphs"):
            eager = b.generate(prompts, 24)
        logits_e = list(recorded)
    finally:
        runner.forward = forward
        attention.__dict__.pop("decode_split", None)        # back to the class's method
        eng.reset_prefix_cache()
    same = [next((i for i, (x, y) in enumerate(zip(a, e)) if x != y), len(a)) for a, e in zip(with_graphs, eager)]
    errs = []
    for lg, le in zip(logits_g, logits_e):
        if lg.shape != le.shape:
            break
        errs.append(float((lg - le).double().norm() / le.double().norm()))
        if len(errs) >= 4:
            break
    ok = all(s == 24 for s in same) and errs and max(errs) == 0.0
    row(f"parity graphs vs eager ({label})", "ok" if ok else "MISMATCH",
        f"identical greedy prefix {same} of 24; logits rel err first steps {['%.1e' % e for e in errs]}")


def graph_gpu_ms(runner, size: int, reps: int = 30, short: bool = False) -> float:
    g = runner.short_decode_graphs if short else runner.decode_graphs
    if SMOKE or g is None or size not in g.graphs:
        return float("nan")
    return event_median_ms(g.graphs[size].replay, reps, warmup=1)


def decode1(b: Bench, ctx: int, n_out: int = 160, label: str = "") -> float:
    b.add(b.prompt(ctx), n_out)
    while b.eng.scheduler.waiting or any(s.num_new_tokens > 1 for s in b.eng.scheduler.running):
        b.eng.step()                                   # the prefill
    for _ in range(min(5, n_out // 4)):
        b.eng.step()
    sync()
    t = time.perf_counter()
    n = b.drain()
    dt = time.perf_counter() - t
    gpu = graph_gpu_ms(b.eng.runner, 1, short=ctx + n_out <= 512 and b.eng.runner.short_decode_graphs is not None)
    note = f"{1e3 * dt / n:.3f} ms/step wall"
    if not math.isnan(gpu) and b.eng.runner.decode_graphs is not None:
        note += f", graph replay {gpu:.3f} ms GPU (lm_head inside; argmax outside)"
    row(f"batch-1 decode ctx={ctx}{label}", f"{n / dt:.1f} tok/s", note)
    return n / dt


def part_decode1(b: Bench) -> None:
    decode1(b, 128, S(256))
    decode1(b, S(8192), S(160))


def part_ablation(b: Bench) -> None:
    runner = b.eng.runner
    with graphs_off(runner, *GRAPH_KINDS):
        decode1(b, 128, S(64), " eager")
        kernels = runner.model.model.norm.kernels
        runner.model.use_fused_kernels(None)
        try:
            decode1(b, 128, S(64), " eager, torch ops")
        finally:
            runner.model.use_fused_kernels(kernels)


def part_profile(b: Bench) -> None:
    """GPU time by kernel family (gpu_timing.profile_kernels) of the steps the targets are about: a
    batch-1 and a batch-128 decode graph replay as they serve (real contexts in the buffers), and
    an eager prefill step of 8 x 2k prompts; GEMM time against the weight bytes / the FLOPs."""
    from gpu_timing import format_profile, profile_kernels, top_kernels
    if SMOKE:
        return
    runner = b.eng.runner
    layers = [m for m in runner.model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    layer_bytes = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    layer_params = sum(m.weight.numel() for m in layers)
    head = runner.model.lm_head if runner.model.lm_head is not None else runner.model.model.embed_tokens
    head_bytes = head.weight.numel() * head.weight.element_size()

    def decode_case(B: int, ctx: int, short: bool) -> None:
        graphs = runner.short_decode_graphs if short else runner.decode_graphs
        if graphs is None or B not in graphs.graphs:
            row(f"profile decode B={B}", "SKIPPED", "no graph of that size")
            return
        sched = b.eng.scheduler
        saved = sched.max_num_seqs
        sched.max_num_seqs = max(saved, B)
        try:
            for _ in range(B):
                b.add(b.prompt(ctx), 40)
            while sched.waiting or any(s.num_new_tokens > 1 for s in sched.running):
                b.eng.step()
            for _ in range(4):
                b.eng.step()
            sync()
            replay = graphs.graphs[B].replay          # the buffers hold this batch's last step
            cats = profile_kernels(replay, reps=5)
            b.drain()
        finally:
            sched.max_num_seqs = saved
        gemm = cats.get("gemm (cublas)", (0.0, 0))[0] + cats.get("gemv (triton)", (0.0, 0))[0]
        wbytes = layer_bytes + (head_bytes if graphs.returns_logits(B) else 0)
        note = format_profile(cats)
        if gemm:
            note += f" | GEMMs read weights at {wbytes / (gemm * 1e-3) / 1e12:.2f} TB/s"
        row(f"profile decode B={B} ctx={ctx} ({'short' if short else 'long'} graph)",
            f"{cats['total'][0]:.3f} ms GPU", note)
        log("    top kernels: " + "; ".join(f"{n[:50]} {ms:.3f}ms x{k:.0f}" for n, ms, k in top_kernels(replay)))

    for case in PROFILE_CASES:          # --profile-cases: B:ctx[:short]
        B, ctx, *short = case.split(":")
        decode_case(int(B), S(int(ctx)), bool(short) and runner.short_decode_graphs is not None)
    if PROFILE_CASES_ONLY:
        return

    for L in PROFILE_PREFILL_LENS:      # --profile-prefill-lens: one full step of L-token prompts
        n_req = max(1, b.eng.config.max_num_batched_tokens // S(L))
        L = S(L)

        def prefill_step(n_req=n_req, L=L) -> None:
            for _ in range(n_req):
                b.add(b.prompt(L), 1)
            b.drain()

        cats = profile_kernels(prefill_step, reps=2)
        gemm = cats.get("gemm (cublas)", (0.0, 0))[0]
        tokens = n_req * L
        note = format_profile(cats)
        if gemm:
            note += f" | GEMMs {2 * tokens * layer_params / (gemm * 1e-3) / 1e12:.0f} TFLOP/s"
        row(f"profile prefill {n_req}x{L}", f"{cats['total'][0]:.1f} ms GPU ({tokens / cats['total'][0] * 1e3:.0f} tok/s)",
            note)
        log("    top kernels: " + "; ".join(f"{n[:50]} {ms:.2f}ms x{k:.0f}"
                                         for n, ms, k in top_kernels(prefill_step, reps=1)))


def part_ttft(b: Bench) -> None:
    """The engine's share of the c=1 serving TTFT: one request of 513 prompt tokens at a time
    (what `bench serve --random-input-len 512` sends), add -> first delta, sync and async, and a
    chat's second turn (128 new tokens behind 2,048 cached), each with the prefill graphs and
    eagerly; the prefill forward's host launch time, its wall time on the GPU (CUDA events from
    the launch's start) and, eagerly, the sum of its kernels' durations (the GPU's busy time)."""
    from gpu_timing import profile_kernels
    eng, runner = b.eng, b.eng.runner
    L = S(513)

    def one(max_tokens: int, prompt: list[int] | None = None) -> tuple[float, float, float]:
        forward, rec = runner.forward, {}

        def timed(batch):
            if batch.is_pure_decode or SMOKE:
                return forward(batch)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            start.record()
            out = forward(batch)
            end.record()
            rec["launch"], rec["events"] = time.perf_counter() - t, (start, end)
            return out

        runner.forward = timed
        try:
            t, first = time.perf_counter(), None
            b.add(prompt or b.prompt(L), max_tokens)
            while eng.has_unfinished_requests():
                if eng.step() and first is None:
                    first = time.perf_counter() - t
        finally:
            del runner.forward                         # back to the class's method
        sync()
        gpu = rec["events"][0].elapsed_time(rec["events"][1]) if "events" in rec else float("nan")
        return 1e3 * (first or float("nan")), 1e3 * rec.get("launch", float("nan")), gpu

    def second_turn() -> tuple[float, float, float]:
        """A chat's next turn: 128 new tokens behind a 2,048-token prompt already cached."""
        history = b.prompt(S(2048))
        one(1, history)
        return one(4, history + b.prompt(S(128)))

    def median(fn) -> tuple[float, float, float]:
        fn()                                           # warm
        runs = sorted(fn() for _ in range(S(10)))
        return runs[len(runs) // 2]

    saved, graphs, piecewise = eng.async_scheduling, runner.prefill_graphs, runner.piecewise_graphs
    try:
        for use_graphs in ((True, False) if graphs is not None else (False,)):
            runner.prefill_graphs = graphs if use_graphs else None
            runner.piecewise_graphs = piecewise if use_graphs else None
            tag = " (prefill graph)" if use_graphs else " (eager)"
            for mode in (False, True):
                eng.async_scheduling = mode
                med = median(lambda: one(4))
                row(f"ttft 1 x {L} tokens{' async' if mode else ''}{tag}", f"{med[0]:.1f} ms",
                    f"prefill forward: host launch {med[1]:.1f} ms, GPU wall from launch {med[2]:.1f} ms "
                    f"(median of {S(10)})")
            eng.async_scheduling = True
            med = median(second_turn)
            row(f"ttft 2nd turn {S(2048)} cached + {S(128)} new, async{tag}", f"{med[0]:.1f} ms",
                f"prefill forward: host launch {med[1]:.1f} ms, GPU wall from launch {med[2]:.1f} ms")
        runner.prefill_graphs = runner.piecewise_graphs = None
        eng.async_scheduling = False
        if not SMOKE:
            busy = profile_kernels(lambda: one(1), reps=3)["total"][0]
            row(f"ttft prefill {L} kernel busy", f"{busy:.1f} ms", "sum of kernel durations of the step")
    finally:
        eng.async_scheduling, runner.prefill_graphs, runner.piecewise_graphs = saved, graphs, piecewise


def part_hostprof(b: Bench) -> None:
    """Where the host's time goes while it launches one eager prefill forward of 513 tokens (the
    c=1 TTFT step, host-bound when the launch takes longer than the kernels): torch.profiler's
    CPU ops by self time, written to $OUT/hostprof_prefill.txt, the top ones logged."""
    from torch.profiler import ProfilerActivity, profile
    if SMOKE:
        return
    runner = b.eng.runner
    forward, batches = runner.forward, []

    def grab(batch):
        if not batch.is_pure_decode:
            batches.append(batch)
        return forward(batch)

    runner.forward = grab
    try:
        b.add(b.prompt(513), 1)
        b.drain()
    finally:
        del runner.forward
    batch = batches[-1]
    runner.run_model(batch)
    sync()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        runner.run_model(batch)
        launch = time.perf_counter() - t
    sync()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    (OUT / "hostprof_prefill.txt").write_text(table)
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
    row("hostprof prefill 513 launch", f"{1e3 * launch:.1f} ms",
        "; ".join(f"{e.key[:40]} {e.self_cpu_time_total / 1e3:.1f}ms x{e.count}" for e in top))
    log(table)


class StepSplit:
    """Host time of each engine.step piece: schedule, build, forward (launch), sample (launch),
    wait (reading the tokens back: the GPU time not hidden), and the rest."""

    def __init__(self, eng):
        from gpu_worker.sampler import PendingSample
        self.eng, self.t = eng, {k: 0.0 for k in ("schedule", "build", "forward", "sample", "wait")}
        self.targets = [(eng.scheduler, "schedule", "schedule"), (eng.batch_builder, "build", "build"),
                        (eng.runner, "forward", "forward"), (eng.sampler, "_choose", "sample")]
        for obj, attr, name in self.targets:
            setattr(obj, attr, self._wrap(name, getattr(obj, attr)))
        self.pending_cls, self.results = PendingSample, PendingSample.results
        PendingSample.results = self._wrap("wait", PendingSample.results)

    def _wrap(self, name, fn):
        def inner(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[name] += time.perf_counter() - t
        return inner

    def restore(self) -> None:
        for obj, attr, _ in self.targets:
            delattr(obj, attr)                 # back to the class's method
        self.pending_cls.results = self.results


def part_decodeB(b: Bench, sizes: tuple[int, ...] | None = None, label: str = "") -> None:
    for B in sizes or (S(64), S(256)):
        for _ in range(B):
            b.add(b.prompt(128), S(200))
        while b.eng.scheduler.waiting or any(s.num_new_tokens > 1 for s in b.eng.scheduler.running):
            b.eng.step()
        for _ in range(3):
            b.eng.step()
        sync()
        split = StepSplit(b.eng)
        t, n, steps = time.perf_counter(), 0, 0
        try:
            while steps < S(64):
                n += sum(len(d.new_token_ids) for d in b.eng.step())
                steps += 1
        finally:
            split.restore()
        dt = time.perf_counter() - t
        b.drain()
        gpu = graph_gpu_ms(b.eng.runner, B)
        parts = ", ".join(f"{k} {1e3 * v / steps:.2f}" for k, v in split.t.items())
        rest = 1e3 * (dt - sum(split.t.values())) / steps
        row(f"decode B={B}{label}", f"{n / dt:.0f} out tok/s",
            f"{1e3 * dt / steps:.2f} ms/step; graph GPU {gpu:.2f} ms; host ms/step: {parts}, rest {rest:.2f}")


def part_async(b: Bench) -> None:
    """The same decode runs with async_scheduling (host work of step N+1 under step N's GPU time)."""
    b.eng.async_scheduling = True
    try:
        decode1(b, 128, S(256), " async")
        part_decodeB(b, sizes=(S(256),), label=" async")
    finally:
        b.eng.async_scheduling = ASYNC_DEFAULT
        b.eng.step()                      # settles a step still in flight


def part_prefill(b: Bench) -> None:
    """Prompt tok/s at 512 / 2k / 8k: ~32k prompt tokens per length (two 16,384-token steps, the
    board at its power cap), then vLLM's peer run's workload (16,384 // L prompts: one step).
    Once per --prefill-variants entry, alternating per length so the board's power state falls
    on each alike: default (the engine's settings), norm-adds (the residual added in the norm
    kernels, not in the GEMMs: KernelTuning.residual_gemm_min_rows off), paged (never the
    fresh-prompt attention kernel), baseline (both: the engine without either change). The
    switches are the live backend's and layers' copies of the engine's KernelTuning fields."""
    attention, layers = b.eng.runner.attention, list(b.eng.runner.model.model.layers)
    # (the torch backend, --smoke's, has no prefill kernels to switch: the switch does nothing there)
    start = getattr(attention, "fresh_prefill", False), layers[0].residual_gemm_min_rows
    try:
        for total in (S(32768), S(PEER_PREFILL_TOKENS)):
            for L in map(S, PEER_PREFILL_LENS):
                for variant in PREFILL_VARIANTS:
                    attention.fresh_prefill = start[0] and variant not in ("paged", "baseline")
                    off = variant in ("norm-adds", "baseline")
                    for layer in layers:
                        layer.residual_gemm_min_rows = 1 << 62 if off else start[1]
                    prefill_run(b, total, L, "" if variant == "default" else f" [{variant}]")
    finally:
        attention.fresh_prefill = start[0]
        for layer in layers:
            layer.residual_gemm_min_rows = start[1]


def part_behind(b: Bench) -> None:
    """Prompt tok/s of chunks behind a cached prefix (module docstring), per attention kernel."""
    attention, sched = b.eng.runner.attention, b.eng.scheduler
    start = getattr(attention, "fresh_prefix", False), sched.max_num_batched_tokens   # (torch: none)
    try:
        for _ in range(2):
            for kernel, on in (("fresh kernel", True), ("v2", False)):
                attention.fresh_prefix = start[0] and on
                sched.max_num_batched_tokens = S(2048)
                n, L = 4, S(8192)
                for _ in range(n):
                    b.add(b.prompt(L), 1)
                dt = timed_drain(b)
                row(f"chunked prefill {n} x {L}, budget {S(2048)} [{kernel}]", f"{n * L / dt:.0f} tok/s", f"{dt:.2f} s")
                sched.max_num_batched_tokens = start[1]
                n, P, L = 32, S(1536), S(512)
                firsts = [b.prompt(P) for _ in range(n)]
                for p in firsts:                              # the first turn: fills the prefix cache
                    b.add(p, 1)
                b.drain()
                for p in firsts:
                    b.add(p + b.prompt(L), 1)
                hits0 = sched.block_manager.prefix_hit_tokens
                dt = timed_drain(b)
                hits = sched.block_manager.prefix_hit_tokens - hits0
                row(f"prefix hits {n} x {L} behind {P} [{kernel}]", f"{n * L / dt:.0f} tok/s",
                    f"{dt:.2f} s; {hits} prompt tokens from the prefix cache")
    finally:
        attention.fresh_prefix, sched.max_num_batched_tokens = start


def timed_drain(b: Bench) -> float:
    """Seconds to run every queued request to the end, the GPU idle at both ends."""
    sync()
    t = time.perf_counter()
    b.drain()
    sync()
    return time.perf_counter() - t


def prefill_run(b: Bench, total: int, L: int, label: str) -> None:
    """One prefill line: total // L prompts of L tokens, one token out each."""
    n_req = max(1, total // L)
    for _ in range(n_req):
        b.add(b.prompt(L), 1)
    dt = timed_drain(b)
    peer = " (vLLM's workload)" if total == S(PEER_PREFILL_TOKENS) else ""
    row(f"prefill L={L} x{n_req}{peer}{label}", f"{n_req * L / dt:.0f} tok/s", f"{dt:.2f} s")


def part_sharegpt(b: Bench, seconds: float, label: str = "") -> None:
    rng = random.Random(1)

    def lognormal(mean, sigma, lo, hi):
        return int(min(hi, max(lo, rng.lognormvariate(math.log(mean) - sigma ** 2 / 2, sigma))))

    if SHAREGPT_WORKLOAD == "vllm":       # the very requests of vLLM's peer run (bench/offline_bench.py)
        reqs = [(S(i) if SMOKE else i, o) for i, o in vllm_peer_sharegpt_lengths(S(1000))]
    else:
        reqs = [(lognormal(200, 1.0, 4, 2048), lognormal(180, 1.0, 4, 1024)) for _ in range(S(1000))]
    for p, o in reqs:
        b.add(b.prompt(p), o, temperature=SHAREGPT_TEMPERATURE)
    steps = StepKinds(b.eng)
    alloc0 = alloc_counters()
    t, deadline = time.perf_counter(), time.time() + seconds
    try:
        n_out = b.drain(deadline=deadline)
    finally:
        steps.restore()
    dt = time.perf_counter() - t
    in_tok = sum(p for p, _ in reqs)
    done = time.time() <= deadline           # drain aborts what is left at the deadline
    total = (n_out + in_tok) / dt if done else float("nan")
    row("sharegpt 1000 reqs" + label + ("" if done else " (time-boxed)"),
        f"{total:.0f} total tok/s" if done else f"{n_out / dt:.0f} out tok/s",
        f"{n_out / dt:.0f} out tok/s, {dt:.1f} s, in {in_tok} / out {n_out} tokens, temperature {SHAREGPT_TEMPERATURE}")
    row("sharegpt steps" + label, steps.summary(dt), "step kinds: count, wall share, mean rows/tokens")
    alloc1 = alloc_counters()
    if alloc1:
        row("sharegpt allocator" + label, ", ".join(f"{k} +{alloc1[k] - alloc0.get(k, 0)}" for k in alloc1),
            "torch CUDA caching allocator counters over the run (device mallocs/frees synchronize)")
    row("sharegpt rows" + label, steps.by_rows(), "per kind and rows bucket, ms per step: wall; device "
        "(forward) and device idle (CUDA events); host schedule/build/forward/sample/settle; GC pauses")
    row("sharegpt gc" + label, steps.gc.summary(), "Python cyclic-GC collections during the run")


def alloc_counters() -> dict[str, int]:
    if SMOKE or not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams", "num_ooms")
    return {k: int(stats[k]) for k in keys if k in stats}


class GcPauses:
    """Python's cyclic-GC collections while installed (gc.callbacks): count and seconds per
    generation, and `total` (seconds so far) so that StepKinds can charge pauses to steps."""

    def __init__(self):
        import gc
        self._gc, self.total, self._t0 = gc, 0.0, 0.0
        self.by_gen: dict[int, list] = {}               # generation -> [collections, seconds, max]
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        dt = time.perf_counter() - self._t0
        self.total += dt
        g = self.by_gen.setdefault(info["generation"], [0, 0.0, 0.0])
        g[0], g[1], g[2] = g[0] + 1, g[1] + dt, max(g[2], dt)

    def remove(self) -> None:
        self._gc.callbacks.remove(self._callback)

    def summary(self) -> str:
        frozen = self._gc.get_freeze_count()
        gens = ", ".join(f"gen{g}: {n} x {1e3 * t / n:.2f} ms (max {1e3 * m:.1f})"
                         for g, (n, t, m) in sorted(self.by_gen.items())) or "none"
        return f"{gens}; total {1e3 * self.total:.0f} ms; {frozen} objects frozen"


class StepKinds:
    """Where a run's wall time goes by step kind: each engine.step is charged to the kind of the
    forward it launched (pure decode, or mixed/prefill), with its rows and tokens.

    On a GPU each step also gets three CUDA events, recorded as the host enqueues: before its
    forward (a), after it (b), after the sampler's draw (c). An event fires when the GPU reaches
    it, so c - a is the step's device time and b - a its forward's, as long as the host enqueues
    ahead of the GPU (graph replays; an eager step whose launches trail the GPU counts that
    stall too); a of step k+1 - c of step k is device idle: host work between the launches that
    one-step-ahead scheduling did not hide. The host's own time per phase (schedule, build,
    forward launch, sampler launch, settle = reading the previous step back and applying it)
    comes from perf_counter. `by_rows` reports them per row bucket."""

    BUCKETS = (16, 64, 128, 256, 512, 1024, 1 << 30)
    PHASES = ("schedule", "build", "forward", "sample", "settle")

    def __init__(self, eng):
        self.eng = eng
        self._cur = None
        self.steps: list[dict] = []
        cuda = not SMOKE and torch.cuda.is_available()
        self._event = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else (lambda: None)
        self._saved = []
        self.gc = GcPauses()
        self._wrap(eng.scheduler, "schedule", "schedule")
        self._wrap(eng.batch_builder, "build", "build")
        self._wrap(eng.runner, "forward", "forward", before="a", after="b", tag=True)
        self._wrap(eng.sampler, "_choose", "sample", after="c")
        self._wrap(eng, "_settle", "settle")
        step = eng.step

        def timed_step():
            self._maybe_profile()
            self._cur = cur = {"kind": "idle", "rows": 0, "tokens": 0}
            t0, gc0 = time.perf_counter(), self.gc.total
            out = step()
            cur["wall"] = time.perf_counter() - t0
            cur["gc"] = self.gc.total - gc0
            self.steps.append(cur)
            return out

        self._saved.append((eng, "step"))
        eng.step = timed_step

    # --live-profile [KIND:]LO:HI[:MINROWS]: torch.profiler over 6 live steps once a step of KIND
    # (decode, the default: LO..HI rows; mixed: LO..HI tokens and at least MINROWS rows) ran, in
    # the first run only (`profiled`, class-wide: the later runs of the process stay unperturbed)
    _prof, _prof_steps, _prof_done = None, 0, False
    profiled = False

    def _maybe_profile(self) -> None:
        if LIVE_PROFILE is None or self._prof_done or not self.steps or (StepKinds.profiled and self._prof is None):
            return
        if self._prof is None:
            last = self.steps[-1]
            kind, lo, hi, min_rows = LIVE_PROFILE
            size = last["tokens" if kind == "mixed" else "rows"]
            if last["kind"] == kind and lo <= size <= hi and last["rows"] >= min_rows:
                from torch.profiler import ProfilerActivity, profile
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
                self._prof = profile(activities=acts)
                self._prof.__enter__()
                self._trigger = last
            return
        self._prof_steps += 1
        if self._prof_steps == 6:
            self._finish_profile()

    def _finish_profile(self) -> None:
        """Stop the live profiler and log its tables (also when the run ended before 6 steps)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        self._prof_done = StepKinds.profiled = True
        ka = self._prof.key_averages()
        last = self._trigger                 # the step whose kind and size started the profile
        text = (f"live profile, {self._prof_steps} steps after a {last['kind']} step of ~{last['rows']} rows / "
                f"{last['tokens']} tokens, by host self time:\n" + ka.table(sort_by="self_cpu_time_total", row_limit=22)
                + "\nby device time:\n" + ka.table(sort_by="self_device_time_total", row_limit=30))
        log(text)
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"live_profile_{last['kind']}_{last['tokens']}tok.txt").write_text(text)

    def _wrap(self, obj, name: str, phase: str, before: str = "", after: str = "", tag: bool = False) -> None:
        fn = getattr(obj, name)

        def inner(*args, **kw):
            cur = self._cur if self._cur is not None else {}
            if tag:
                batch = args[0]
                cur.update(kind="decode" if batch.is_pure_decode else "mixed", rows=batch.num_seqs,
                           tokens=batch.num_tokens)
            if before and (ev := self._event()) is not None:
                ev.record()
                cur[before] = ev
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            cur[phase] = cur.get(phase, 0.0) + time.perf_counter() - t0
            if after and (ev := self._event()) is not None:
                ev.record()
                cur[after] = ev
            return out

        self._saved.append((obj, name))
        setattr(obj, name, inner)

    def restore(self) -> None:
        if self._prof is not None and not self._prof_done:    # a profiler still running: stop it
            self._finish_profile()
        for obj, name in self._saved:
            delattr(obj, name)                      # back to the class's methods
        self._saved = []
        self.gc.remove()

    def summary(self, wall: float) -> str:
        kinds: dict[str, list] = {}                        # kind -> [steps, seconds, rows, tokens]
        for st in self.steps:
            k = kinds.setdefault(st["kind"], [0, 0.0, 0, 0])
            k[0], k[1], k[2], k[3] = k[0] + 1, k[1] + st["wall"], k[2] + st["rows"], k[3] + st["tokens"]
        return "; ".join(f"{kind} {n} steps {100 * t / wall:.0f}% {1e3 * t / n:.1f} ms/step "
                         f"{rows / n:.0f} rows {toks / n:.0f} tok"
                         for kind, (n, t, rows, toks) in sorted(kinds.items()))

    def trace(self) -> list[list]:
        """One [kind, rows, tokens, wall ms, device ms] per step (device: CUDA events, else -1)."""
        if any("c" in st for st in self.steps):
            torch.cuda.synchronize()
        return [[st["kind"], st["rows"], st["tokens"], round(1e3 * st["wall"], 3),
                 round(st["a"].elapsed_time(st["c"]), 3) if "a" in st and "c" in st else -1]
                for st in self.steps]

    def by_rows(self) -> str:
        """Per (kind, rows bucket), ms per step: wall; device (forward) and device idle (CUDA);
        host per phase."""
        timed = any("c" in st for st in self.steps)
        if timed:
            torch.cuda.synchronize()
        acc: dict[tuple[str, int], dict[str, float]] = {}
        prev_c = None
        for st in self.steps:
            size = st["tokens"] if st["kind"] == "mixed" else st["rows"]   # a mixed step's cost follows its tokens
            top = next(b for b in self.BUCKETS if size <= b)
            a = acc.setdefault((st["kind"], top), {"n": 0})
            a["n"] += 1
            for key in ("wall", "gc") + self.PHASES:
                a[key] = a.get(key, 0.0) + st.get(key, 0.0)
            if "a" in st and "c" in st:
                a["dev"] = a.get("dev", 0.0) + st["a"].elapsed_time(st["c"]) / 1e3
                a["fwd"] = a.get("fwd", 0.0) + st["a"].elapsed_time(st["b"]) / 1e3
                if prev_c is not None:
                    a["idle"] = a.get("idle", 0.0) + max(0.0, prev_c.elapsed_time(st["a"]) / 1e3)
            prev_c = st.get("c", prev_c)
        parts = []
        for (kind, top), a in sorted(acc.items()):
            n = a["n"]
            unit = " tok" if kind == "mixed" else ""
            label = f"{kind}{unit} <={top}" if top < self.BUCKETS[-1] else f"{kind}{unit} >{self.BUCKETS[-2]}"
            ms = lambda key: 1e3 * a.get(key, 0.0) / n     # noqa: E731
            dev = f", dev {ms('dev'):.1f} (fwd {ms('fwd'):.1f}) idle {ms('idle'):.2f}" if timed else ""
            host = "/".join(f"{ms(p):.1f}" for p in self.PHASES)
            parts.append(f"{label}: {n} x {ms('wall'):.1f} wall{dev}, host {host}, gc {ms('gc'):.2f}")
        return "; ".join(parts)


def part_closedloop(b: Bench, seconds: float) -> None:
    """The serving benchmark's concurrency-64 run (`bench/serve_bench.py`: 640 requests of 1,024 in
    / 128 out, 64 in flight) on the engine alone, once per step token budget in
    --closedloop-budgets: how the budget trades prefill batching against mixing decode rows into
    prefill steps, without a stack restart per setting. Total tok/s, p99 inter-token gap, TTFT.
    --closedloop-kernel-ab: each also with chunks behind a cached prefix on paged_prefill_attention's
    v2 instead of fresh_prefill_attention (the backend's fresh_prefix off)."""
    attention = b.eng.runner.attention
    start_prefix = getattr(attention, "fresh_prefix", False)        # (the torch backend: none)
    sched = b.eng.scheduler
    saved = sched.max_num_seqs, sched.admit_group, sched.max_num_batched_tokens, b.eng.async_scheduling
    n_req, conc, n_in, n_out = S(640), min(64, S(640)), S(1024), S(128)
    end = time.time() + seconds
    try:
        sched.max_num_seqs, sched.admit_group = conc, conc
        b.eng.async_scheduling = True
        variants = [(" eager mixed", ("piecewise_graphs",)), ("", ())] if CLOSEDLOOP_PIECEWISE_AB else [("", ())]
        kernels = [("", True), (" [v2 behind a prefix]", False)] if CLOSEDLOOP_KERNEL_AB else [("", True)]
        runs = [(bu, v, k) for bu in CLOSEDLOOP_BUDGETS for v in variants for k in kernels]
        for budget, (suffix, hidden), (kernel, fresh_prefix) in runs:
            label = f"closed-loop c{conc} budget={budget}{suffix}{kernel}"
            if time.time() > end - 5:
                row(label, "SKIPPED", "time budget")
                continue
            attention.fresh_prefix = start_prefix and fresh_prefix
            with graphs_off(b.eng.runner, *hidden):
                closed_loop_run(b, label, budget, n_req, conc, n_in, n_out, end)
    finally:
        attention.fresh_prefix = start_prefix
        sched.max_num_seqs, sched.admit_group, sched.max_num_batched_tokens, b.eng.async_scheduling = saved
        b.eng.step()


def closed_loop_run(b: Bench, label: str, budget: int, n_req: int, conc: int, n_in: int, n_out: int,
                    end: float) -> None:
    """One closed-loop run at this step token budget: conc requests in flight until n_req have
    finished (or `end`); the row reports total tok/s, inter-token gaps and TTFT."""
    b.eng.scheduler.max_num_batched_tokens = budget
    sent, arrive, first, last, gaps, done = 0, {}, {}, {}, [], 0
    steps = StepKinds(b.eng)
    t0 = time.perf_counter()
    try:
        while done < n_req and time.time() < end:
            while sent < n_req and sent - done < conc:
                arrive[b.add(b.prompt(n_in), n_out)] = time.perf_counter()
                sent += 1
            deltas = b.eng.step()
            now = time.perf_counter()
            for d in deltas:
                rid = d.request_id
                if rid in last:
                    gaps.append(now - last[rid])
                else:
                    first[rid] = now - arrive[rid]
                last[rid] = now
                done += d.finish_reason is not None
    finally:
        steps.restore()
    dt = time.perf_counter() - t0
    row(label + " steps", steps.summary(dt), "step kinds: count, wall share, mean rows/tokens")
    row(label + " rows", steps.by_rows(), "per kind and rows (decode) or tokens (mixed) bucket, ms per "
        "step: wall; device (forward) and device idle (CUDA events); host schedule/build/forward/sample/settle")
    OUT.mkdir(parents=True, exist_ok=True)
    slug = label.replace("closed-loop ", "").replace(" ", "_").replace("=", "")
    (OUT / f"closedloop_trace_{slug}.json").write_text(json.dumps(steps.trace()))
    for r in list(b.eng.requests):
        b.eng.abort_request(r)
    b.drain()
    gaps.sort()
    ttft = sorted(first.values())
    p99 = gaps[int(0.99 * (len(gaps) - 1))] if gaps else float("nan")
    row(label + ("" if done == n_req else " (time-boxed)"), f"{done * (n_in + n_out) / dt:.0f} total tok/s",
        f"{done} requests {n_in}/{n_out} in {dt:.1f} s; p99 ITL {1e3 * p99:.1f} ms, median ITL "
        f"{1e3 * gaps[len(gaps) // 2] if gaps else float('nan'):.1f} ms; median TTFT "
        f"{1e3 * ttft[len(ttft) // 2] if ttft else float('nan'):.0f} ms")


def part_fp8ops(_b=None) -> None:
    """One linear layer of the 8B at decode sizes: bf16 cuBLAS vs fp8 _scaled_mm (per-token
    quantization + cuBLASLt) vs the weight-only fp8 GEMV. Each variant loops over enough weight
    copies (> 4x the 50 MB L2) inside one CUDA graph, so neither the cache nor launches count."""
    if SMOKE:
        return
    import torch.nn.functional as F
    from gpu_worker.kernels.fp8_linear import fp8_linear, quantize_weight_fp8
    from gpu_worker.kernels.fp8_gemv import w8_gemv, w8_gemv_ref
    shapes = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    for name, (N, K) in shapes.items():
        copies = max(2, math.ceil(240e6 / (N * K * 2)))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        qs = [quantize_weight_fp8(w) for w in ws]
        for M in (1, 4):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = w8_gemv_ref(x, qs[0].weight, qs[0].scale).float()
            err = float((w8_gemv(x, qs[0].weight, qs[0].scale).float() - ref).norm() / ref.norm())
            variants = {"bf16": lambda w, q: F.linear(x, w), "fp8 scaled_mm": lambda w, q: fp8_linear(x, q),
                        "fp8 gemv": lambda w, q: w8_gemv(x, q.weight, q.scale),
                        "bf16 gemv": lambda w, q: w8_gemv(x, w, None)}
            us = {}
            for vname, fn in variants.items():
                for w, q in zip(ws, qs):
                    fn(w, q)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(3):
                        for w, q in zip(ws, qs):
                            fn(w, q)
                us[vname] = event_median_ms(g.replay, 10, warmup=1) * 1e3 / (3 * copies)
                del g
            tb = {k: (N * K * (2 if k.startswith("bf16") else 1)) / (v * 1e-6) / 1e12 for k, v in us.items()}
            row(f"fp8ops {name} {N}x{K} M={M}", " / ".join(f"{v:.1f}" for v in us.values()) + " us",
                "bf16 / fp8 scaled_mm / fp8 gemv / bf16 gemv; weight TB/s " + " / ".join(f"{v:.2f}" for v in tb.values())
                + f"; gemv rel err {err:.1e}")
        del ws, qs
        torch.cuda.empty_cache()


def make_engine(model_dir: Path, args, extra: dict, label: str = "", **kw):
    from gpu_worker.config import EngineConfig
    from gpu_worker.engine import Engine
    t = time.time()
    # Graphs are captured up to min(cuda_graph_max_bs, max_num_seqs): the engine is made wide
    # enough for the widest run asked for, and the scheduler capped at 256 for the standard parts.
    wide = max([256, args.graph_max_bs] + [int(n) for n in filter(None, args.sharegpt_seqs.split(","))])
    eng = Engine(EngineConfig(model=str(model_dir), max_num_seqs=wide, max_num_batched_tokens=args.max_num_batched_tokens,
                              max_model_len=S(16384), cuda_graph_max_bs=args.graph_max_bs,
                              piecewise_graph_max_tokens=args.piecewise_max_tokens, **extra, **kw))
    eng.scheduler.max_num_seqs, eng.scheduler.admit_group = 256, 256 // 8
    if SMOKE:   # the CPU stand-in of graphs (EagerReplay): exercises the parity part
        eng.runner.capture_cuda_graphs(8, eng.max_model_len)
        eng.runner.capture_prefill_graphs(64, eng.max_model_len)
        eng.runner.capture_piecewise_graphs(128)
    graphs = [getattr(eng.runner, name, None)
              for name in ("decode_graphs", "short_decode_graphs", "prefill_graphs", "piecewise_graphs")]
    graphs = [g for g in graphs if g is not None]
    row("engine load" + label, f"{time.time() - t:.1f} s",
        f"{eng.block_manager.num_blocks} KV blocks; {'; '.join(g.capture_times.summary() for g in graphs) or 'no graphs'}; "
        f"fused kernels {eng.runner.model.model.norm.kernels is not None}")
    eng.async_scheduling = args.async_scheduling
    b = Bench(eng)
    # warm-up: compile prefill, mixed and decode kernel variants outside the timings
    b.add(b.prompt(S(1000)), 8)
    b.add(b.prompt(20), 8)
    b.drain()
    if FREEZE_GC:
        eng.freeze_gc()          # as the worker does once its engine is up
    log("warm-up done")
    return eng, b


def run_parts(b, parts, names: set[str], end: float, label: str = "") -> None:
    for name, fn, need in parts:
        if name not in names:
            continue
        if end - time.time() < need:
            row(name + label, "SKIPPED", "time budget")
            continue
        try:
            fn(b)
        except Exception as e:   # one broken part must not lose the others
            row(name + label, f"ERROR {type(e).__name__}: {e}"[:160])
            traceback.print_exc()
            if b is not None:
                for r in list(b.eng.requests):
                    b.eng.abort_request(r)


def part_fp8_decode1(b: Bench) -> None:
    decode1(b, 128, S(256), " fp8")
    decode1(b, S(8192), S(160), " fp8")


def part_fp8_async(b: Bench) -> None:
    b.eng.async_scheduling = True
    try:
        decode1(b, 128, S(256), " fp8 async")
    finally:
        b.eng.async_scheduling = ASYNC_DEFAULT
        b.eng.step()


def part_fp8_decodeB(b: Bench) -> None:
    part_decodeB(b, sizes=(S(256),))      # row() adds the " fp8" suffix while the fp8 engine runs


def part_sharegpt_async(b: Bench, seconds: float) -> None:
    b.eng.async_scheduling = True
    try:
        part_sharegpt(b, seconds, " async")
    finally:
        b.eng.async_scheduling = ASYNC_DEFAULT
        b.eng.step()


def part_sharegpt_wide(b: Bench, seconds: float, max_num_seqs: int) -> None:
    """ShareGPT async with more concurrent sequences than the standard parts' 256 (vLLM's offline
    LLM defaults to 1024 on 80+ GB GPUs): the scheduler's cap is a plain attribute; decode batches
    past --graph-max-bs run eagerly. A/B variants of the same engine, before the plain run:
    --sharegpt-graph-cap C hides the graphs above C rows (those steps eager); --sharegpt-gc-ab
    runs once with the GC heap unfrozen (Engine.freeze_gc undone)."""
    import gc
    sched = b.eng.scheduler
    saved = sched.max_num_seqs, sched.admit_group
    sched.max_num_seqs, sched.admit_group = max_num_seqs, max(1, max_num_seqs // 8)
    graphs = b.eng.runner.decode_graphs
    variants = [(f" graphs<={c}", c, False) for c in SHAREGPT_GRAPH_CAPS
                if graphs is not None and c < graphs.sizes[-1]]
    if SHAREGPT_GC_AB and FREEZE_GC:
        variants.append((" gc unfrozen", 0, True))
    variants.append(("", 0, False))
    try:
        b.eng.async_scheduling = True
        for suffix, cap, unfreeze in variants:
            all_sizes = graphs.sizes if graphs is not None else None
            if cap:
                graphs.sizes = [n for n in all_sizes if n <= cap]
            if unfreeze:
                gc.unfreeze()
            try:
                part_sharegpt(b, seconds / len(variants), f" async max_num_seqs={max_num_seqs}{suffix}")
            finally:
                if graphs is not None:
                    graphs.sizes = all_sizes
                if unfreeze:
                    gc.collect()
                    gc.freeze()
    finally:
        b.eng.async_scheduling = ASYNC_DEFAULT
        b.eng.step()
        sched.max_num_seqs, sched.admit_group = saved


# ---------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default="/tmp/m8b")
    ap.add_argument("--budget", type=float, default=420, help="seconds for the whole run")
    ap.add_argument("--skip", default="", help="comma list of parts to skip")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks this script only")
    ap.add_argument("--sharegpt-temperature", type=float, default=1.0)
    ap.add_argument("--sharegpt-workload", choices=("vllm", "lognormal"), default="vllm",
                    help="vllm: the 1,000 lengths of vLLM's peer run, offline_bench.py (mean 211 in / 182 "
                         "out); lognormal: this script's older draw (mean ~193 in / ~165 out)")
    ap.add_argument("--sharegpt-seqs", default="", help="comma list of max_num_seqs values for extra "
                    "ShareGPT async runs (e.g. 512,1024; the other parts run with 256)")
    ap.add_argument("--graph-max-bs", type=int, default=512, help="cuda_graph_max_bs of the engine: decode "
                    "batches up to this size replay CUDA graphs (the ShareGPT runs past 256 need it)")
    ap.add_argument("--sharegpt-graph-cap", default="", help="comma list: the --sharegpt-seqs runs also "
                    "run with decode graphs above this many rows hidden (an A/B of graph width)")
    ap.add_argument("--profile-cases", default="", help="the profile part's decode cases, B:ctx[:short] "
                    "comma-separated (default 1:128:short,1:8192,128:256 and an 8 x 2k prefill; given: only these)")
    ap.add_argument("--profile-prefill-lens", default="2048", help="the profile part's prefill prompt lengths, "
                    "comma-separated: one full step (max_num_batched_tokens) of prompts of each length")
    ap.add_argument("--live-profile", default="", help="[KIND:]LO:HI[:MINROWS]: the ShareGPT and closed-loop "
                    "runs profile (torch.profiler, host and device) 6 live steps after the first step of KIND "
                    "(decode, the default: LO..HI rows; mixed: LO..HI tokens; at least MINROWS rows), also to $OUT/live_profile_*.txt")
    ap.add_argument("--no-freeze-gc", action="store_true", help="leave the GC heap unfrozen after "
                    "warm-up (the worker freezes it: Engine.freeze_gc)")
    ap.add_argument("--sharegpt-gc-ab", action="store_true", help="the --sharegpt-seqs runs also run "
                    "once with the GC heap unfrozen (an A/B of Engine.freeze_gc)")
    ap.add_argument("--piecewise-max-tokens", type=int, default=0, help="the engine's "
                    "piecewise_graph_max_tokens (0, the engine's default: mixed steps run eagerly; 2048: "
                    "graphs around eager attention for steps of up to 2,048 tokens)")
    ap.add_argument("--closedloop-piecewise-ab", action="store_true", help="each closed-loop budget also "
                    "runs with the piecewise graphs hidden (mixed steps eager) first")
    ap.add_argument("--closedloop-kernel-ab", action="store_true", help="each closed-loop run also with chunks "
                    "behind a cached prefix on paged_prefill_attention's v2 (KernelTuning.fresh_prefix off)")
    ap.add_argument("--closedloop-budgets", default="1536", help="comma list of step token budgets "
                    "(max_num_batched_tokens) for the closed-loop part")
    ap.add_argument("--prefill-variants", default="default", help="comma list: the prefill part once per "
                    "variant: default, norm-adds (residual adds in the norms), paged (no fresh-prompt attention kernel), "
                    "baseline (both)")
    ap.add_argument("--fp8-reserve", type=float, default=50, help="seconds kept for the fp8 engine")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"), help="the engines' KV cache "
                    "(fp8: e4m3, half the bytes the decode attention reads; e.g. a closed-loop A/B across two runs)")
    ap.add_argument("--fp8", default="", help="comma list: fp8ops (layer microbench, first), and parts run "
                    "afterwards on a second engine with quantization='fp8': parity,decode1,async,prefill,decodeB")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="run every part with async_scheduling on (part 'async' compares it anyway)")
    args = ap.parse_args()
    end = T0 + args.budget
    global SMOKE, ASYNC_DEFAULT, ROW_SUFFIX, SHAREGPT_TEMPERATURE, SHAREGPT_WORKLOAD, CLOSEDLOOP_BUDGETS
    global PROFILE_CASES_ONLY, LIVE_PROFILE, FREEZE_GC, SHAREGPT_GC_AB, CLOSEDLOOP_PIECEWISE_AB, CLOSEDLOOP_KERNEL_AB
    CLOSEDLOOP_BUDGETS = [int(x) for x in args.closedloop_budgets.split(",") if x]
    SHAREGPT_GRAPH_CAPS[:] = [int(x) for x in args.sharegpt_graph_cap.split(",") if x]
    FREEZE_GC, SHAREGPT_GC_AB = not args.no_freeze_gc, args.sharegpt_gc_ab
    CLOSEDLOOP_PIECEWISE_AB, CLOSEDLOOP_KERNEL_AB = args.closedloop_piecewise_ab, args.closedloop_kernel_ab
    if args.live_profile:
        spec = args.live_profile.split(":")
        kind = spec.pop(0) if not spec[0].isdigit() else "decode"
        LIVE_PROFILE = (kind, int(spec[0]), int(spec[1]), int(spec[2]) if len(spec) > 2 else 0)
    if args.profile_cases:
        PROFILE_CASES[:], PROFILE_CASES_ONLY = args.profile_cases.split(","), True
    PROFILE_PREFILL_LENS[:] = [int(x) for x in args.profile_prefill_lens.split(",") if x.strip()]
    PREFILL_VARIANTS[:] = [x for x in args.prefill_variants.split(",") if x.strip()]
    if not PREFILL_VARIANTS or set(PREFILL_VARIANTS) - {"default", "norm-adds", "paged", "baseline"}:
        ap.error(f"--prefill-variants {args.prefill_variants!r}: a comma list of default, norm-adds, paged, baseline")
    SMOKE, ASYNC_DEFAULT = args.smoke, args.async_scheduling
    SHAREGPT_TEMPERATURE, SHAREGPT_WORKLOAD = args.sharegpt_temperature, args.sharegpt_workload
    extra = {}
    if SMOKE:
        from gpu_worker.make_model import make_model
        model_dir = Path(args.model_dir)
        if not (model_dir / "config.json").exists():
            make_model(model_dir, arch="llama", size="tiny", progress=False)
        extra = dict(device="cpu", dtype="float32", attention_backend="torch", num_gpu_blocks=4096)
        torch.set_num_threads(1)
    else:
        log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        model_dir = ensure_model(Path(args.model_dir))
        extra = dict(dtype="bfloat16", gpu_memory_utilization=0.88)
    extra["kv_cache_dtype"] = args.kv_cache_dtype

    if "fp8ops" in set(filter(None, args.fp8.split(","))):
        run_parts(None, [("fp8ops", part_fp8ops, 10)], {"fp8ops"}, end)
    eng, b = make_engine(model_dir, args, extra)

    parts = [("parity", part_parity, 30), ("decode1", part_decode1, 20), ("decodeB", part_decodeB, 30),
             ("async", part_async, 25), ("prefill", part_prefill, 20), ("behind", part_behind, 15),
             ("ablation", part_ablation, 20),
             ("profile", part_profile, 15), ("ttft", part_ttft, 10),
             ("hostprof", part_hostprof, 10)]
    skip = set(filter(None, args.skip.split(",")))
    run_parts(b, parts, {name for name, _, _ in parts} - skip, end)
    fp8_parts = set(filter(None, args.fp8.split(","))) - {"fp8ops"}
    fp8_reserve = args.fp8_reserve if fp8_parts else 0      # the fp8 engine's load + parts
    wide = [(f"sharegpt_{n}", lambda b_, sec, n=n: part_sharegpt_wide(b_, sec, n))
            for n in map(int, filter(None, args.sharegpt_seqs.split(",")))]
    for name, fn in (("sharegpt", part_sharegpt), ("sharegpt_async", part_sharegpt_async), *wide,
                     ("closedloop", part_closedloop)):
        if name not in skip and end - time.time() - fp8_reserve > 30:
            try:
                fn(b, end - time.time() - fp8_reserve - 15)
            except Exception as e:
                row(name, f"ERROR {type(e).__name__}: {e}"[:160])
                traceback.print_exc()
                for r in list(eng.requests):
                    eng.abort_request(r)
    if fp8_parts and end - time.time() > 25:
        eng.close()              # unfreezes the GC heap, so the engine's cycles can go
        del b, eng
        import gc
        gc.collect()
        if not SMOKE:
            torch.cuda.empty_cache()
        ROW_SUFFIX = " fp8"
        eng, b = make_engine(model_dir, args, extra, quantization="fp8")
        run_parts(b, [("decode1", part_fp8_decode1, 8), ("async", part_fp8_async, 5),
                      ("prefill", part_prefill, 8), ("parity", part_parity, 12),
                      ("decodeB", part_fp8_decodeB, 10)], fp8_parts, end, " fp8")

    print("\n" + "=" * 110)
    for metric, value, note in ROWS:
        print(f"{metric:40s} | {value:>20s} | {note}")
    print(f"total {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
