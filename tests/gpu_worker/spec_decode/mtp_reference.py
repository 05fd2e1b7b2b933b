"""A plain-torch MTP layer read straight from a checkpoint's safetensors, for checking
gpu_worker/models/mtp_module.py (and the loader's name mapping) without any of kvmesh's modules:

    x = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])
    x = x + o_proj(causal_gqa_attention(rope(q_norm(q)), rope(k_norm(k)), v))     of input_layernorm(x)
    g = x + mlp(post_attention_layernorm(x))        mlp: MoE (softmax, top-k, renormalized if the
                                                    family does) or SwiGLU, from the tensors present
    logits = lm_head(shared_head.norm(g))

Weight names are written out here as the Hugging Face / DeepSeek-V3 checkpoints spell them.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

# MoE block, then each expert's gate / up / down projection, as the hub checkpoints name them
_EXPERTS = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
            "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}


def _weights(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        out.update({k: v.float() for k, v in load_file(str(path)).items()})
    return out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """(T, heads, D), positions 0..T-1, rotate-half (neox) layout."""
    t, d = x.shape[0], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = torch.outer(torch.arange(t, dtype=torch.float64), inv)            # (T, D/2)
    cos, sin = (torch.cat([f, f], -1).float()[:, None, :] for f in (freqs.cos(), freqs.sin()))
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class ReferenceMTP:
    def __init__(self, model_dir: str) -> None:
        self.c = json.loads((Path(model_dir) / "config.json").read_text())
        self.w = _weights(model_dir)
        self.p = f"model.layers.{self.c['num_hidden_layers']}."

    def is_moe(self) -> bool:
        return self.p + "mlp.gate_proj.weight" not in self.w

    def g(self, next_tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """next_tokens t_1..t_n, hidden (n, H) = h_0..h_{n-1} -> g (n, H)."""
        c, w, p, eps = self.c, self.w, self.p, self.c["rms_norm_eps"]
        emb = w["model.embed_tokens.weight"][torch.tensor(next_tokens)]
        x = torch.cat([_rms(emb, w[p + "enorm.weight"], eps), _rms(hidden.float(), w[p + "hnorm.weight"], eps)], -1)
        x = x @ w[p + "eh_proj.weight"].T                                               # (n, H)
        x = x + self._attention(_rms(x, w[p + "input_layernorm.weight"], eps))
        return x + self._mlp(_rms(x, w[p + "post_attention_layernorm.weight"], eps))

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        return _rms(g, self.w[self.p + "shared_head.norm.weight"], self.c["rms_norm_eps"]) @ head.T

    def _attention(self, a: torch.Tensor) -> torch.Tensor:
        c, w, p = self.c, self.w, self.p + "self_attn."
        n, nh, nkv = a.shape[0], c["num_attention_heads"], c["num_key_value_heads"]
        d = c.get("head_dim") or c["hidden_size"] // nh
        q = (a @ w[p + "q_proj.weight"].T).view(n, nh, d)
        k = (a @ w[p + "k_proj.weight"].T).view(n, nkv, d)
        v = (a @ w[p + "v_proj.weight"].T).view(n, nkv, d)
        if p + "q_norm.weight" in w:                                                  # Qwen3
            eps = c["rms_norm_eps"]
            q, k = _rms(q, w[p + "q_norm.weight"], eps), _rms(k, w[p + "k_norm.weight"], eps)
        q, k = _rope(q, c["rope_theta"]), _rope(k, c["rope_theta"])
        k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))               # (n, nh, d)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return out.transpose(0, 1).reshape(n, nh * d) @ w[p + "o_proj.weight"].T

    def _mlp(self, m: torch.Tensor) -> torch.Tensor:
        w, p = self.w, self.p
        if not self.is_moe():
            return (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) \
                @ w[p + "mlp.down_proj.weight"].T
        block, gate, up, down = _EXPERTS[self.c["model_type"]]
        b = f"{p}{block}."
        probs = torch.softmax(m @ w[b + "gate.weight"].T, -1)                         # (n, E)
        top, ids = torch.topk(probs, self.c["num_experts_per_tok"], -1)
        if self.c["model_type"] == "mixtral" or self.c.get("norm_topk_prob"):
            top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(m)
        for t in range(m.shape[0]):
            for weight, e in zip(top[t].tolist(), ids[t].tolist()):
                x = m[t]
                y = F.silu(x @ w[f"{b}experts.{e}.{gate}.weight"].T) * (x @ w[f"{b}experts.{e}.{up}.weight"].T)
                out[t] += weight * (y @ w[f"{b}experts.{e}.{down}.weight"].T)
        return out
