"""EngineArgs: every flag-settable field of one engine, declared once, named as in vLLM.

One declaration (name, type, offline default, help, bounds) drives every entry point:

    LLM(model=..., max_num_seqs=64)                   # gpu_worker/config.py's EngineConfig(EngineArgs)
    kvmesh generate --model DIR --max-num-seqs 64     # gpu_worker/cli_generate.py
    kvmesh worker --max-num-seqs 64                   # WorkerConfig(ServedEngineArgs, ServiceConfig)
    kvmesh serve --max-num-seqs 64                    # ServeConfig(ServedEngineArgs), handed to its workers
    helm: worker.engine: {max-num-seqs: 64}           # rendered as KVMESH_MAX_NUM_SEQS (per pool too)

Offline use (`LLM(...)`, `kvmesh generate`) takes EngineArgs' defaults, tuned for throughput;
serving (`kvmesh serve`, `kvmesh worker`, the Helm chart) takes SERVED_DEFAULTS on top, tuned for
latency, as vLLM's `LLM` and `vllm serve` differ. The engine's kernel choices
(`EngineConfig.tuning`) are no flag: they come from the KVMESH_* tuning variables
(services/config.py's TUNING_ENV) when an EngineConfig is built.

This module lives in services/ (no torch, no gpu_worker import) because every service's config
tree embeds these fields; gpu_worker imports it, never the other way round.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

from services.options import opt

DTYPES = ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16", "half", "float")
# Tokens per KV block. The kernels find every token's row through the block table (slot =
# block_table[pos // block_size] * block_size + pos % block_size), so any size computes right; the
# sizes taken are the powers of two the engine is tested at (4 in its block-accounting tests, up to
# vLLM's largest, 128, in tests/gpu_worker/engine/test_block_sizes.py), and an odd size is a typo.
BLOCK_SIZES = (4, 8, 16, 32, 64, 128)
DEVICE = {"pattern": r"auto|cpu|cuda(:[0-9]+)?", "expected": "auto, cpu, cuda or cuda:N"}


@dataclass(frozen=True)
class EngineArgs:
    """The engine's fields with their offline defaults (LLM(...), kvmesh generate)."""

    model: str = opt("", "Model directory (config.json, *.safetensors, tokenizer files).")
    max_num_seqs: int = opt(512, "Engine: most sequences (samples) in one step's batch.", min=1)
    max_num_batched_tokens: int = opt(8192, "Engine: most tokens (decode tokens + prefill chunks) in one step's "
                                            "batch; a longer prompt is prefilled in chunks of this size.", min=1)
    max_model_len: int | None = opt(None, "Engine: longest sequence (prompt + output) in tokens; none or 0: the "
                                          "model's max_position_embeddings, capped by the KV-cache capacity (and by "
                                          "max_num_batched_tokens when chunked prefill is off).", min=2, unset=0)
    block_size: int = opt(16, "Engine: tokens per KV-cache block (a prefix-cache service's --block-size must "
                              "match).", choices=BLOCK_SIZES)
    enable_prefix_caching: bool = opt(True, "Engine: reuse KV blocks of identical prompt prefixes (same model, "
                                            "same cache_salt).")
    enable_chunked_prefill: bool = opt(True, "Engine: split long prompts into chunks that share steps with "
                                             "running decodes.")
    num_gpu_blocks: int | None = opt(None, "Engine: KV-cache blocks to allocate; none or 0: profiled from free GPU "
                                           "memory, or the CPU budget (cpu_kv_cache_bytes).", min=1, unset=0)
    gpu_memory_utilization: float = opt(0.9, "Engine: this engine's share of its GPU's total memory (weights, "
                                             "activations and KV cache); memory other processes hold is not "
                                             "charged, so two engines at 0.45 share one GPU.", above=0, max=1)
    dtype: str = opt("auto", "Engine: weights/activations dtype (auto: the model's dtype on GPU, fp32 models in "
                             "bf16; fp32 on CPU).", choices=DTYPES)
    device: str = opt("auto", "Engine: cuda, cuda:N, cpu or auto (cuda when available); `kvmesh serve` gives its "
                              "workers cuda:0, cuda:1, ... when several GPUs exist.", **DEVICE)
    seed: int = opt(0, "Engine seed: weights of random layers and the seed of requests that give none.")
    attention_backend: str = opt("auto", "Engine: attention kernels (auto: triton on CUDA, torch elsewhere).",
                                 choices=("auto", "torch", "triton"))
    max_n: int = opt(16, "Engine: largest n (samples per request) accepted.", min=1)
    model_id: str | None = opt(None, "Engine: identity mixed into prefix-cache block hashes; none: the model "
                                     "directory's name.", unset="")
    cpu_kv_cache_bytes: int = opt(1 << 30, "Engine, CPU only, without num_gpu_blocks: most bytes the KV cache "
                                           "may take.", min=1)
    enforce_eager: bool = opt(False, "Engine: never use CUDA graphs (by default decode steps, and lone short "
                                     "prefills, replay graphs captured at start-up on CUDA with the triton backend).")
    async_scheduling: bool = opt(False, "Engine: schedule and launch step N+1 while step N runs on the GPU (its "
                                        "decode inputs are step N's sampled tokens, read on the device), hiding the "
                                        "host's per-step work; a draw that needs step N's tokens on the host (grammar, "
                                        "penalties) is queued after step N+1's forward, once they are read.")
    # Past vLLM's 512 only for engines allowed more sequences: at 1,024 sequences, graphs up to
    # 1,024 rows made the ShareGPT-like run 2.2% faster than graphs up to 512 (H200), for ~3 s
    # more capture.
    cuda_graph_max_bs: int = opt(1024, "Engine: largest decode batch captured in a CUDA graph (capped by "
                                       "max_num_seqs, or by a speculative verification step's rows if more); "
                                       "larger decode batches run eagerly.", min=1)
    prefill_graph_max_tokens: int = opt(1024, "Engine: a step whose only sequence prefills at most this many "
                                              "tokens replays a CUDA graph captured at start-up (sizes every 32 "
                                              "tokens; 0: none): the time to first token of a lone request.", min=0)
    # Launched eagerly, a mixed step costs ~18 ms of Python on the H200's host, more than its GPU
    # time up to ~1,000 tokens; yet on the concurrency-64 serving load piecewise graphs sped up
    # only steps of ~576 tokens and changed nothing from 768 up, where the GPU bounds: off.
    piecewise_graph_max_tokens: int = opt(0, "Engine: steps of 5 to this many tokens that no whole-step graph serves "
                                             "replay the model between attentions from CUDA graphs (sizes every 64 "
                                             "tokens; not with tensor parallelism or MoE; 0: none; try 2048 where "
                                             "the host bounds mixed steps).", min=0)
    tensor_parallel_size: int = opt(1, "Engine: GPUs one engine shards the model over (heads, MLP, vocabulary; one "
                                       "rank per GPU, ranks 1.. as child processes).", min=1)
    enable_expert_parallel: bool = opt(False, "Engine: MoE models with tensor_parallel_size > 1 place whole experts "
                                              "on ranks (all-to-all) instead of splitting every expert.")
    # As vLLM's dynamic FP8: embeddings and lm_head stay in dtype (fp8_lm_head halves the head's
    # 1 GB read per decode step of Llama-8B at the cost of the logits' precision). Best on
    # Hopper; elsewhere the same maths runs dequantized.
    quantization: str | None = opt(None, "Engine: weight quantization (none: weights in dtype; fp8: decoder "
                                         "linears in e4m3 with per-channel scales, activations per token; "
                                         "fp8_lm_head: the lm_head in e4m3 too).",
                                   choices=("fp8", "fp8_lm_head"), unset="")
    kv_cache_dtype: str = opt("auto", "Engine: KV-cache storage (auto: the model's dtype; fp8: e4m3 with scale "
                                      "1.0, twice the blocks for the same memory).", choices=("auto", "fp8"))
    # KV tiers below the device (gpu_worker/kv_tiers/): what the device's LRU evicts goes down a
    # tier and comes back when a prompt's prefix is found there (a multi-turn chat's history).
    kv_offload_cpu_gb: float = opt(0.0, "Engine: GiB of host memory (pinned on CUDA) for a KV tier below the device: "
                                        "cached blocks the device evicts are copied there (asynchronously on "
                                        "CUDA) and loaded back on a prefix hit; 0: no host tier.", min=0, max=65536)
    kv_offload_dir: str | None = opt(None, "Engine: directory of a local-disk KV tier below the host tier (created "
                                           "0700, one 0600 file per block with a checksummed header; locked: one "
                                           "engine per directory; the blocks a previous engine left there are "
                                           "restored at start-up, and a draining worker writes its cached blocks "
                                           "there); none: no disk tier. Needs kv_offload_disk_gb.", unset="", pattern=r".{1,4096}",
                                     expected="a directory path of 1 to 4096 characters")
    kv_offload_disk_gb: float = opt(0.0, "Engine: most GiB the disk tier's files take (with kv_offload_dir).",
                                    min=0, max=65536)
    kv_offload_shared_dir: str | None = opt(None, "Engine: directory of a KV tier every worker on the node reads "
                                                  "and writes at once (no lock; ours, 0700; a subdirectory per KV "
                                                  "layout, and per rank with tensor parallelism; one checked 0600 "
                                                  "file per block): a prompt's prefix "
                                                  "missing from this worker's tiers is loaded from there, a draining "
                                                  "worker writes its cached blocks there, and without "
                                                  "kv_offload_dir the host tier's evictions go there; none: no shared "
                                                  "tier. Needs kv_offload_shared_gb.", unset="", pattern=r".{1,4096}",
                                            expected="a directory path of 1 to 4096 characters")
    kv_offload_shared_gb: float = opt(0.0, "Engine: most GiB the shared tier's directory takes, kept by every "
                                           "writer (with kv_offload_shared_dir); with tensor parallelism each "
                                           "rank keeps its own subdirectory (its shard of every block) to "
                                           "kv_offload_shared_gb / tensor_parallel_size.", min=0, max=65536)
    kv_load_policy: str = opt("auto", "Engine: a prompt whose prefix sits in a lower KV tier: auto (load or "
                                      "recompute, whichever the tiers' measured bandwidth and the recent prefill "
                                      "rate predict faster, or load the first blocks and compute the rest), "
                                      "always (load), never (recompute).", choices=("auto", "always", "never"))

    # Speculative decoding (gpu_worker/spec_decode/): cheap drafts verified by the model in one
    # forward; greedy output is unchanged, sampled output keeps the model's distribution.
    speculative_config: str | None = opt(None, "Engine: speculative decoding as a JSON object, as vLLM's "
                                               "--speculative-config: {\"method\": \"ngram\", "
                                               "\"num_speculative_tokens\": 4 (1-8), \"prompt_lookup_min\": 2, "
                                               "\"prompt_lookup_max\": 5, \"disable_by_batch_size\": 8 (more "
                                               "running sequences: no drafts), \"backoff_max_steps\": 64 "
                                               "(a sequence whose drafts keep failing goes 1, 2, 4 ... up to "
                                               "this many steps without drafts; 0: never)} or "
                                               "{\"method\": \"draft_model\", "
                                               "\"model\": DIR (a smaller model with the same tokenizer), "
                                               "\"num_speculative_tokens\": 4} or {\"method\": \"mtp\", "
                                               "\"num_speculative_tokens\": 2} (the model's own "
                                               "multi-token-prediction layer); with async_scheduling, steps "
                                               "that verify drafts run synchronously; "
                                               "none: off.", unset="", pattern=r"(?s).{1,4096}",
                                         expected="a JSON object of 1 to 4096 characters")


