"""KernelTuning: the kernel choices of one engine (decode-attention splits and tiles, the decode
GEMV path, programmatic dependent launch), one frozen object inside EngineConfig.

The engine hands it to the attention backend and the model at construction; they copy the
fields they need into attributes once, so no decode step pays for a lookup. Nothing here reads
the environment: gpu_worker/config.py's `tuning_from_env` applies the few KVMESH_* overrides
that benchmarks A/B (docs/services.md lists them). Pure data: no torch, no triton, so a config
can be built and validated without the GPU stack.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field

FP8_UPCASTS = ("bf16", "f16", "f16_bits", "f16_asm")
SPLIT_MERGES = ("last", "two_pass")
GEMV_WEIGHTS = ("fp8", "all")


def _pow2(n: int | None) -> bool:
    return n is None or (n >= 1 and n & (n - 1) == 0)


@dataclass(frozen=True)
class DecodeAttentionTuning:
    """How paged_decode_attention splits each context and merges the splits (its module docstring
    has the measurements behind each default; all swept on the H200).

    Contexts of at most paged_decode_attention.SHORT_SPLIT_CONTEXT tokens (the short decode
    graphs) split finely (`choose_short_split`): up to short_max_splits partitions of
    short_block_n-key tiles while that keeps 2 programs per SM. Longer ones (`choose_num_splits`)
    take up to long_max_splits partitions of at least long_min_tokens keys, as many as give
    long_programs_per_sm programs per SM.

    `spec()` / `parse()` write and read the whole object as one short string (KVMESH_DECODE_ATTENTION,
    for A/B runs): "u" (short contexts unsplit) or "sNxB" (short_max_splits N, short_block_n B),
    then optionally "hH" (short_heads_per_program) and "wW" (short_num_warps), then optionally
    "lNxTpP" (long_max_splits, long_min_tokens, long_programs_per_sm) itself optionally followed by
    "bB" (long_block_n) and "wW" (long_num_warps), then "+2p" for merge "two_pass" (else "last"),
    optionally followed by merge_num_warps ("+2p" alone: 4). The default is "s16x16+2p1".
    long_num_warps_fp8 and fp8_upcast are not part of the string."""

    short_max_splits: int = 16
    """Most partitions of a short context (1 with short_heads_per_program None: unsplit)."""
    short_block_n: int = 16
    """Keys per tile of a short context's split programs (a power of two >= 16)."""
    short_heads_per_program: int | None = None
    """Query heads per short-context program, a divisor of the group (None: the whole group)."""
    short_num_warps: int | None = None
    """Warps of a short context's split program (None: the kernel's 4)."""
    merge: str = "two_pass"
    """How split partials are merged: "last" (the last program of the launch) or "two_pass" (a
    second kernel, faster on the H200's batch-1 graph)."""
    merge_num_warps: int = 1
    """Warps of a "two_pass" merge program."""
    long_max_splits: int = 32
    """Most partitions of a long context."""
    long_min_tokens: int = 512
    """Fewest keys per partition of a long context (of the step's max_context_len)."""
    long_programs_per_sm: int = 2
    """Programs per SM that long-context splitting aims for."""
    long_block_n: int | None = None
    """Keys per tile of a long context's split program (None: the kernel's 128)."""
    long_num_warps: int | None = 8
    """Warps of a long context's split program over a 16-bit cache (None: the kernel's 4)."""
    long_num_warps_fp8: int | None = None
    """The same over an fp8 cache, whose programs read half the bytes per key (None: 4)."""
    fp8_upcast: str = "f16"
    """How an fp8 cache's tiles are upcast for the dots: bf16, f16, f16_bits or f16_asm."""

    def __post_init__(self) -> None:
        checks = (
            (self.short_max_splits >= 1, "short_max_splits must be >= 1"),
            (self.short_block_n >= 16 and _pow2(self.short_block_n), "short_block_n must be a power of two >= 16"),
            (self.short_heads_per_program is None or self.short_heads_per_program >= 1,
             "short_heads_per_program must be >= 1 or None"),
            (_pow2(self.short_num_warps), "short_num_warps must be a power of two or None"),
            (self.merge in SPLIT_MERGES, f"merge must be one of {', '.join(SPLIT_MERGES)}"),
            (_pow2(self.merge_num_warps), "merge_num_warps must be a power of two"),
            (self.long_max_splits >= 1 and self.long_min_tokens >= 1 and self.long_programs_per_sm >= 1,
             "long_max_splits, long_min_tokens and long_programs_per_sm must be >= 1"),
            (self.long_block_n is None or (self.long_block_n >= 16 and _pow2(self.long_block_n)),
             "long_block_n must be a power of two >= 16 or None"),
            (_pow2(self.long_num_warps) and _pow2(self.long_num_warps_fp8),
             "long_num_warps and long_num_warps_fp8 must be powers of two or None"),
            (self.fp8_upcast in FP8_UPCASTS, f"fp8_upcast must be one of {', '.join(FP8_UPCASTS)}"),
        )
        for ok, why in checks:
            if not ok:
                raise ValueError(f"invalid decode attention tuning: {why}")

    @classmethod
    def parse(cls, text: str, **rest) -> "DecodeAttentionTuning":
        """A spec string (class docstring) -> the tuning; ValueError naming the accepted forms.
        `rest`: the fields the string does not carry (long_num_warps_fp8, fp8_upcast)."""
        m = _SPEC_RE.match(text)
        v = {k: int(x) for k, x in m.groupdict().items() if x is not None and x.isdigit()} if m else {}
        try:
            if m is None:
                raise ValueError
            return cls(short_max_splits=v.get("splits", 1), short_block_n=v.get("block", 16),
                       short_heads_per_program=v.get("hpp"), short_num_warps=v.get("warps"),
                       merge="two_pass" if m["two_pass"] else "last",
                       merge_num_warps=v.get("merge_warps", 4),      # "+2p" alone: the kernel's old 4
                       long_max_splits=v.get("long_splits", 32), long_min_tokens=v.get("long_tokens", 512),
                       long_programs_per_sm=v.get("long_per_sm", 2), long_block_n=v.get("long_block_n"),
                       long_num_warps=v.get("long_num_warps", 8), **rest)
        except ValueError:
            raise ValueError(
                f"decode attention config {text!r}: expected u, sNxB, sNxBhH, sNxBwW or sNxBhHwW "
                f"(N >= 1 splits, B >= 16 keys a power of two, H >= 1 heads, W warps a power of "
                f"two), optionally + 'lNxTpP[bB][wW]' (long contexts: N >= 1 splits of T >= 1 keys, P >= 1 "
                f"programs per SM, B-key tiles, W warps), optionally + '+2p' (then the merge kernel's warps, "
                f"e.g. +2p1), e.g. u+2p, s16x16+2p, s1x64h1w2, s16x16l64x128p4+2p1") from None

    def spec(self) -> str:
        """This tuning as a spec string (parse's inverse, for the fields the string carries)."""
        hpp, warps = self.short_heads_per_program, self.short_num_warps
        base = "u" if self.short_max_splits == 1 and hpp is None else (
            f"s{self.short_max_splits}x{self.short_block_n}" + (f"h{hpp}" if hpp else "") + (f"w{warps}" if warps else ""))
        long_tiles = ((f"b{self.long_block_n}" if self.long_block_n else "")
                      + (f"w{self.long_num_warps}" if self.long_num_warps != 8 else ""))
        policy = (self.long_max_splits, self.long_min_tokens, self.long_programs_per_sm)
        long = (policy != (32, 512, 2) or bool(long_tiles)) * (
            f"l{self.long_max_splits}x{self.long_min_tokens}p{self.long_programs_per_sm}{long_tiles}")
        merge = "" if self.merge == "last" else "+2p" + (str(self.merge_num_warps) if self.merge_num_warps != 4 else "")
        return base + long + merge


