"""Load Hugging Face safetensors checkpoints (single file or sharded) into the decoder.

Only `*.safetensors` are ever read: `.bin`/`.pt` checkpoints are pickles and are refused.
Before any tensor is read, `check_checkpoint` validates the index and every shard's header,
so a missing or truncated download fails at once with the file's name:

    model.safetensors.index.json  {"weight_map": {tensor name: shard file}}
    shard file: [u64 little-endian header length n][n bytes JSON header][tensor bytes]
                 header: {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__"}
"""
from __future__ import annotations

import json
import logging
import struct
import sys
import time
from pathlib import Path
from typing import Any, Callable, Collection

import torch

from gpu_worker.model_config import ModelLoadError
from gpu_worker.models.decoder import CausalLM

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER = 100 * 1024 * 1024
# Tensors a checkpoint may hold that the decoder recomputes or ignores.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

log = logging.getLogger("kvmesh.loader")
LOG_EVERY_S = 5.0        # off a terminal: one progress line at most this often

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def checkpoint_files(model_dir: str | Path) -> dict[str, list[str]]:
    """Shard file name -> tensor names it must hold, from the index or the single file."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index} is corrupt ({e}); re-download the model") from e
        shards: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            if "/" in file or "\\" in file or file.startswith("."):
                raise ModelLoadError(f"{index} names shard {file!r} outside the model directory")
            shards.setdefault(file, []).append(name)
        return shards
    if (model_dir / SINGLE_NAME).exists():
        return {SINGLE_NAME: []}
    found = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if found:
        return {name: [] for name in found}
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise ModelLoadError(f"{model_dir} holds only .bin/.pt (pickle) weights; kvmesh loads "
                             "safetensors only. Convert the checkpoint to safetensors first.")
    raise ModelLoadError(f"{model_dir} has no *.safetensors weights")


def read_header(path: Path) -> dict[str, dict]:
    """The tensor entries of one shard's header; raises ModelLoadError if the file is damaged."""
    if not path.is_file():
        raise ModelLoadError(f"weight shard {path.name} is missing from {path.parent}; re-download the model")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"weight shard {path} is corrupt (truncated header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise ModelLoadError(f"weight shard {path} is corrupt (bad header length)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"weight shard {path} is corrupt (header is not JSON)") from e
    header.pop("__metadata__", None)
    end = 0
    for name, info in header.items():
        try:
            begin, stop = info["data_offsets"]
            numel = 1
            for dim in info["shape"]:
                numel *= int(dim)
            expected = numel * _DTYPE_BYTES.get(info["dtype"], 0)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"weight shard {path} is corrupt (bad entry for {name})") from e
        if stop - begin != expected and info["dtype"] in _DTYPE_BYTES:
            raise ModelLoadError(f"weight shard {path} is corrupt ({name}: size does not match shape)")
        end = max(end, stop)
    if 8 + n + end != size:
        raise ModelLoadError(f"weight shard {path} is corrupt: header describes {8 + n + end} bytes, "
                             f"file has {size}; re-download the model")
    return header


def check_checkpoint(model_dir: str | Path, required: set[str]) -> dict[str, list[str]]:
    """Validate index + headers and that every required tensor exists. -> shard -> names."""
    model_dir = Path(model_dir)
    shards = {}
    for file, listed in checkpoint_files(model_dir).items():
        names = list(read_header(model_dir / file))
        missing_here = set(listed) - set(names)
        if missing_here:
            raise ModelLoadError(f"weight shard {file} lacks {sorted(missing_here)[:3]} that the index "
                                 "lists; the download is incomplete")
        shards[file] = names
    present = {n for names in shards.values() for n in names}
    missing = sorted(required - present)
    if missing:
        raise ModelLoadError(f"{model_dir} lacks {len(missing)} tensor(s) the model needs, e.g. "
                             f"{missing[:3]}; the checkpoint does not match config.json")
    return shards