class ServedDefault(NamedTuple):
    default: Any
    why: str


# The served defaults that differ from the offline ones, and why each use has its own. Offline
# runs are judged by throughput (a whole batch at once); serving by time to first token and
# inter-token latency under load.
SERVED_DEFAULTS: dict[str, ServedDefault] = {
    "max_num_seqs": ServedDefault(128, "offline, 512 sequences (with 8,192 tokens) a step put every offline line "
                                       "of BENCHMARKS.md level with or ahead of vLLM's defaults; served, a "
                                       "smaller batch keeps each step, and so each running request's next "
                                       "token, short (the H200 serving lines ran with 128)"),
    "max_num_batched_tokens": ServedDefault(1536, "offline, 8,192 tokens a step prefill an 8k prompt at once "
                                                  "(2,048 chunked it four times and trailed vLLM's long "
                                                  "prefills); served, the prefill chunk riding with the decodes "
                                                  "sets the inter-token latency: 1,536 kept p99 ITL at 41 ms on "
                                                  "the H200 at concurrency 64 (BENCHMARKS.md)"),
    "async_scheduling": ServedDefault(True, "served, preparing step N+1 while the GPU runs step N was faster on "
                                            "the H200 at every serving load (BENCHMARKS.md); the offline lines "
                                            "were measured without it"),
}


