"""One decoder-only transformer for every supported family (Llama, Mistral, Qwen2, Qwen3, and the
MoE families Mixtral and Qwen3-MoE, whose layers in `cfg.moe_layers` use models/moe.py's SparseMoE;
so does an MTP layer in `cfg.mtp_moe_layers`, models/mtp_module.py).

The families differ only in flags of ModelConfig: q/k/v bias (Qwen2), per-head q/k RMSNorm
(Qwen3), rope scaling (Llama 3.1), tied embeddings. The model runs over a ragged ForwardBatch:
T new tokens of all sequences flattened into rows, no padding; attention reads and writes the
paged KV cache through an AttentionBackend.

    input_ids (T,) -> embed -> [RMSNorm -> attention -> +res -> RMSNorm -> SwiGLU -> +res] x L
                   -> RMSNorm -> hidden (T, H);  compute_logits(hidden rows) -> (S, V) fp32

Parameters are stored fused (qkv_proj, gate_up_proj); `hf_weight_targets` maps every Hugging
Face tensor name onto the row range of the fused parameter it fills.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from gpu_worker.attention.base import AttentionBackend
from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.model_config import ModelConfig
from gpu_worker.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from gpu_worker.models.moe import EXPERT_NAMES, SparseMoE
from gpu_worker.tuning import KernelTuning

KVCache = tuple[torch.Tensor, torch.Tensor]  # per layer: (num_blocks, block_size, n_kv, head_dim) x 2


class WeightTarget(NamedTuple):
    """Where one checkpoint tensor goes: rows [start, stop) of `param` (the whole param if None)."""
    param: nn.Parameter
    start: int | None = None
    stop: int | None = None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, backend: AttentionBackend, dtype, kernels=None):
        super().__init__()
        self.kernels = kernels   # gpu_worker.models.layers.fused launchers (CUDA), or None: torch ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias, dtype=dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, kernels) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, kernels) if cfg.qk_norm else None
        self.rope = rope          # the same RotaryEmbedding object in every layer: one cos/sin table
        self.backend = backend    # not an nn.Module: the runner owns it

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: KVCache, batch: ForwardBatch):
        out = self.rotate_attend(self.qkv_proj(x), positions, kv, batch)    # (T, nh, D)
        return self.o_proj(out.reshape(x.shape[0], self.q_size))            # (T, H)

    def rotate_attend(self, qkv: torch.Tensor, positions: torch.Tensor, kv: KVCache, batch: ForwardBatch):
        """rotate() then attend() -> (T, nh, D). A pure-decode step goes to the backend's
        decode_rope_attend where it fuses (triton: fuse_rope_decode), which runs RoPE, the KV write and attention
        as one kernel where that is faster (long contexts; q and k then stay unrotated in qkv)."""
        if (self.kernels is not None and self.q_norm is None and batch.is_pure_decode
                and self.backend.fuse_rope_decode):
            t = qkv.shape[0]
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            return self.backend.decode_rope_attend(
                q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                v.view(t, self.num_kv_heads, self.head_dim), positions, self.rope.cos_sin, kv[0], kv[1],
                batch, self.scale)
        q, k, v, cached = self.rotate(qkv, positions, kv, batch.slot_mapping)
        return self.attend(q, k, v, cached, kv, batch)

    def project(self, x: torch.Tensor, positions: torch.Tensor, kv: KVCache, slot_mapping: torch.Tensor):
        """The part before attention proper -> (q, k, v, cached): q (T, nh, D) and k (T, nkv, D)
        rotated, v (T, nkv, D); `cached` when this step's K/V are already in the cache (the fused
        RoPE + KV-write kernel). Reads no lengths on the host: piecewise CUDA graphs capture it."""
        return self.rotate(self.qkv_proj(x), positions, kv, slot_mapping)

    def rotate(self, qkv: torch.Tensor, positions: torch.Tensor, kv: KVCache, slot_mapping: torch.Tensor):
        """project() after the qkv projection: qkv (T, q_size + 2 kv_size) -> (q, k, v, cached)."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)        # (T, nh, D)
        k = k.view(t, self.num_kv_heads, self.head_dim)     # (T, nkv, D)
        v = v.view(t, self.num_kv_heads, self.head_dim)     # (T, nkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.kernels is not None and self.backend.writes_rope_kv:
            # one kernel rotates q, k in place (views of the qkv output) and writes the KV cache
            self.backend.rope_kv_write(q, k, v, positions, self.rope.cos_sin, kv[0], kv[1], slot_mapping)
            return q, k, v, True
        if self.kernels is not None:                          # in place on the qkv views
            self.kernels.rope_(positions, q, k, self.rope.cos_sin)
        else:
            q, k = self.rope(positions, q, k)
        return q, k, v, False

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: bool, kv: KVCache,
               batch: ForwardBatch) -> torch.Tensor:
        """Attention proper over the paged cache -> (T, nh, D); writes K/V first unless `cached`."""
        if cached:
            return self.backend.attend(q, kv[0], kv[1], batch, self.scale, k, v)
        return self.backend.forward(q, k, v, kv[0], kv[1], batch, self.scale)


