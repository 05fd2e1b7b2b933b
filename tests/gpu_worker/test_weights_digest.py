"""The weights' digest: content only (the same bytes anywhere agree, whatever their mtimes), and
any changed byte of any tensor or of config.json changes it; a failed load cancels it."""
from __future__ import annotations

import json
import os
import shutil
import threading

import pytest
import torch
from safetensors.torch import save_file

from gpu_worker.model_config import ModelLoadError
from gpu_worker.weights_digest import DigestCancelled, DigestJob, weights_digest, weights_files


def _model(path, shards: int = 1) -> str:
    """A model directory of `shards` safetensors files (+ index when sharded) and a config.json."""
    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i}.w": torch.randn(64, 32, generator=g) for i in range(4)}
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
    else:
        names = sorted(tensors)
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s::shards]}
            save_file(part, str(path / file))
            weight_map.update(dict.fromkeys(part, file))
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    return str(path)


def _flip_last_byte(path: str) -> None:
    """One byte of the last tensor's data (the file's tail), as a merged LoRA changes a few tensors."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("shards", [1, 3])
def test_the_same_bytes_agree_anywhere_and_one_changed_byte_differs(tmp_path, shards):
    original = _model(tmp_path / "a" / "m", shards)
    digest = weights_digest(original)
    assert len(digest) == 32 and digest == weights_digest(original)
    copy = str(tmp_path / "b" / "other-name")
    shutil.copytree(original, copy, copy_function=shutil.copyfile)      # new mtimes, new path
    os.utime(os.path.join(copy, "config.json"), ns=(1, 1))
    assert weights_digest(copy) == digest

    shard = os.path.join(copy, weights_files(copy)[-1])
    _flip_last_byte(shard)
    assert weights_digest(copy) not in ("", digest)
    _flip_last_byte(shard)                                              # back: agrees again
    assert weights_digest(copy) == digest
    with open(os.path.join(copy, "config.json"), "a") as f:             # e.g. another rope scaling
        f.write(" ")
    assert weights_digest(copy) != digest


def test_unindexed_files_are_not_part_of_it_and_unreadable_ones_fail_loudly(tmp_path):
    model = _model(tmp_path / "m", shards=2)
    digest = weights_digest(model)
    save_file({"x": torch.zeros(2)}, os.path.join(model, "stray.safetensors"))   # the loader never reads it
    assert weights_digest(model) == digest
    os.remove(os.path.join(model, "config.json"))
    with pytest.raises(ModelLoadError, match="config.json to identify the model's weights"):
        weights_digest(model)


def test_the_job_hands_back_its_digest_or_error_and_a_stopped_hash_ends(tmp_path):
    model = _model(tmp_path / "m")
    assert DigestJob(model).result() == weights_digest(model)
    with pytest.raises(ModelLoadError):                         # raised in the caller's thread
        DigestJob(str(tmp_path / "missing")).result()
    stop = threading.Event()
    stop.set()                                                  # a failed load: nobody waits for it
    with pytest.raises(DigestCancelled):
        weights_digest(model, stop)
