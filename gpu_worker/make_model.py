"""`kvmesh make-model`: write a random-weight Hugging Face model directory plus a real tokenizer.

    kvmesh make-model --arch llama --size 8b OUT_DIR      # exactly Llama-3.1-8B's shapes
    kvmesh make-model --arch qwen3_moe --size tiny OUT_DIR   # MoE: mixtral | qwen3_moe
    kvmesh make-model --arch llama --size tiny --mtp-layers 1 OUT_DIR   # + a DeepSeek-style MTP layer

No weights can be downloaded where kvmesh is tested and benchmarked, so every test, demo and
GPU benchmark runs on these. The directory loads in both kvmesh and `transformers`:
config.json, generation_config.json, model.safetensors (or shards + index json, written one
shard at a time so an 8B model never needs two copies in RAM), tokenizer.json and
tokenizer_config.json with a chat template (Llama-3 headers for llama/mistral, ChatML for qwen).

Weights (see the constants below): N(0, 1/fan_in) projections, q/k a little larger so
attention is far from uniform and positions matter; attention/MLP outputs that outweigh the
token's own embedding (so greedy output depends on context and does not loop on one token);
an lm_head giving logits of std ~4 (clear top-1 margins: greedy tokens agree across
numerically different but correct kernels in fp32); norm weights 1 + noise (a norm that fails
to load shows up in parity tests). Same seed, same size: byte-identical files on the CPU.

--mtp-layers N appends N multi-token-prediction layers under DeepSeek-V3's names
(model.layers.{L..L+N-1}.enorm / hnorm / eh_proj / shared_head.norm and a decoder layer whose MLP
is MoE for mixtral and qwen3_moe, as a decoder layer's at that index would be;
gpu_worker/models/mtp_module.py) and config.json's num_nextn_predict_layers, for speculative
decoding's method mtp; transformers ignores them (unexpected keys), so parity tests still load.
Drawn after every other tensor, so the rest of the model is the same as without them.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import torch

from gpu_worker.models.moe import EXPERT_NAMES
from gpu_worker.models.tokenizer_asset import SPECIAL_TOKENS, truncated_tokenizer_json
from services.text.split_patterns import LLAMA3_SPLIT, QWEN2_SPLIT

ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
         "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
MOE_ARCHS = ("mixtral", "qwen3_moe")
SIZES = ("tiny", "small", "1b", "8b")
SHARD_BYTES = 4 * 1024**3   # written one shard at a time: peak RAM is about one shard
SINGLE_NAME = "model.safetensors"
LOGIT_STD = 4.0     # std of the logits (lm_head rows against a unit-RMS hidden state)
EMBED_STD = 0.5     # untied embeddings
QK_GAIN = 1.5       # sharper-than-uniform attention, so position and context matter
BRANCH_GAIN = 2.0   # attention / MLP outputs outweigh the token's own embedding
TIED_BRANCH_BOOST = 3.0  # tied: the embedding must be a small part of the final hidden state
NORM_NOISE = 0.1
ROUTER_GAIN = 2.0   # router logits of std ~2: clear top-k choices that still vary by token


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int | None = None       # None: hidden // heads
    tied: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_pos: int = 4096
    sliding_window: int | None = None  # mistral only
    experts: int = 0                   # MoE (mixtral, qwen3_moe): experts per MoE layer
    top_k: int = 0                     # experts per token
    moe_inter: int = 0                 # each expert's intermediate size
    norm_topk: bool = True             # qwen3_moe: renormalize top-k weights (Mixtral always does)
    mlp_only_layers: tuple[int, ...] = ()  # qwen3_moe: layers with a dense MLP instead
    mtp_layers: int = 0                # DeepSeek-style multi-token-prediction layers after the decoder


def _llama3_scaling(factor: float, original: int) -> dict:
    return {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": original, "rope_type": "llama3"}


# Real models' shapes where one exists (Llama-3.1-8B, Llama-3.2-1B, Qwen2.5-1.5B/7B,
# Qwen3-1.7B/8B, Mistral-7B-v0.3); tiny/small are for tests and CPU demos.
SHAPES: dict[tuple[str, str], Shape] = {
    ("llama", "tiny"): Shape(2, 64, 4, 2, 128, 1024, rope_theta=500000.0,
                             rope_scaling=_llama3_scaling(8.0, 256), max_pos=2048),
    ("mistral", "tiny"): Shape(2, 64, 4, 2, 128, 1024, rope_theta=1e6, max_pos=2048),
    ("qwen2", "tiny"): Shape(2, 64, 4, 2, 128, 1024, tied=True, rope_theta=1e6, max_pos=2048),
    ("qwen3", "tiny"): Shape(2, 64, 4, 2, 128, 1024, head_dim=32, tied=True, rope_theta=1e6, max_pos=2048),
    ("llama", "small"): Shape(4, 256, 8, 4, 768, 32768, rope_theta=500000.0,
                              rope_scaling=_llama3_scaling(8.0, 2048), max_pos=16384),
    ("mistral", "small"): Shape(4, 256, 8, 4, 768, 32768, rope_theta=1e6, max_pos=16384),
    ("qwen2", "small"): Shape(4, 256, 8, 4, 768, 32768, tied=True, rope_theta=1e6, max_pos=16384),
    ("qwen3", "small"): Shape(4, 256, 8, 4, 768, 32768, head_dim=64, tied=True, rope_theta=1e6, max_pos=16384),
    ("llama", "1b"): Shape(16, 2048, 32, 8, 8192, 128256, tied=True, rope_theta=500000.0,
                           rope_scaling=_llama3_scaling(32.0, 8192), max_pos=131072),
    ("mistral", "1b"): Shape(16, 2048, 32, 8, 8192, 32768, rope_theta=1e6, max_pos=32768),
    ("qwen2", "1b"): Shape(28, 1536, 12, 2, 8960, 151936, tied=True, rope_theta=1e6, max_pos=32768),
    ("qwen3", "1b"): Shape(28, 2048, 16, 8, 6144, 151936, head_dim=128, tied=True, rope_theta=1e6,
                           max_pos=40960),
    ("llama", "8b"): Shape(32, 4096, 32, 8, 14336, 128256, rope_theta=500000.0,
                           rope_scaling=_llama3_scaling(8.0, 8192), max_pos=131072),
    ("mistral", "8b"): Shape(32, 4096, 32, 8, 14336, 32768, rope_theta=1e6, max_pos=32768),
    ("qwen2", "8b"): Shape(28, 3584, 28, 4, 18944, 152064, rope_theta=1e6, max_pos=32768),
    ("qwen3", "8b"): Shape(36, 4096, 32, 8, 12288, 151936, head_dim=128, rope_theta=1e6, max_pos=40960),
    # MoE. tiny/small for tests; 1b/8b: real models' layer shapes with fewer layers (about that
    # many parameters): Mixtral-8x7B layers (6 of 32) and Qwen3-30B-A3B layers (2 / 12 of 48).
    ("mixtral", "tiny"): Shape(2, 64, 4, 2, 128, 1024, rope_theta=1e6, max_pos=2048, experts=4, top_k=2,
                               moe_inter=128),
    ("mixtral", "small"): Shape(4, 256, 8, 4, 512, 32768, rope_theta=1e6, max_pos=16384, experts=8, top_k=2,
                                moe_inter=512),
    ("mixtral", "1b"): Shape(16, 1024, 16, 8, 3584, 32768, rope_theta=1e6, max_pos=32768, experts=8, top_k=2,
                             moe_inter=3584),
    ("mixtral", "8b"): Shape(6, 4096, 32, 8, 14336, 32000, rope_theta=1e6, max_pos=32768, experts=8, top_k=2,
                             moe_inter=14336),
    ("qwen3_moe", "tiny"): Shape(2, 64, 4, 2, 128, 1024, head_dim=32, rope_theta=1e6, max_pos=2048, experts=8,
                                 top_k=2, moe_inter=64),
    ("qwen3_moe", "small"): Shape(4, 256, 8, 4, 768, 32768, head_dim=64, rope_theta=1e6, max_pos=16384,
                                  experts=16, top_k=4, moe_inter=128),
    ("qwen3_moe", "1b"): Shape(2, 2048, 32, 4, 6144, 151936, head_dim=128, rope_theta=1e6, max_pos=40960,
                               experts=128, top_k=8, moe_inter=768),
    ("qwen3_moe", "8b"): Shape(12, 2048, 32, 4, 6144, 151936, head_dim=128, rope_theta=1e6, max_pos=40960,
                               experts=128, top_k=8, moe_inter=768),
}

# Chat templates: what transformers' apply_chat_template renders (and services/text sandboxes).
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class ChatStyle:
    template: str
    split: str               # pre-tokenizer regex
    bos: str | None          # added in front of every encoding (and by the template)
    eos: str                 # the chat turn terminator: generation stops here
    extra_eos: str           # the end-of-document token, also a stop
    pad: str


LLAMA3_STYLE = ChatStyle(LLAMA3_TEMPLATE, LLAMA3_SPLIT, "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>", "<|pad|>")
CHATML_STYLE = ChatStyle(CHATML_TEMPLATE, QWEN2_SPLIT, None, "<|im_end|>", "<|endoftext|>", "<|endoftext|>")


def _style(arch: str) -> ChatStyle:
    return CHATML_STYLE if arch.startswith("qwen") else LLAMA3_STYLE


def _token_id(name: str) -> int:
    return SPECIAL_TOKENS.index(name)  # specials occupy ids 0..8 of the shared vocabulary


# ---- config files --------------------------------------------------------------------------
def config_json(arch: str, shape: Shape, dtype: str) -> dict:
    style = _style(arch)
    cfg = {
        "architectures": [ARCHS[arch]], "model_type": arch,
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab,
        "hidden_act": "silu", "rms_norm_eps": 1e-6 if arch.startswith("qwen") else 1e-5,
        "rope_theta": shape.rope_theta, "rope_scaling": shape.rope_scaling,
        "max_position_embeddings": shape.max_pos, "tie_word_embeddings": shape.tied,
        "initializer_range": 0.02, "attention_dropout": 0.0, "use_cache": True,
        "bos_token_id": _token_id(style.bos or style.extra_eos),
        "eos_token_id": _token_id(style.extra_eos),
        "torch_dtype": dtype,
    }
    if shape.head_dim is not None:
        cfg["head_dim"] = shape.head_dim
    if arch in ("llama", "qwen3", "qwen3_moe"):
        cfg["attention_bias"] = False
    if arch == "llama":
        cfg["mlp_bias"] = False
    if arch in ("mistral", "mixtral"):
        cfg["sliding_window"] = shape.sliding_window
    if arch == "mixtral":
        cfg.update(num_local_experts=shape.experts, num_experts_per_tok=shape.top_k,
                   router_jitter_noise=0.0, output_router_logits=False)
        cfg["intermediate_size"] = shape.moe_inter    # Mixtral's experts are intermediate_size wide
    if arch == "qwen3_moe":
        cfg.update(num_experts=shape.experts, num_experts_per_tok=shape.top_k,
                   moe_intermediate_size=shape.moe_inter, norm_topk_prob=shape.norm_topk,
                   decoder_sparse_step=1, mlp_only_layers=list(shape.mlp_only_layers),
                   output_router_logits=False)
    if arch.startswith("qwen"):
        cfg["use_sliding_window"] = False
    if shape.mtp_layers:
        cfg["num_nextn_predict_layers"] = shape.mtp_layers
    return cfg


def generation_config_json(arch: str) -> dict:
    style = _style(arch)
    return {"bos_token_id": _token_id(style.bos or style.extra_eos),
            "eos_token_id": [_token_id(style.eos), _token_id(style.extra_eos)],
            "pad_token_id": _token_id(style.pad), "do_sample": False}


def tokenizer_files(arch: str, vocab: int, max_len: int = 131072) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) for a model of `vocab` rows."""
    style = _style(arch)
    tok = truncated_tokenizer_json(vocab)
    tok["normalizer"] = {"type": "NFC"} if style is CHATML_STYLE else None
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": style.split}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ]}
    if style.bos is not None:
        bos_id = _token_id(style.bos)
        tok["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": style.bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": style.bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": style.bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {style.bos: {"id": style.bos, "ids": [bos_id], "tokens": [style.bos]}},
        }
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": style.bos, "eos_token": style.eos, "pad_token": style.pad,
        "model_max_length": max_len, "clean_up_tokenization_spaces": False,
        "chat_template": style.template,
    }
    return tok, tok_cfg


