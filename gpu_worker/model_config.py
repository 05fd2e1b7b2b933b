"""ModelConfig: one frozen description of a decoder-only model, parsed from a Hugging Face directory.

Supported architectures (one parameterized decoder serves them all, see models/decoder.py):

    LlamaForCausalLM    Llama 2/3/3.1/3.2 (rope_scaling "llama3"), tied or untied embeddings
    MistralForCausalLM  Llama layout; optional sliding window
    Qwen2ForCausalLM    bias on q/k/v projections
    Qwen3ForCausalLM    RMSNorm on each q/k head before RoPE; head_dim from the config
    MixtralForCausalLM  Mistral attention + a sparse MoE MLP in every layer (top-k of E experts)
    Qwen3MoeForCausalLM Qwen3 attention + sparse MoE MLPs (dense MLP in `mlp_only_layers`)

`trust_remote_code` models (an `auto_map` in config.json) are refused, never executed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelLoadError(ValueError):
    """A model directory cannot be served; the message says what is wrong and what to do."""


# architecture -> (family, qkv bias by default, per-head q/k norm)
ARCHITECTURES: dict[str, tuple[str, bool, bool]] = {
    "LlamaForCausalLM": ("llama", False, False),
    "MistralForCausalLM": ("mistral", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
    "MixtralForCausalLM": ("mixtral", False, False),
    "Qwen3MoeForCausalLM": ("qwen3_moe", False, True),
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """rope_scaling of config.json. "linear" uses only `factor`; "llama3" uses all four."""
    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str            # e.g. "LlamaForCausalLM"
    family: str                  # "llama" | "mistral" | "qwen2" | "qwen3" | "mixtral" | "qwen3_moe"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool               # bias on q/k/v projections (Qwen2; attention_bias elsewhere)
    o_proj_bias: bool            # bias on o_proj (Llama/Qwen3 attention_bias=True only)
    qk_norm: bool                # Qwen3: RMSNorm over head_dim on q and k before RoPE
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    torch_dtype: str             # checkpoint dtype, e.g. "bfloat16"
    sliding_window: int | None = None
    path: str = ""               # the directory it was read from
    # Mixture of experts (Mixtral, Qwen3-MoE); num_experts 0 = a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0   # each expert's intermediate size
    norm_topk_prob: bool = True      # renormalize the top-k routing weights to sum to 1
    moe_layers: tuple[int, ...] = ()  # decoder layers whose MLP is the sparse MoE block
    # MTP layers (checkpoint indices num_layers..) whose MLP is sparse: the family's rule applied
    # to that index, as DeepSeek-V3 and vLLM do (DeepSeek-V3's layer 61 is MoE)
    mtp_moe_layers: tuple[int, ...] = ()
    # Multi-token-prediction modules after the decoder layers (DeepSeek-V3's
    # num_nextn_predict_layers): checkpoint layers num_layers .. num_layers + this - 1, read only
    # by speculative_config {"method": "mtp"} (gpu_worker/spec_decode/mtp.py).
    num_nextn_predict_layers: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def has_sparse_mlp(self, layer_idx: int) -> bool:
        """Whether checkpoint layer `layer_idx` (a decoder layer, or an MTP layer past them) has
        the sparse MoE MLP."""
        return layer_idx in self.moe_layers or layer_idx in self.mtp_moe_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ModelLoadError(f"model directory {str(model_dir)!r} does not exist")
        raw = _read_json(model_dir / "config.json", what="config.json (the model's Hugging Face config)")
        gen_path = model_dir / "generation_config.json"
        gen = _read_json(gen_path, what="generation_config.json") if gen_path.exists() else {}
        return cls.from_dict(raw, generation=gen, path=str(model_dir))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None,
                  path: str = "") -> "ModelConfig":
        generation = generation or {}
        if raw.get("auto_map") or raw.get("trust_remote_code"):
            raise ModelLoadError(
                "this model needs custom code (config.json has 'auto_map'); kvmesh never runs code "
                "shipped with a model. Use a supported architecture: " + ", ".join(ARCHITECTURES))
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"kvmesh serves {', '.join(ARCHITECTURES)}")
        family, default_bias, qk_norm = ARCHITECTURES[arch]
        get = _getter(raw, arch)

        hidden, heads = get("hidden_size", int), get("num_attention_heads", int)
        kv_heads = get("num_key_value_heads", int, default=heads)
        head_dim = raw.get("head_dim") or hidden // heads
        if heads % kv_heads:
            raise ModelLoadError(f"{arch}: num_attention_heads ({heads}) must be a multiple of "
                                 f"num_key_value_heads ({kv_heads})")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{arch}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        if raw.get("mlp_bias"):
            raise ModelLoadError(f"{arch}: mlp_bias=true is not supported")
        if family in ("qwen2", "qwen3", "qwen3_moe") and raw.get("use_sliding_window"):
            raise ModelLoadError(f"{arch}: use_sliding_window=true is not supported")
        attention_bias = bool(raw.get("attention_bias", False))
        rope_theta, rope_scaling = _parse_rope(raw, arch)
        sliding = raw.get("sliding_window") if family in ("mistral", "mixtral") else None
        nextn = _nextn_layers(raw, arch)
        return cls(
            architecture=arch, family=family, hidden_size=hidden, num_layers=get("num_hidden_layers", int),
            num_heads=heads, num_kv_heads=kv_heads, head_dim=int(head_dim),
            intermediate_size=get("intermediate_size", int), vocab_size=get("vocab_size", int),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=default_bias or attention_bias,
            o_proj_bias=attention_bias and family != "qwen2",
            qk_norm=qk_norm,
            eos_token_ids=_eos_ids(generation.get("eos_token_id"), raw.get("eos_token_id")),
            bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
            pad_token_id=generation.get("pad_token_id", raw.get("pad_token_id")),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            sliding_window=int(sliding) if sliding else None,
            path=path,
            num_nextn_predict_layers=nextn,
            **_moe_fields(raw, family, get, nextn),
        )


def _moe_fields(raw: dict[str, Any], family: str, get, nextn: int) -> dict[str, Any]:
    """Mixtral: every layer sparse, experts as wide as intermediate_size, weights renormalized.
    Qwen3-MoE: layer i sparse unless in mlp_only_layers or (i+1) % decoder_sparse_step != 0.
    The `nextn` MTP layers (indices layers..layers+nextn-1) follow the same rule at their index."""
    if family not in ("mixtral", "qwen3_moe"):
        return {}
    layers = get("num_hidden_layers", int)
    if family == "mixtral":
        experts, inter, renorm = get("num_local_experts", int), get("intermediate_size", int), True
        sparse = tuple(range(layers + nextn))
    else:
        experts, inter = get("num_experts", int), get("moe_intermediate_size", int)
        renorm = bool(raw.get("norm_topk_prob", False))
        step, dense = int(raw.get("decoder_sparse_step") or 1), set(raw.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(layers + nextn) if i not in dense and (i + 1) % step == 0)
    top_k = get("num_experts_per_tok", int)
    if top_k > experts:
        raise ModelLoadError(f"num_experts_per_tok ({top_k}) exceeds the number of experts ({experts})")
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
                norm_topk_prob=renorm, moe_layers=tuple(i for i in sparse if i < layers),
                mtp_moe_layers=tuple(i for i in sparse if i >= layers))


MAX_NEXTN_LAYERS = 8


def _nextn_layers(raw: dict[str, Any], arch: str) -> int:
    value = raw.get("num_nextn_predict_layers") or 0
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_NEXTN_LAYERS:
        raise ModelLoadError(f"{arch} config.json: 'num_nextn_predict_layers' must be an integer in "
                             f"[0, {MAX_NEXTN_LAYERS}], got {value!r}")
    return value


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing: a model directory needs {what}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}); re-download or re-create the model") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def _getter(raw: dict[str, Any], arch: str):
    missing = object()

    def get(key: str, typ: type, default: Any = missing) -> Any:
        value = raw.get(key, default)
        if value is missing or value is None:
            raise ModelLoadError(f"{arch} config.json lacks {key!r}")
        try:
            value = typ(value)
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{arch} config.json: {key!r} must be {typ.__name__}, got {value!r}") from e
        if typ is int and value <= 0:
            raise ModelLoadError(f"{arch} config.json: {key!r} must be positive, got {value}")
        return value

    return get


def _parse_rope(raw: dict[str, Any], arch: str) -> tuple[float, RopeScaling | None]:
    # Two spellings exist: the classic `rope_theta` + `rope_scaling`, and transformers 5's
    # `rope_parameters` ({"rope_type", "rope_theta", ...}).
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"{arch}: rope scaling type {rope_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return theta, None
    try:
        if rope_type == "linear":
            return theta, RopeScaling("linear", factor=float(scaling["factor"]))
        return theta, RopeScaling(
            "llama3", factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    except KeyError as e:
        raise ModelLoadError(f"{arch}: rope scaling {rope_type!r} lacks {e.args[0]!r}") from None


def _eos_ids(*candidates: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for value in candidates:
        for token in (value if isinstance(value, list) else [value]):
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return tuple(ids)