def load_weights(model: CausalLM, model_dir: str | Path, progress: bool = True) -> None:
    """Copy every checkpoint tensor into `model` (converting dtype and device), showing progress
    over tensors (LoadProgress) and logging the time it took."""
    def copy(f, name: str, target) -> int:
        tensor = f.get_tensor(name)
        _copy(target, tensor, name)
        return tensor.numel() * tensor.element_size()
    copy_checkpoint(model_dir, model.hf_weight_targets(), copy, progress=progress,
                    ignored_prefixes=nextn_prefixes(model.cfg))


def nextn_prefixes(cfg: Any) -> tuple[str, ...]:
    """Checkpoint name prefixes of the multi-token-prediction layers (DeepSeek-V3 stores them as
    layers num_layers.. of the decoder): the target never loads them; spec_decode/mtp_module.py does."""
    first = cfg.num_layers
    return tuple(f"model.layers.{first + i}." for i in range(getattr(cfg, "num_nextn_predict_layers", 0)))


def copy_checkpoint(model_dir: str | Path, targets: dict, copy: Callable[[Any, str, Any], int], *,
                    progress: bool, desc: str = "loading weights", skipped: Collection[str] = (),
                    ignored_prefixes: tuple[str, ...] = ()) -> None:
    """The loop every loader runs: each checkpoint tensor that has a target goes through
    copy(open safetensors file, name, target) -> bytes read, under a LoadProgress titled `desc`.
    A tensor without a target must be one known to be unused (a tied model's lm_head.weight,
    `skipped`: another rank's, names under `ignored_prefixes`: MTP layers), else the checkpoint
    is not this architecture's: ModelLoadError naming a few."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    shards = check_checkpoint(model_dir, set(targets))
    bar = LoadProgress(sum(len(names) for names in shards.values()), progress, desc)
    unknown = []
    with torch.no_grad():
        for file, names in shards.items():
            bar.file(file)
            with safe_open(str(model_dir / file), framework="pt", device="cpu") as f:
                for name in names:
                    target = targets.get(name)
                    if target is None:
                        if not (name.endswith(_IGNORED_SUFFIXES) or name == "lm_head.weight" or name in skipped
                                or name.startswith(ignored_prefixes)):
                            unknown.append(name)
                        bar.update(0)
                        continue
                    bar.update(copy(f, name, target))
    bar.close(model_dir)
    if unknown:
        raise ModelLoadError(f"{model_dir} holds {len(unknown)} tensor(s) this architecture does not "
                             f"use, e.g. {unknown[:3]}; is config.json the right one?")


class LoadProgress:
    """A tqdm bar on a terminal; elsewhere (a service's log, a pod's) whole log lines, at most one
    per LOG_EVERY_S, since a bar's carriage returns would garble the log lines around them."""

    def __init__(self, total: int, show: bool, desc: str = "loading weights") -> None:
        self.total, self.done, self.bytes, self.name, self.desc = total, 0, 0, "", desc
        self.start = self.last = time.monotonic()
        self.bar = None
        if show and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False)
        self.lines = show and self.bar is None

    def file(self, name: str) -> None:
        self.name = name
        if self.bar is not None:
            self.bar.set_postfix_str(name)

    def update(self, nbytes: int) -> None:
        self.done, self.bytes = self.done + 1, self.bytes + nbytes
        if self.bar is not None:
            self.bar.update(1)
        elif self.lines and time.monotonic() - self.last >= LOG_EVERY_S:
            self.last = time.monotonic()
            log.info("%s: %d/%d tensors, %s (%s)", self.desc, self.done, self.total, _size(self.bytes), self.name)

    def close(self, model_dir: Path) -> None:
        if self.bar is not None:
            self.bar.close()
        secs = time.monotonic() - self.start
        log.info("%s: done, %d tensors, %s, from %s in %.1f s (%s/s)", self.desc, self.done, _size(self.bytes),
                 model_dir, secs, _size(self.bytes / max(secs, 1e-9)))


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _copy(target, tensor: torch.Tensor, name: str) -> None:
    dst = target.param if target.start is None else target.param[target.start:target.stop]
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)}, config.json implies "
                             f"{tuple(dst.shape)}")
    dst.copy_(tensor.to(device=dst.device, dtype=dst.dtype))
