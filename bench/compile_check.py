#!/usr/bin/env python3
"""Compile the Triton kernels of a batch-1 decode layer's attention for sm_90 on a machine
without a GPU, and report what the compiler made of each: registers, stack (spills), and counts
of global loads, atomics, barriers and tensor-core instructions.

No device time: Triton's package carries ptxas and cuobjdump, and `triton.compile` takes a
target. The launchers run on CPU tensors of Llama-3.1-8B's heads with their kernels swapped for
recorders, so what is compiled is exactly what they launch (grid, arguments, constexprs), with
the JIT's own specializations applied by hand (16-byte-aligned pointers and ints divisible by 16
marked divisible, ints equal to 1 made constants, both unless the kernel opts out) and PDL on,
as inside a CUDA graph. Each decode-attention configuration (paged_decode_attention
.set_attention_config: u+2p, s8x16, s1x64h1, ...) is compiled for the short graphs (128-token
context, graph bound 1024) and the long ones (8k context, bound 16k). `--prefill` compiles the
prefill attention kernels instead (paged_prefill_attention's v2 and fresh_prefill_attention, their
default configurations and any PrefillConfig / FreshConfig literals given), with their TMA
descriptors typed as the JIT types them, and adds the TMA loads (UTMALDG) to the counts.

    python bench/compile_check.py                                  # the Triton installed here
    PYTHONPATH=/path/to/triton-3.6 python bench/compile_check.py   # the device image's version
    python bench/compile_check.py --prefill 'FreshConfig(128, 64, 8, 3)'

Registers and spills depend on the Triton version: the device's (3.6) can be installed into its
own folder (`pip install --no-deps --target DIR triton==3.6.0`) for numbers that match the H200
runs. Prints a table; writes $OUT/compile_check.json (--prefill: compile_check_prefill.json).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

os.environ.pop("TRITON_INTERPRET", None)        # compile for the GPU, never interpret
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
           torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv",
           torch.float8_e5m2: "fp8e5"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl")


class Launch(NamedTuple):
    kernel: object                  # the @triton.jit function
    grid: tuple
    args: tuple
    kwargs: dict


class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, kernel, launches: list[Launch]):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(Launch(self.kernel, tuple(grid), args, kwargs))


def source(launch: Launch):
    """(ASTSource, options) of a recorded launch, specialized as the JIT specializes (module doc)."""
    from triton.compiler import ASTSource
    kernel = launch.kernel
    names = [p.name for p in kernel.params]
    values = dict(zip(names, launch.args)) | {k: v for k, v in launch.kwargs.items() if k not in _LAUNCH_OPTIONS}
    if "PDL" in values:
        values["PDL"] = 1                                   # as inside a CUDA graph on sm_90
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        v = values[p.name]
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _DTYPES[v.dtype]
            if v.data_ptr() % 16 == 0 and not p.do_not_specialize_on_alignment:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            if v == 1 and not p.do_not_specialize:
                sig[p.name], consts[p.name] = "constexpr", 1
                continue
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0 and not p.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        elif v is None:
            sig[p.name], consts[p.name] = "constexpr", None
        elif type(v).__name__ == "TensorDescriptor":          # host-side TMA descriptor
            sig[p.name] = f"tensordesc<{_DTYPES[v.base.dtype]}[{','.join(map(str, v.block_shape))}]>"
        else:
            raise TypeError(f"{kernel.__name__}.{p.name}: cannot type {type(v).__name__}")
    options = dict(num_warps=launch.kwargs.get("num_warps", 4), num_stages=launch.kwargs.get("num_stages", 3))
    return ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs), options


def report(launch: Launch) -> dict:
    """Compile one launch for sm_90 and read its cubin's resource use and instruction counts."""
    from triton.backends.compiler import GPUTarget
    src, options = source(launch)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(tools / "cuobjdump"), "--dump-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    res = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    count = lambda pattern: len(re.findall(pattern, sass))          # noqa: E731
    return dict(kernel=launch.kernel.__name__, grid=list(launch.grid), num_warps=options["num_warps"],
                num_stages=options["num_stages"], regs=res.get("REG", -1), stack=res.get("STACK", -1),
                local=res.get("LOCAL", -1), ldg=count(r"\bLDG\b"), atom=count(r"\b(?:ATOM|ATOMG|RED)\b"),
                bar=count(r"\bBAR\.SYNC"), mma=count(r"\b(?:HMMA|HGMMA)\b"), tma=count(r"\bUTMALDG\b"))