_SPEC_RE = re.compile(r"^(?:(?P<unsplit>u)|s(?P<splits>\d+)x(?P<block>\d+)(?:h(?P<hpp>\d+))?"
                      r"(?:w(?P<warps>\d+))?)"
                      r"(?:l(?P<long_splits>\d+)x(?P<long_tokens>\d+)(?:p(?P<long_per_sm>\d+))?"
                      r"(?:b(?P<long_block_n>\d+))?(?:w(?P<long_num_warps>\d+))?)?"
                      r"(?P<two_pass>\+2p(?P<merge_warps>\d+)?)?$")


@dataclass(frozen=True)
class KernelTuning:
    """Every kernel choice of one engine; EngineConfig.tuning. The defaults are the H200's best
    (BENCHMARKS.md); benchmarks build variants with dataclasses.replace, or through the
    KVMESH_* overrides that gpu_worker/config.py's tuning_from_env reads."""

    decode_attention: DecodeAttentionTuning = field(default_factory=DecodeAttentionTuning)
    """Splits, tiles and merge of the paged decode attention kernel (KVMESH_DECODE_ATTENTION)."""
    fuse_rope_decode: bool = True
    """Pure-decode steps whose decode kernel runs several programs per KV head do RoPE and the
    KV write inside it (one launch fewer per layer; triton backend)."""
    fresh_prefill: bool = True
    """Fresh prefills of up to 8,192 tokens take fresh_prefill_attention (TMA, Hopper) instead of
    paged_prefill_attention (triton backend)."""
    fresh_prefix: bool = True
    """... and chunks behind a cached prefix too (prefix read through the block table)."""
    decode_gemv_max_m: int = 1
    """Decode steps of 1..this many rows (at most fp8_gemv.MAX_M) run every decoder-layer linear as
    fp8_gemv's split-K GEMV on CUDA (KVMESH_DECODE_GEMV_MAX_M; 0: off)."""
    decode_gemv_weights: str = "all"
    """Which layers take that GEMV path: "all", or only "fp8" ones (KVMESH_DECODE_GEMV_WEIGHTS)."""
    decode_gemv_fuse: bool = False
    """On the GEMV path, the norms and SwiGLU move into the GEMVs' epilogues
    (KVMESH_DECODE_GEMV_FUSE; measured slower with PDL on the H200)."""
    head_gemv: bool = True
    """Steps on the GEMV path also run a 16-bit lm_head as the GEMV (decode_gemv_weights "all")."""
    fp8_gemv_max_m: int = 4
    """Fp8Linear layers take the weight-only GEMV for inputs of 1..this many rows
    (KVMESH_FP8_GEMV_MAX_M), cuBLASLt's fp8 GEMM above."""
    residual_gemm_min_rows: int = 1024
    """Steps of at least this many tokens add the residual inside the o_proj and down_proj GEMMs
    (a huge value turns it off)."""
    pdl: bool = True
    """Programmatic dependent launch inside CUDA graphs on sm_90+ (KVMESH_PDL)."""

    def to_json(self) -> str:
        """This tuning as JSON (how a tensor-parallel rank's process receives it)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "KernelTuning":
        """to_json's inverse; unknown or badly typed fields raise."""
        fields = json.loads(text)
        return cls(**{**fields, "decode_attention": DecodeAttentionTuning(**fields["decode_attention"])})

    def __post_init__(self) -> None:
        for name in ("decode_gemv_max_m", "fp8_gemv_max_m", "residual_gemm_min_rows"):
            if getattr(self, name) < 0:
                raise ValueError(f"invalid kernel tuning {name}: must be at least 0, got {getattr(self, name)}")
        if self.decode_gemv_weights not in GEMV_WEIGHTS:
            raise ValueError(f"invalid kernel tuning decode_gemv_weights: must be 'fp8' or 'all', "
                             f"got {self.decode_gemv_weights!r}")
