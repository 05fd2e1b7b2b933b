"""Draft models for the draft_model tests, made from the session's tiny targets
(tests/gpu_worker/engine/conftest.py):

    near   the target with its final norm's weights rescaled by random per-channel factors:
           q follows p loosely (greedy drafts accepted often, not always; sampled drafts hit
           both branches of speculative sampling)
    small  an independent one-layer model of the same architecture and tokenizer (acceptance
           near zero on random weights: the rollback path)
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

NORM = "model.norm.weight"


def near_copy(target_dir: str, out_dir: Path, noise: float, seed: int = 0) -> str:
    """A copy of target_dir with NORM multiplied by exp(noise * N(0, 1)) per channel."""
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for path in Path(target_dir).iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, out_dir / path.name)
            continue
        tensors = load_file(str(path))
        if NORM in tensors:
            w = tensors[NORM]
            tensors[NORM] = (w * torch.exp(noise * torch.randn(w.shape, generator=gen))).to(w.dtype)
        save_file(tensors, str(out_dir / path.name), metadata={"format": "pt"})
    return str(out_dir)


def small_draft(arch: str, out_dir: Path) -> str:
    from gpu_worker.make_model import make_model
    return str(make_model(out_dir, arch=arch, size="tiny", seed=1, layers=1, progress=False))


def draft_spec(model_dir: str, k: int = 3, disable_by_batch_size: int = 64) -> str:
    return json.dumps({"method": "draft_model", "model": model_dir, "num_speculative_tokens": k,
                       "disable_by_batch_size": disable_by_batch_size})
