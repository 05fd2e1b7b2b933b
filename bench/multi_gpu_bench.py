"""Multi-GPU benchmark: tensor parallelism (TP=2 vs TP=1) and MoE expert parallelism (EP=2).

Needs 2 GPUs of one host (device kind nvidia-h200-x2); one call builds, checks and times:

    python bench/multi_gpu_bench.py                      # both sections
    python bench/multi_gpu_bench.py --sections tp        # Llama-3.1-8B TP=2 vs TP=1 only
    python bench/multi_gpu_bench.py --smoke              # CPU + gloo, tiny models: tests this script

One device call may run 600 s: run the sections in separate calls if both do not fit
(--time-budget stops starting new runners in time; the JSON keeps what ran).

Sections (each guarded: one failure is recorded and the next section runs):
  tp   random-weight Llama-3.1-8B (kvmesh make-model, bf16) through ModelRunner (TP=1) and
       TPModelRunner (TP=2, rank 1 a child process on GPU 1): parity of the logits of one batch
       (rel. error, greedy agreement), batch-1 decode ms/token at a 1k context, batched decode
       tok/s (64 seqs), prefill tok/s (one 4k prompt). Eager mode (no CUDA graphs), the same
       attention backend in both.
  moe  random-weight Qwen3-MoE (Qwen3-30B-A3B layer shapes, fewer layers; make-model --arch
       qwen3_moe --size 8b): EP=1 (one GPU) vs EP=2 (experts split over 2 GPUs, all-to-all
       dispatch/combine) vs MoE-TP=2 (every expert split): parity, batched decode and prefill
       throughput.
Single-GPU sections (run on any one GPU; not in the default list):
  gemm  the MoE grouped GEMM at Qwen3-30B-A3B expert shapes (128 experts, 2048 -> 2x768, bf16):
       torch grouped_mm vs the Triton kernel vs the per-expert loop: rel. error and time
  moe1 the Qwen3-MoE model (--moe1-size, default 1b) on one GPU in bf16 against Hugging Face
       transformers on the same weights (rel. error of the logits, greedy agreement), and its
       decode / prefill throughput

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1): set here before torch loads, inherited by the rank processes (which
also set them themselves). Results: stdout as they come, a table last, $OUT/multi_gpu_bench.json.
"""
from __future__ import annotations

import os

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_k] = _v           # before torch / NCCL load, and for every child process

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from anywhere in the repo

import torch  # noqa: E402

T0 = time.time()
ROWS: list[tuple[str, str, str]] = []
RESULTS: dict = {"sections": {}, "errors": {}, "env": {}}
BLOCK = 16
DEADLINE = float("inf")     # time.time() past which no new runner is built (--time-budget)
RUN_SECONDS = 90.0          # what one runner's build + measure may take, for that check


class OutOfTime(Exception):
    pass


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def row(section: str, metric: str, value, unit: str = "") -> None:
    text = value if isinstance(value, str) else f"{value:.4g} {unit}".strip()
    ROWS.append((section, metric, text))
    RESULTS["sections"].setdefault(section, {})[metric] = {"value": value, "unit": unit}
    log(f"{section:4s} {metric:52s} {text}")


def save(out_dir: Path) -> None:
    (out_dir / "multi_gpu_bench.json").write_text(json.dumps(RESULTS, indent=2, default=str))