# ---- weights -------------------------------------------------------------------------------
def _tensor_specs(arch: str, s: Shape) -> Iterator[tuple[str, tuple[int, ...], float, float]]:
    """(HF name, shape, mean, std) in file order. Norm weights are 1 + noise, not exactly 1, so
    a norm that fails to load cannot go unnoticed in parity tests."""
    hd = s.head_dim or s.hidden // s.heads
    q, kv = s.heads * hd, s.kv_heads * hd
    fan = 1 / math.sqrt(s.hidden)
    branch = BRANCH_GAIN * (TIED_BRANCH_BOOST if s.tied else 1.0)
    # Tied: the embedding is the lm_head, sized for the logit spread; it is then small beside the
    # residual branches, so a token does not mostly predict itself (degenerate greedy loops).
    yield "model.embed_tokens.weight", (s.vocab, s.hidden), 0.0, LOGIT_STD * fan if s.tied else EMBED_STD
    for i in range(s.layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (s.hidden,), 1.0, NORM_NOISE
        for name, rows, std in (("q_proj", q, QK_GAIN * fan), ("k_proj", kv, QK_GAIN * fan), ("v_proj", kv, fan)):
            yield p + f"self_attn.{name}.weight", (rows, s.hidden), 0.0, std
            if arch == "qwen2":
                yield p + f"self_attn.{name}.bias", (rows,), 0.0, 0.1
        if arch in ("qwen3", "qwen3_moe"):
            yield p + "self_attn.q_norm.weight", (hd,), QK_GAIN, NORM_NOISE
            yield p + "self_attn.k_norm.weight", (hd,), 1.0, NORM_NOISE
        yield p + "self_attn.o_proj.weight", (s.hidden, q), 0.0, branch / math.sqrt(q)
        yield p + "post_attention_layernorm.weight", (s.hidden,), 1.0, NORM_NOISE
        if arch in MOE_ARCHS and i not in s.mlp_only_layers:
            yield from _expert_specs(p, EXPERT_NAMES[arch], s, branch)
            continue
        yield p + "mlp.gate_proj.weight", (s.intermediate, s.hidden), 0.0, fan
        yield p + "mlp.up_proj.weight", (s.intermediate, s.hidden), 0.0, fan
        yield p + "mlp.down_proj.weight", (s.hidden, s.intermediate), 0.0, branch / math.sqrt(s.intermediate)
    yield "model.norm.weight", (s.hidden,), 1.0, NORM_NOISE
    if not s.tied:
        yield "lm_head.weight", (s.vocab, s.hidden), 0.0, LOGIT_STD * fan
    for m in range(s.mtp_layers):
        yield from _mtp_specs(arch, s, s.layers + m)


def _mtp_specs(arch: str, s: Shape, index: int) -> Iterator[tuple[str, tuple[int, ...], float, float]]:
    """One DeepSeek-V3-style MTP layer at decoder index `index`: the norms of the embedding and of
    the hidden state, eh_proj (2H -> H), a decoder layer, the head's norm. The layer's MLP is what
    the family's rule gives index `index` (ModelConfig.mtp_moe_layers; make-model writes
    decoder_sparse_step 1): MoE for mixtral and qwen3_moe unless `index` is in mlp_only_layers,
    else dense of the model's intermediate_size as config.json states it."""
    p = f"model.layers.{index}."
    yield p + "enorm.weight", (s.hidden,), 1.0, NORM_NOISE
    yield p + "hnorm.weight", (s.hidden,), 1.0, NORM_NOISE
    yield p + "eh_proj.weight", (s.hidden, 2 * s.hidden), 0.0, 1 / math.sqrt(2 * s.hidden)
    sparse = arch in MOE_ARCHS and index not in s.mlp_only_layers
    one = replace(s, layers=1, mlp_only_layers=() if sparse else (0,), mtp_layers=0,
                  intermediate=s.moe_inter if arch == "mixtral" else s.intermediate)
    for name, dims, mean, std in _tensor_specs(arch, one):
        if name.startswith("model.layers.0."):
            yield p + name.removeprefix("model.layers.0."), dims, mean, std
    yield p + "shared_head.norm.weight", (s.hidden,), 1.0, NORM_NOISE


def _expert_specs(p: str, names, s: Shape, branch: float) -> Iterator[tuple[str, tuple[int, ...], float, float]]:
    """Router and experts of one MoE layer, in the hub layout transformers loads (it fuses the
    experts into 3-D tensors itself, and writes this layout back on save)."""
    fan, b = 1 / math.sqrt(s.hidden), f"{p}{names.block}."
    yield b + "gate.weight", (s.experts, s.hidden), 0.0, ROUTER_GAIN * fan
    for e in range(s.experts):
        yield b + f"experts.{e}.{names.gate}.weight", (s.moe_inter, s.hidden), 0.0, fan
        yield b + f"experts.{e}.{names.up}.weight", (s.moe_inter, s.hidden), 0.0, fan
        yield b + f"experts.{e}.{names.down}.weight", (s.hidden, s.moe_inter), 0.0, branch / math.sqrt(s.moe_inter)


def _shard_plan(specs: list, itemsize: int) -> list[list]:
    shards, current, size = [], [], 0
    for spec in specs:
        nbytes = math.prod(spec[1]) * itemsize  # spec: (name, shape, mean, std)
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes
    return shards + [current]


def write_weights(out: Path, arch: str, shape: Shape, dtype: torch.dtype, seed: int,
                  device: str = "cpu", progress: bool = True) -> None:
    from safetensors.torch import save_file
    from tqdm import tqdm

    specs = list(_tensor_specs(arch, shape))
    shards = _shard_plan(specs, dtype.itemsize)
    gen = torch.Generator(device=device).manual_seed(seed)
    names = ([SINGLE_NAME] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total_bytes = {}, 0
    bar = tqdm(total=len(specs), desc="writing weights", unit="tensor", file=sys.stderr, disable=not progress)
    for file, shard in zip(names, shards):
        tensors = {}
        for name, dims, mean, std in shard:
            t = torch.randn(dims, generator=gen, device=device, dtype=torch.float32)
            t = (t * std + mean).to(dtype).cpu()
            tensors[name] = t
            weight_map[name] = file
            total_bytes += t.numel() * t.element_size()
            bar.update(1)
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors  # one shard in RAM at a time
    bar.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# ---- entry points --------------------------------------------------------------------------
def make_model(out_dir: str | Path, arch: str = "llama", size: str = "tiny", seed: int = 0,
               dtype: str | None = None, vocab_size: int | None = None, progress: bool = True,
               device: str | None = None, **overrides) -> Path:
    """Write the model directory; `overrides` replace Shape fields (tests use rope_scaling etc.)."""
    if arch not in ARCHS or size not in SIZES:
        raise ValueError(f"arch must be one of {sorted(ARCHS)} and size one of {SIZES}")
    shape = SHAPES[(arch, size)]
    if vocab_size is not None:
        overrides["vocab"] = vocab_size
    shape = replace(shape, **overrides)
    if shape.vocab < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab size must be at least {len(SPECIAL_TOKENS) + 256}")
    dtype = dtype or ("float32" if size in ("tiny", "small") else "bfloat16")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    # tiny/small draw on the CPU so the same seed gives the same model everywhere (tests);
    # 1b/8b draw on the GPU when there is one (minutes faster).
    big = size in ("1b", "8b")
    device = device or ("cuda" if big and torch.cuda.is_available() else "cpu")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("*.safetensors")) + list(out.glob("*.safetensors.index.json")):
        stale.unlink()

    def dump(name: str, data: dict) -> None:
        (out / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    dump("config.json", config_json(arch, shape, dtype))
    dump("generation_config.json", generation_config_json(arch))
    tok, tok_cfg = tokenizer_files(arch, shape.vocab, shape.max_pos)
    dump("tokenizer.json", tok)
    dump("tokenizer_config.json", tok_cfg)
    write_weights(out, arch, shape, torch_dtype, seed, device=device, progress=progress)
    return out


def _cli_problem(args: argparse.Namespace) -> str | None:
    """A bad argument, named, before any weight is drawn: make_model itself would stop on it
    with a traceback (or, for the directory, after drawing the weights)."""
    least = len(SPECIAL_TOKENS) + 256
    if args.vocab_size is not None and args.vocab_size < least:
        return f"--vocab-size={args.vocab_size} must be at least {least} (the tokenizer's bytes and special tokens)"
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            return f"--device={args.device!r} is not a device: give cpu, cuda or cuda:N"
        if device.type == "cuda" and not torch.cuda.is_available():
            return f"--device={args.device!r}: no CUDA device here (use cpu)"
    out = Path(args.out_dir)
    if out.exists() and not out.is_dir():
        return f"out_dir {out} exists and is not a directory"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"out_dir {out} cannot be made ({exc.strerror or exc})"
    if not os.access(out, os.W_OK):
        return f"out_dir {out} is not writable"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvmesh make-model",
        description="Write a random-weight Hugging Face model directory (config, safetensors, "
                    "tokenizer with chat template) for tests, demos and benchmarks.")
    ap.add_argument("--arch", choices=sorted(ARCHS), default="llama",
                    help="model family (mixtral and qwen3_moe are mixture-of-experts)")
    ap.add_argument("--size", choices=SIZES, default="tiny",
                    help="tiny/small: tests and CPU demos; 1b: Llama-3.2-1B-like; 8b: Llama-3.1-8B shapes "
                         "(mixtral/qwen3_moe 1b/8b: Mixtral-8x7B / Qwen3-30B-A3B layers, fewer of them)")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    ap.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default=None,
                    help="weight dtype (default float32 for tiny/small, bfloat16 for 1b/8b)")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="model vocabulary rows (the tokenizer fills at most the first 32768; "
                         "the rest are padding rows, as in many real models)")
    ap.add_argument("--device", default=None,
                    help="where random weights are drawn (default: cuda for 1b/8b if present, else cpu)")
    ap.add_argument("--mtp-layers", type=int, default=0, choices=range(0, 9), metavar="N",
                    help="append N DeepSeek-V3-style multi-token-prediction layers (0-8; for speculative "
                         "decoding's method mtp)")
    ap.add_argument("out_dir", help="directory to write (created if missing)")
    args = ap.parse_args(argv)
    if (problem := _cli_problem(args)) is not None:
        ap.error(problem)
    out = make_model(args.out_dir, args.arch, args.size, seed=args.seed, dtype=args.dtype,
                     vocab_size=args.vocab_size, device=args.device, mtp_layers=args.mtp_layers)
    print(f"wrote {args.arch} {args.size} model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
