"""A copy of a model with an MTP layer (`kvmesh make-model --mtp-layers 1`) whose MTP layer
predicts what its target will: random weights give an MTP layer no better than chance, so this
is how tests reach the acceptance path and bench/spec_decode_bench.py the upper bound of method
mtp at the model's full cost.

    target:  every decoder layer's o_proj and down_proj (each expert's too) scaled by `branch`.
             branch 0: attention and MLPs add nothing to the residual stream, so the model is a
             bigram model, logits = lm_head(norm(embed(t))); small branch: context moves a few
             argmaxes
    MTP:     enorm 1, hnorm 0, eh_proj [I | 0], its layer's o_proj / down_proj (each expert's,
             in an MoE layer) 0, its head norm the target's final norm: g_i = enorm(embed(t_{i+1})),
             so its logits are the bigram's of t_{i+1}, the target's next logits at branch 0

The shapes, and so every forward's cost, stay the model's. One shard in memory at a time.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

# The projections that write a layer's branches into the residual stream: attention's o_proj,
# a dense MLP's down_proj, and every expert's down projection (Qwen3-MoE down_proj, Mixtral w2).
_BRANCH_OUT = ("o_proj.weight", "down_proj.weight", ".w2.weight")


def write_mtp_oracle(src_dir: str | Path, out_dir: str | Path, branch: float = 0.0) -> str:
    from safetensors.torch import load_file, save_file

    src, out = Path(src_dir), Path(out_dir)
    cfg = json.loads((src / "config.json").read_text())
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    if not cfg.get("num_nextn_predict_layers"):
        raise ValueError(f"{src} has no MTP layer (config.json num_nextn_predict_layers); make one with "
                         "`kvmesh make-model --mtp-layers 1`")
    out.mkdir(parents=True, exist_ok=True)
    mtp, norm = f"model.layers.{n}.", None
    for path in sorted(src.iterdir()):
        if path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
            continue
        t = load_file(str(path))
        for name in t:
            if name.endswith(_BRANCH_OUT) and not name.startswith(mtp):
                t[name] = t[name] * branch
        norm = t.get("model.norm.weight", norm)
        overrides = {"enorm.weight": torch.ones(h), "hnorm.weight": torch.zeros(h),
                     "eh_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)}
        for name in [x for x in t if x.startswith(mtp)]:
            short = name.removeprefix(mtp)
            if short in overrides:
                t[name] = overrides[short].to(t[name].dtype)
            elif short.endswith(_BRANCH_OUT):
                t[name] = torch.zeros_like(t[name])
        save_file(t, str(out / path.name), metadata={"format": "pt"})
    # the head norm is the target's final norm (which may live in another shard)
    for path in sorted(out.glob("*.safetensors")):
        t = load_file(str(path))
        if mtp + "shared_head.norm.weight" in t:
            t[mtp + "shared_head.norm.weight"] = norm.clone()
            save_file(t, str(path), metadata={"format": "pt"})
    return str(out)