def runs_gemv(kernels, gemv_max_m: int, x: torch.Tensor) -> bool:
    """Whether a step of these rows runs its linears as GEMVs (kernels loaded, 1..gemv_max_m rows)."""
    return kernels is not None and 0 < x.shape[0] <= min(gemv_max_m, kernels.gemv_max_rows)


class NormedStream(NamedTuple):
    """What a fused-GEMV layer returns as its `residual`: the residual stream with both adds done,
    while the x it returns is already RMSNorm(stream) with the weights of the norm that comes next
    (the next layer's input_layernorm, or the model's final norm): that norm ran in the layer's
    last GEMV (fp8_gemv's norm_out epilogue), not as a kernel of its own."""
    stream: torch.Tensor


class DecoderLayer(nn.Module):
    """Steps of 1..gemv_max_m tokens (at most fp8_gemv.MAX_M) on CUDA, in layers whose weights are
    fp8 (gemv_weights "fp8") or any (gemv_weights "all"), run every linear as the split-K GEMV of
    kernels/fp8_gemv.py instead of cuBLAS / _scaled_mm, so a layer is Triton kernels only and each
    launches early under programmatic dependent launch (kernels/_pdl.py). gemv_fuse False: the
    norms and SwiGLU stay kernels of their own. gemv_fuse True: they move into the epilogue of
    the GEMV before them (fp8_gemv's norm_out and swiglu_out): o_proj adds the residual and
    writes the post-attention norm, gate_up writes SwiGLU, down adds the residual and writes the
    next layer's input norm (NormedStream): three kernels fewer a layer, no work repeated.
    (Fusing them into the GEMVs' prologues instead, where every program redoes the norm /
    SwiGLU of its x, was slower than separate kernels on the H200.)
    One row, any weights, unfused, by default (the fused layer measured slower with PDL:
    docs/architecture.md says why); M > 1 is unmeasured.

    Steps of at least residual_gemm_min_rows tokens add the residual inside the o_proj and
    down_proj GEMMs (cuBLAS's C input: stream.addmm_(x, W^T)) instead of in the next norm's
    kernel, whose fused add-and-norm (read x and residual, write both) becomes a plain norm (read
    the stream, write the normed rows): 4 of a layer's 8 passes over the (T, hidden) activations
    gone, ~4 ms of a 16,384-token Llama-8B step on the H200. The sum is rounded once (Hugging Face
    rounds the GEMM's output, then the sum).

    All four come from the engine's KernelTuning (decode_gemv_max_m, decode_gemv_weights,
    decode_gemv_fuse, residual_gemm_min_rows), copied into attributes at construction."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, backend: AttentionBackend, dtype,
                 layer_idx: int = 0, tuning: KernelTuning = KernelTuning(), kernels=None):
        super().__init__()
        self.kernels = kernels   # gpu_worker.models.layers.fused launchers (CUDA), or None: torch ops
        self.gemv_max_m, self.gemv_weights = tuning.decode_gemv_max_m, tuning.decode_gemv_weights
        self.gemv_fuse, self.residual_gemm_min_rows = tuning.decode_gemv_fuse, tuning.residual_gemm_min_rows
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)
        self.self_attn = Attention(cfg, rope, backend, dtype, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)
        if cfg.has_sparse_mlp(layer_idx):
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                 cfg.num_experts_per_tok, cfg.norm_topk_prob, dtype)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, kernels)

    def forward(self, x, residual, positions, kv: KVCache, batch: ForwardBatch, next_norm: RMSNorm | None = None):
        """x (T, H): the previous layer's MLP output (or the embeddings); residual (T, H): the
        residual stream before x is added (None in the first layer), or a NormedStream (x is
        then this layer's input norm, done). -> (mlp out, residual); the adds happen inside the
        norms (one fused kernel each on CUDA). The fused-GEMV path returns (next_norm(stream),
        NormedStream(stream)) instead, or (stream, None) without a next_norm."""
        if isinstance(residual, NormedStream):
            h, residual = x, residual.stream
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        if runs_gemv(self.kernels, self.gemv_max_m, x):
            ops = self._gemv_operands()
            if ops is not None:
                return self._forward_gemv(ops, h, residual, positions, kv, batch, next_norm)
        if x.shape[0] >= self.residual_gemm_min_rows and self._residual_gemm_ok():
            return self._forward_residual_gemm(h, residual, positions, kv, batch)
        h = self.self_attn(h, positions, kv, batch)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual

    def _residual_gemm_ok(self) -> bool:
        """Plain 16-bit nn.Linear o_proj / down_proj without bias (not fp8, not a tensor-parallel
        shard whose partial sums are reduced after the GEMM) and a GatedMLP."""
        attn, mlp = self.self_attn, self.mlp
        return (type(mlp) is GatedMLP and type(attn.o_proj) is nn.Linear and type(mlp.down_proj) is nn.Linear
                and attn.o_proj.bias is None)

    def _forward_residual_gemm(self, h, stream, positions, kv, batch):
        """forward() after the input norm (h normalized, stream the residual stream, owned by this
        step's forward and updated in place) with both residual adds inside the GEMMs. Returns
        (stream, None): the next norm is then a plain RMSNorm of the stream (add_forward(x, None))."""
        attn, mlp = self.self_attn, self.mlp
        out = attn.rotate_attend(attn.qkv_proj(h), positions, kv, batch)        # (T, nh, D)
        stream.addmm_(out.reshape(h.shape[0], attn.q_size), attn.o_proj.weight.t())   # stream += o_proj(out)
        act = mlp.activation(self.post_attention_layernorm(stream))               # (T, inter)
        stream.addmm_(act, mlp.down_proj.weight.t())                               # stream += down(act)
        return stream, None

    def _gemv_operands(self) -> list | None:
        """(weight, scale, bias) of qkv, o_proj, gate_up, down; None when a layer is not a plain or
        fp8 linear (tensor-parallel shards), the MLP is not a GatedMLP (MoE), or the weights are
        16-bit while gemv_weights is "fp8"."""
        from gpu_worker.models.layers.fp8 import gemv_operands
        if type(self.mlp) is not GatedMLP:
            return None
        attn, mlp = self.self_attn, self.mlp
        ops = [gemv_operands(lin) for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(o is None for o in ops) or (self.gemv_weights == "fp8" and any(o[1] is None for o in ops)):
            return None
        return ops

    def _forward_gemv(self, ops: list, h, residual, positions, kv: KVCache, batch: ForwardBatch,
                      next_norm: RMSNorm | None):
        """forward() after the input norm (h normalized, residual the stream) with every linear a
        plain GEMV (16-bit weights too, which nn.Linear would send to cuBLAS); gemv_fuse: with the
        norms and SwiGLU in the GEMVs' epilogues."""
        qkv, o, gate_up, down = ops
        gemv, attn, norm2 = self.kernels.gemv, self.self_attn, self.post_attention_layernorm
        out = attn.rotate_attend(gemv(h, *qkv), positions, kv, batch).reshape(h.shape[0], attn.q_size)
        if not self.gemv_fuse:
            h, residual = norm2.add_forward(gemv(out, *o), residual)
            return gemv(self.kernels.swiglu(gemv(h, *gate_up)), *down), residual
        h, residual = gemv(out, *o, residual=residual, norm_out=(norm2.weight, norm2.eps))
        act = gemv(h, *gate_up, swiglu_out=True)
        if next_norm is None:
            return gemv(act, *down, residual=residual), None
        h, residual = gemv(act, *down, residual=residual, norm_out=(next_norm.weight, next_norm.eps))
        return h, NormedStream(residual)


class DecoderModel(nn.Module):
    """HF's `model.*` part: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, backend: AttentionBackend, dtype,
                 tuning: KernelTuning = KernelTuning(), kernels=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope, backend, dtype, i, tuning, kernels)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)


class CausalLM(nn.Module):
    """The decoder with its head. With tuning.head_gemv, steps whose rows the decoder layers run as
    GEMVs (decode_gemv_max_m; 16-bit heads only where decode_gemv_weights is "all") also run the
    16-bit lm_head as fp8_gemv's split-K GEMV instead of cuBLAS: under programmatic dependent
    launch its programs start while the final norm finishes, and it is the step's largest read
    (1 GB of Llama-8B's 16 GB); False: cuBLAS (the A/B's baseline).

    `kernels`: the Triton launchers (gpu_worker.models.layers.fused.load_fused_kernels) every
    layer, norm and MLP is built with; None: plain torch ops (CPU)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype = torch.float32,
                 tuning: KernelTuning = KernelTuning(), kernels=None):
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels
        # the head's GEMV rows: 0 (never) unless the layers' GEMV path takes 16-bit weights
        self.head_gemv_max_m = (tuning.decode_gemv_max_m if tuning.head_gemv and tuning.decode_gemv_weights == "all"
                                else 0)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.model = DecoderModel(cfg, self.rope, backend, dtype, tuning, kernels)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype))
        self.head_fp8 = None     # quantization="fp8_lm_head": the head in e4m3 (layers/fp8.py)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], batch: ForwardBatch) -> torch.Tensor:
        """input_ids, positions (T,) -> final hidden states (T, H) after the last norm."""
        return self.forward_with_prenorm(input_ids, positions, kv_caches, batch)[0]

    def forward_with_prenorm(self, input_ids: torch.Tensor, positions: torch.Tensor,
                             kv_caches: list[KVCache], batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (final hidden states after the last norm, the residual stream before it), (T, H)
        each. The second is what a multi-token-prediction module reads (DeepSeek-V3's h_i)."""
        x, residual = self.model.embed_tokens(input_ids), None  # (T, H)
        layers = self.model.layers
        for i, (layer, kv) in enumerate(zip(layers, kv_caches)):
            if batch.layer_loads is not None:       # layer i's loaded blocks land before it reads them
                batch.layer_loads.before_layer(i)
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x, residual = layer(x, residual, positions, kv, batch, next_norm)
        if isinstance(residual, NormedStream):      # the last layer wrote the final norm
            return x, residual.stream
        return self.model.norm.add_forward(x, residual)

    def use_fused_kernels(self, kernels) -> None:
        """Switch a built model's launchers (an A/B of benchmarks and tests: the model is built with
        its own): RMSNorm(+residual), RoPE, SwiGLU and the GEMVs through `kernels`, or torch (None)."""
        for module in self.modules():
            if isinstance(module, (CausalLM, DecoderLayer, Attention, RMSNorm, GatedMLP)):
                module.kernels = kernels

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, H) -> (S, V) float32."""
        return self.compute_logits_raw(hidden).float()

    def compute_logits_raw(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, H) -> (S, V) in the model's dtype: Hugging Face's logits before its .float(). The
        sampler casts only the rows whose maths needs float32 (a greedy argmax needs none), which
        spares a big decode step the (S, V) float32 copy: 0.4 ms at 1,000 rows on the H200."""
        if self.head_fp8 is not None:
            return self.head_fp8(hidden)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if (hidden.dim() == 2 and hidden.stride(1) == 1
                and runs_gemv(self.kernels, self.head_gemv_max_m, hidden)):
            return self.kernels.gemv(hidden, weight, None, None)   # rounded like cuBLAS's
        return hidden @ weight.t()

    def hf_weight_targets(self) -> dict[str, WeightTarget]:
        """Hugging Face tensor name -> the (slice of the) parameter it loads into."""
        cfg, targets = self.cfg, {}
        targets["model.embed_tokens.weight"] = WeightTarget(self.model.embed_tokens.weight)
        targets["model.norm.weight"] = WeightTarget(self.model.norm.weight)
        if self.lm_head is not None:
            targets["lm_head.weight"] = WeightTarget(self.lm_head.weight)
        for i, layer in enumerate(self.model.layers):
            targets.update(layer_weight_targets(cfg, layer, f"model.layers.{i}."))
        return targets


def layer_weight_targets(cfg: ModelConfig, layer: DecoderLayer, p: str) -> dict[str, WeightTarget]:
    """Hugging Face tensor names of one decoder layer stored under prefix `p` -> its parameters."""
    targets, attn = {}, layer.self_attn
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    targets[p + "input_layernorm.weight"] = WeightTarget(layer.input_layernorm.weight)
    targets[p + "post_attention_layernorm.weight"] = WeightTarget(layer.post_attention_layernorm.weight)
    rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    for name, (a, b) in rows.items():
        targets[p + f"self_attn.{name}.weight"] = WeightTarget(attn.qkv_proj.weight, a, b)
        if cfg.qkv_bias:
            targets[p + f"self_attn.{name}.bias"] = WeightTarget(attn.qkv_proj.bias, a, b)
    targets[p + "self_attn.o_proj.weight"] = WeightTarget(attn.o_proj.weight)
    if cfg.o_proj_bias:
        targets[p + "self_attn.o_proj.bias"] = WeightTarget(attn.o_proj.bias)
    if cfg.qk_norm:
        targets[p + "self_attn.q_norm.weight"] = WeightTarget(attn.q_norm.weight)
        targets[p + "self_attn.k_norm.weight"] = WeightTarget(attn.k_norm.weight)
    if isinstance(layer.mlp, SparseMoE):
        targets.update(layer.mlp.hf_weight_targets(p, EXPERT_NAMES[cfg.family]))
        return targets
    targets[p + "mlp.gate_proj.weight"] = WeightTarget(layer.mlp.gate_up_proj.weight, 0, inter)
    targets[p + "mlp.up_proj.weight"] = WeightTarget(layer.mlp.gate_up_proj.weight, inter, 2 * inter)
    targets[p + "mlp.down_proj.weight"] = WeightTarget(layer.mlp.down_proj.weight)
    return targets