def decode_step_launches(context: int, graph_bound: int) -> list[Launch]:
    """The kernels TritonAttentionBackend.decode_rope_attend launches for one batch-1 pure-decode
    step of Llama-3.1-8B heads (32 query / 8 KV heads of 128) at `context` tokens, inside a graph
    captured for contexts up to `graph_bound`, under the current attention configuration."""
    from gpu_worker.attention.triton_backend import TritonAttentionBackend
    from gpu_worker.forward_batch import ForwardBatch
    from gpu_worker.kernels import paged_decode_attention as pda
    from gpu_worker.kernels import rope_kv_write as rkw
    from gpu_worker.kernels.rope import build_cos_sin_cache, rope_inv_freq
    launches: list[Launch] = []
    saved = (pda._decode_stage1_kernel, pda._decode_stage2_kernel, rkw._rope_kv_write_kernel,
             pda.check_device, rkw.check_device)
    pda._decode_stage1_kernel = Recorder(saved[0], launches)
    pda._decode_stage2_kernel = Recorder(saved[1], launches)
    rkw._rope_kv_write_kernel = Recorder(saved[2], launches)
    pda.check_device = rkw.check_device = lambda *tensors: None      # CPU tensors, compiled not run
    try:
        page, n_heads, n_kv, d = 16, 32, 8, 128
        blocks = -(-context // page)
        qkv = torch.zeros(1, (n_heads + 2 * n_kv) * d, dtype=torch.bfloat16)    # (1, 6144) the qkv GEMV's output
        q, k, v = qkv.split([n_heads * d, n_kv * d, n_kv * d], dim=-1)
        kc = torch.zeros(blocks + 1, page, n_kv, d, dtype=torch.bfloat16)
        i32 = dict(dtype=torch.int32)
        batch = ForwardBatch(
            input_ids=torch.zeros(1, dtype=torch.int64), positions=torch.tensor([context - 1]),
            query_lens=torch.ones(1, **i32), context_lens=torch.tensor([context], **i32),
            query_start_loc=torch.arange(2, **i32),
            block_tables=torch.arange(-(-graph_bound // (16 * page)) * 16, **i32)[None],
            slot_mapping=torch.tensor([context - 1]), logits_indices=torch.zeros(1, dtype=torch.int64),
            max_query_len=1, max_context_len=graph_bound)
        cs = build_cos_sin_cache(rope_inv_freq(d, 500000.0), graph_bound)
        TritonAttentionBackend().decode_rope_attend(
            q.view(1, n_heads, d), k.view(1, n_kv, d), v.view(1, n_kv, d), batch.positions, cs, kc, kc.clone(),
            batch, d ** -0.5)
    finally:
        (pda._decode_stage1_kernel, pda._decode_stage2_kernel, rkw._rope_kv_write_kernel,
         pda.check_device, rkw.check_device) = saved
    return launches


CASES = {"128 ctx (short graph)": (128, 1024), "8k ctx (long graph)": (8192, 16384)}


def prefill_launches(config) -> list[Launch]:
    """The kernels a 2 x 1k-token prefill of Llama-3.1-8B heads launches, with this step's K/V as
    separate rows (the backend's path): fresh_prefill_attention's under a FreshConfig (fresh
    prompts, then the same chunks behind a 1k cached prefix), paged_prefill_attention's v2 under a
    PrefillConfig; TMA descriptors are made as on the GPU."""
    from gpu_worker.kernels import fresh_prefill_attention as fpa
    from gpu_worker.kernels import paged_prefill_attention as ppa
    launches: list[Launch] = []
    saved = (ppa._prefill_kernel_v2, fpa._fresh_prefill_kernel, ppa.check_device, fpa.check_device, ppa.tma_ok,
             fpa.tma_ok)
    ppa._prefill_kernel_v2 = Recorder(saved[0], launches)
    fpa._fresh_prefill_kernel = Recorder(saved[1], launches)
    ppa.check_device = fpa.check_device = lambda *tensors: None
    ppa.tma_ok = fpa.tma_ok = lambda k_new, v_new: True          # the H200 accepts these rows
    try:
        page, n_heads, n_kv, d, n = 16, 32, 8, 128, 1024
        i32 = dict(dtype=torch.int32)
        q = torch.zeros(2 * n, n_heads, d, dtype=torch.bfloat16)
        kn = torch.zeros(2 * n, n_kv, d, dtype=torch.bfloat16)
        qsl = torch.tensor([0, n, 2 * n], **i32)
        kc = torch.zeros(4 * n // page, page, n_kv, d, dtype=torch.bfloat16)
        if isinstance(config, fpa.FreshConfig):
            fpa.fresh_prefill_attention(q, kn, kn.clone(), qsl, d ** -0.5, max_query_len=n, config=config)
            behind = fpa.CachedPrefix(kc, kc.clone(), torch.arange(4 * n // page, **i32).view(2, -1),
                                      torch.tensor([2 * n, 2 * n], **i32))
            fpa.fresh_prefill_attention(q, kn, kn.clone(), qsl, d ** -0.5, max_query_len=n, config=config,
                                        prefix=behind)
        else:
            ppa.paged_prefill_attention(
                q, kc, kc.clone(), torch.arange(2 * n // page, **i32).view(2, -1), torch.tensor([n, n], **i32),
                qsl, d ** -0.5, max_query_len=n, k_new=kn, v_new=kn.clone(), config=config)
    finally:
        (ppa._prefill_kernel_v2, fpa._fresh_prefill_kernel, ppa.check_device, fpa.check_device, ppa.tma_ok,
         fpa.tma_ok) = saved
    return launches


def prefill_main(names: list[str], ap: argparse.ArgumentParser) -> None:
    """--prefill: compile the prefill kernels per PrefillConfig / FreshConfig literal (paged v2 /
    fresh_prefill_attention) and print what ptxas made of each."""
    from gpu_worker.kernels.fresh_prefill_attention import FRESH_CONFIGS, FreshConfig
    from gpu_worker.kernels.paged_prefill_attention import PREFILL_CONFIGS, PrefillConfig
    configs = {f"default <= {b}": c for b, c in PREFILL_CONFIGS if b > 16}
    configs |= {f"fresh default <= {b}": c for b, c in FRESH_CONFIGS}
    for name in names:                  # the operator's own flag: literals of the two classes only
        try:
            cfg = eval(name, {"__builtins__": {}, "PrefillConfig": PrefillConfig, "FreshConfig": FreshConfig})  # noqa: S307
        except Exception as exc:       # noqa: BLE001
            ap.error(f"--prefill: {name!r} is not a PrefillConfig(...) or FreshConfig(...) literal ({exc})")
        if not isinstance(cfg, (PrefillConfig, FreshConfig)):
            ap.error(f"--prefill: {name!r} is not a PrefillConfig(...) or FreshConfig(...) literal")
        configs[name] = cfg
    rows, t0 = [], time.time()
    for name, cfg in configs.items():
        for launch in prefill_launches(cfg):
            case = "behind 1k" if launch.kwargs.get("HAS_PREFIX") else "fresh"
            rows.append(dict(config=name, case=case, **report(launch)))
            print(f"[{time.time() - t0:5.1f}s] {name}", flush=True)
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile_check_prefill.json").write_text(json.dumps(dict(triton=triton.__version__, rows=rows), indent=1))
    print(f"\nsm_90 with Triton {triton.__version__}: the prefill attention kernels (2 x 1k, Llama-3.1-8B heads)")
    print(f"{'config':>60s} {'kernel':>22s} {'case':>9s} {'warps':>5s} {'stages':>6s} {'regs':>4s} {'stack':>5s} "
          f"{'MMA':>4s} {'TMA':>4s}")
    for r in rows:
        print(f"{r['config']:>60s} {r['kernel']:>22s} {r['case']:>9s} {r['num_warps']:5d} {r['num_stages']:6d} {r['regs']:4d} "
              f"{r['stack']:5d} {r['mma']:4d} {r['tma']:4d}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attention", default="u+2p,u,s8x16,s8x16w2,s8x16w1,s4x32,s8x16+2p,s1x64h1,s2x32h1",
                    help="decode-attention configurations (paged_decode_attention.set_attention_config)")
    ap.add_argument("--prefill", nargs="*", default=None, metavar="CONFIG",
                    help="instead: the prefill attention kernels under their defaults and these PrefillConfig(...) "
                         "/ FreshConfig(...) literals, e.g. 'FreshConfig(128, 64, 8, 3)'")
    args = ap.parse_args()
    if args.prefill is not None:
        return prefill_main(args.prefill, ap)
    from gpu_worker.kernels import paged_decode_attention as pda
    configs = [c for c in args.attention.split(",") if c]
    bad = [c for c in configs if pda.attention_config_error(c)]
    if bad:
        ap.error(f"--attention: not configurations: {bad} ({pda.attention_config_error(bad[0])})")
    start = pda.attention_config()
    t0 = time.time()
    rows = []
    try:
        for cfg in configs:
            pda.set_attention_config(cfg)
            for case, (context, bound) in CASES.items():
                for launch in decode_step_launches(context, bound):
                    rows.append(dict(config=cfg, case=case, **report(launch)))
                    r = rows[-1]
                    print(f"[{time.time() - t0:5.1f}s] {cfg:>10s} {case:22s} {r['kernel']:24s} grid {r['grid']}",
                          flush=True)
    finally:
        pda.set_attention_config(start)
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile_check.json").write_text(json.dumps(dict(triton=triton.__version__, rows=rows), indent=1))
    print(f"\nsm_90 with Triton {triton.__version__}: the kernels of a batch-1 decode layer's attention "
          "(Llama-3.1-8B heads, PDL on)")
    print(f"{'config':>10s} {'case':22s} {'kernel':24s} {'grid':>12s} {'warps':>5s} {'stages':>6s} {'regs':>4s} "
          f"{'stack':>5s} {'LDG':>4s} {'ATOM':>4s} {'BAR':>4s} {'MMA':>4s}")
    for r in rows:
        grid = "x".join(map(str, r["grid"]))
        print(f"{r['config']:>10s} {r['case']:22s} {r['kernel']:24s} {grid:>12s} {r['num_warps']:5d} "
              f"{r['num_stages']:6d} {r['regs']:4d} {r['stack']:5d} {r['ldg']:4d} {r['atom']:4d} {r['bar']:4d} "
              f"{r['mma']:4d}")


if __name__ == "__main__":
    main()