def _with_served_defaults(cls: type) -> type:
    """`cls` with SERVED_DEFAULTS' defaults; everything else about each field (type, help,
    bounds) stays the one EngineArgs declares."""
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    fields = [(name, by_name[name].type, dataclasses.field(default=served.default, metadata=by_name[name].metadata))
              for name, served in SERVED_DEFAULTS.items()]
    return dataclasses.make_dataclass("ServedEngineArgs", fields, bases=(cls,), frozen=True,
                                      namespace={"__module__": __name__,
                                                 "__doc__": "The engine's fields with the served defaults "
                                                            "(kvmesh serve, kvmesh worker, Helm)."})


ServedEngineArgs: type[EngineArgs] = _with_served_defaults(EngineArgs)
ENGINE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(EngineArgs))


def engine_args_of(cfg: Any) -> dict[str, Any]:
    """The engine fields of any config embedding them (WorkerConfig, ServeConfig, EngineConfig)."""
    return {name: getattr(cfg, name) for name in ENGINE_FIELDS}


def defaults_markdown() -> str:
    """docs/services.md's table of the defaults that differ offline and served, with the reason
    (a test keeps it true)."""
    offline = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    rows = ["| field | `LLM(...)`, `kvmesh generate` | `kvmesh serve`, `kvmesh worker`, Helm | why |",
            "|---|---|---|---|"]
    for name, served in SERVED_DEFAULTS.items():
        rows.append(f"| `{name}` | `{offline[name]}` | `{served.default}` | {served.why} |")
    return "\n".join(rows)