# ---- batches -----------------------------------------------------------------------------
class Pages:
    """A trivial block allocator: sequence i's blocks are consecutive, after sequence i-1's."""

    def __init__(self, num_seqs: int, max_len: int):
        self.per_seq = -(-max_len // BLOCK)
        self.num_blocks = num_seqs * self.per_seq

    def table(self, i: int) -> list[int]:
        return list(range(i * self.per_seq, (i + 1) * self.per_seq))


def make_batch(tokens: list[list[int]], done: list[int], pages: Pages, device: str):
    """Every sequence's tokens [done[i], len) in one ragged batch; logits of each last row."""
    from gpu_worker.forward_batch import ForwardBatch
    ids, pos, slots, qlens, clens, last = [], [], [], [], [], []
    for i, (toks, d) in enumerate(zip(tokens, done)):
        table = pages.table(i)
        for p in range(d, len(toks)):
            ids.append(toks[p]); pos.append(p); slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
        qlens.append(len(toks) - d); clens.append(len(toks)); last.append(len(ids) - 1)
    t = lambda x, dt=torch.int64: torch.tensor(x, dtype=dt)   # noqa: E731
    i32 = torch.int32
    batch = ForwardBatch(
        input_ids=t(ids), positions=t(pos), query_lens=t(qlens, i32), context_lens=t(clens, i32),
        query_start_loc=t([0] + torch.tensor(qlens).cumsum(0).tolist(), i32),
        block_tables=t([pages.table(i) for i in range(len(tokens))], i32), slot_mapping=t(slots),
        logits_indices=t(last), max_query_len=max(qlens), max_context_len=max(clens))
    return batch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int) -> float:
    """Median seconds of `reps` calls after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def measure(runner, vocab: int, args, tag: str, section: str, graphs: bool = False) -> dict[str, torch.Tensor]:
    """Parity batch + batch-1 decode + batched decode + prefill on one runner (decode steps
    replay CUDA graphs when `graphs`). -> {"prefill": logits of a ragged prefill batch,
    "decode": logits of the batched decode step}, to compare across runners."""
    dev, gen = args.device, torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(10, vocab, (n,), generator=gen).tolist()   # noqa: E731
    ctx, nseq, prefill = args.context, args.decode_batch, args.prefill_len
    pages = Pages(max(nseq, 4), max(ctx, prefill) + 64)
    runner.allocate_kv_cache(pages.num_blocks, BLOCK)
    if graphs:
        t = time.perf_counter()
        runner.capture_cuda_graphs(nseq, pages.per_seq * BLOCK)
        row(section, f"{tag} CUDA graph capture", time.perf_counter() - t, "s")

    # parity: 4 sequences of different lengths, one ragged prefill batch
    parity_tokens = [rand(n) for n in (37, 5, 64, 19)]
    logits = runner.forward(make_batch(parity_tokens, [0] * 4, pages, dev)).float().cpu()

    # batch-1 decode at `ctx` tokens of context: prefill once, then time single-token steps
    seq = rand(ctx)
    runner.forward(make_batch([seq], [0], pages, dev))
    step = make_batch([seq + [11]], [ctx], pages, dev)   # re-writes the same slot each rep
    row(section, f"{tag} batch-1 decode (ctx {ctx})", 1e3 * timed(lambda: runner.forward(step), dev, args.reps), "ms/token")

    # batched decode: nseq sequences at ctx tokens each, one token each per step
    seqs = [rand(ctx) for _ in range(nseq)]
    for i in range(0, nseq, 8):       # prefill in groups of 8 to bound activation memory
        runner.forward(make_batch(seqs[i:i + 8], [0] * len(seqs[i:i + 8]), _Offset(pages, i), dev))
    step = make_batch([s + [11] for s in seqs], [ctx] * nseq, pages, dev)
    sec = timed(lambda: runner.forward(step), dev, args.reps)
    row(section, f"{tag} decode {nseq} seqs (ctx {ctx})", nseq / sec, "tok/s")
    decode_logits = runner.forward(step).float().cpu()

    # prefill of one long prompt
    prompt = rand(prefill)
    one = make_batch([prompt], [0], pages, dev)
    sec = timed(lambda: runner.forward(one), dev, max(2, args.reps // 4))
    row(section, f"{tag} prefill {prefill} tokens", prefill / sec, "tok/s")
    return {"prefill": logits, "decode": decode_logits}


class _Offset(Pages):
    """Pages seen from sequence `first` on (for prefilling a slice of the batch)."""

    def __init__(self, pages: Pages, first: int):
        self.per_seq, self.num_blocks, self.first = pages.per_seq, pages.num_blocks, first

    def table(self, i: int) -> list[int]:
        return super().table(i + self.first)


def parity(section: str, tag: str, ours: dict, ref: dict, ref_name: str = "1 rank") -> None:
    for kind in ours.keys() & ref.keys():
        a, b = ours[kind], ref[kind]
        rel = float((a - b).norm() / b.norm())
        agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
        row(section, f"{tag} vs {ref_name} ({kind}): rel. error of logits", rel)
        row(section, f"{tag} vs {ref_name} ({kind}): greedy agreement", agree)


# ---- sections ----------------------------------------------------------------------------
def build(model_dir: str, args, tp: int = 1, ep: bool = False):
    if time.time() + RUN_SECONDS > DEADLINE:
        raise OutOfTime(f"less than {RUN_SECONDS:.0f} s of the time budget left")
    from gpu_worker.model_config import ModelConfig
    from gpu_worker.parallel import create_model_runner
    cfg = ModelConfig.from_dir(model_dir)
    return cfg, create_model_runner(cfg, model_dir, device=args.device, dtype=args.torch_dtype,
                                    attention_backend=args.attention_backend, tensor_parallel_size=tp,
                                    enable_expert_parallel=ep)


def release(runner) -> None:
    close = getattr(runner, "close", None)
    if close:
        close()
    del runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ensure_model(path: str, arch: str, size: str, args) -> str:
    from gpu_worker.make_model import make_model
    if not (Path(path) / "config.json").exists():
        log(f"making {arch} {size} at {path}")
        make_model(path, arch, size, seed=0, dtype=args.dtype, progress=False)
    return path


def section_tp(args) -> None:
    model = ensure_model(args.llama_dir, "llama", args.llama_size, args)
    ref = None
    for tp in (1, 2):
        for use_graphs in ([False, True] if args.graphs else [False]):
            tag = f"TP={tp}" + (" graphs" if use_graphs else "")
            cfg, runner = build(model, args, tp=tp)
            try:
                got = measure(runner, cfg.vocab_size, args, tag, "tp", graphs=use_graphs)
            finally:
                release(runner)
            if ref is None:
                ref = got          # TP=1 eager: the reference of every other run
            else:
                parity("tp", tag, got, ref, "TP=1 eager")


def section_moe(args) -> None:
    model = ensure_model(args.moe_dir, "qwen3_moe", args.moe_size, args)
    cfg, r1 = build(model, args, tp=1)
    ref = measure(r1, cfg.vocab_size, args, "EP=1", "moe")
    release(r1)
    for tag, ep in (("EP=2", True), ("MoE-TP=2", False)):
        _, r2 = build(model, args, tp=2, ep=ep)
        try:
            got = measure(r2, cfg.vocab_size, args, tag, "moe")
        finally:
            release(r2)
        parity("moe", tag, got, ref)


def section_gemm(args) -> None:
    from gpu_worker.models.grouped_gemm import grouped_linear, grouped_linear_ref
    from gpu_worker.models.grouped_gemm_triton import grouped_gemm_triton
    dev, dt = args.device, args.torch_dtype
    experts, hidden, inter, top_k = (8, 64, 32, 2) if args.smoke else (128, 2048, 768, 8)
    for tokens in ((4, 16) if args.smoke else (1, 16, 256, 2048)):
        gen = torch.Generator().manual_seed(tokens)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).reshape(-1)
        counts = torch.bincount(ids, minlength=experts).to(dev)
        x = (torch.randn(tokens * top_k, hidden, generator=gen) * 0.5).to(dev, dt)
        w = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dev, dt)
        ref = grouped_linear_ref(x.float(), w.float(), counts)
        for name, fn in (("grouped_linear", grouped_linear), ("triton", grouped_gemm_triton),
                         ("loop", grouped_linear_ref)):
            if name == "triton" and dev == "cpu":
                continue
            out = fn(x, w, counts)
            err = float((out.float() - ref).norm() / ref.norm())
            sec = timed(lambda: fn(x, w, counts), dev, args.reps)
            flops = 2 * tokens * top_k * hidden * 2 * inter
            row("gemm", f"{name} T={tokens} rel err {err:.1e}", 1e6 * sec, f"us ({flops / sec / 1e12:.1f} TFLOP/s)")


def section_moe1(args) -> None:
    from gpu_worker.model_config import ModelConfig
    from gpu_worker.model_runner import ModelRunner
    model = ensure_model(args.moe1_dir, "qwen3_moe", args.moe1_size, args)
    cfg = ModelConfig.from_dir(model)
    runner = ModelRunner(cfg, model, device=args.device, dtype=args.torch_dtype,
                         attention_backend=args.attention_backend)
    ours = measure(runner, cfg.vocab_size, args, "qwen3_moe 1 GPU", "moe1")
    release(runner)
    if args.graphs:    # the single-rank MoE layer must be capturable (no host syncs)
        runner = ModelRunner(cfg, model, device=args.device, dtype=args.torch_dtype,
                             attention_backend=args.attention_backend)
        graphed = measure(runner, cfg.vocab_size, args, "qwen3_moe 1 GPU graphs", "moe1", graphs=True)
        release(runner)
        parity("moe1", "graphs", graphed, ours, "eager")
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=args.torch_dtype).to(args.device).eval()
    gen = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(10, cfg.vocab_size, (n,), generator=gen).tolist()   # noqa: E731
    refs = []
    with torch.no_grad():
        for n in (37, 5, 64, 19):      # the parity prompts of measure(), same generator order
            refs.append(hf(torch.tensor([rand(n)], device=args.device)).logits[0, -1].float().cpu())
    parity("moe1", "kvmesh", {"prefill": ours["prefill"]}, {"prefill": torch.stack(refs)}, "transformers")
    del hf


SECTIONS = {"tp": section_tp, "moe": section_moe, "gemm": section_gemm, "moe1": section_moe1}
MULTI_GPU = ("tp", "moe")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="tp,moe")
    ap.add_argument("--llama-dir", default="/tmp/kvmesh-llama-8b")
    ap.add_argument("--llama-size", default="8b")
    ap.add_argument("--moe-dir", default="/tmp/kvmesh-qwen3moe-8b")
    ap.add_argument("--moe-size", default="8b")
    ap.add_argument("--moe1-dir", default="/tmp/kvmesh-qwen3moe-1b")
    ap.add_argument("--moe1-size", default="1b")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--attention-backend", default="triton", choices=("triton", "torch"))
    ap.add_argument("--context", type=int, default=1024, help="context length of the decode timings")
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--time-budget", type=float, default=540.0,
                    help="seconds for the whole run: no runner is started past it (one device call is 600 s)")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false",
                    help="skip the CUDA-graph decode runs (eager only)")
    ap.add_argument("--smoke", action="store_true", help="CPU + gloo, tiny models, torch attention")
    args = ap.parse_args(argv)
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "kvmesh-multi-gpu-smoke"
        args.llama_dir, args.moe_dir = str(tmp / "llama"), str(tmp / "qwen3_moe")
        args.moe1_dir = args.moe_dir
        args.llama_size = args.moe_size = args.moe1_size = "tiny"
        args.dtype, args.attention_backend = "float32", "torch"
        args.context, args.decode_batch, args.prefill_len, args.reps = 40, 4, 64, 3
        args.device = "cpu"
        # graphs stay on: the CPU replays them eagerly, which still runs their code path
    else:
        args.device = "cuda:0"
        if torch.cuda.device_count() < 2 and any(s in MULTI_GPU for s in args.sections.split(",")):
            log(f"needs 2 GPUs, sees {torch.cuda.device_count()}")
            return 2
    args.torch_dtype = getattr(torch, args.dtype)
    global DEADLINE
    DEADLINE = T0 + args.time_budget
    RESULTS["env"] = {"torch": torch.__version__, "gpus": torch.cuda.device_count(), "args": vars(args),
                      "nccl_env": {k: os.environ[k] for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                             "NVSHMEM_DISABLE_NVLS")}}
    for name in args.sections.split(","):
        log(f"== section {name}")
        try:
            SECTIONS[name](args)
        except OutOfTime as e:
            RESULTS["errors"][name] = f"skipped the rest: {e}"
        except Exception as e:    # record and go on: one failure must not hide the other section
            RESULTS["errors"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        save(out_dir)
    print("\n| section | metric | value |\n|---|---|---|")
    for section, metric, text in ROWS:
        print(f"| {section} | {metric} | {text} |")
    for name, err in RESULTS["errors"].items():
        print(f"ERROR in {name}: {err}")
    return 1 if RESULTS["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
