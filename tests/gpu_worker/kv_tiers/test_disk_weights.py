"""A disk tier outlives its engine, not its weights: a restart on other weights of the same shape
under the same name (a fine-tune, a new revision: a `helm upgrade` on a persistent volume) drops
every file and recomputes with the new weights' tokens; the same weights copied elsewhere (new
path, new mtimes) restore."""
from __future__ import annotations

import logging
import os
import shutil

from gpu_worker.make_model import make_model
from gpu_worker.service.main import kv_layout
from tests.gpu_worker.kv_tiers.conftest import (
    HFReference, check_all_tiers, prompt_hashes, push_out, run, tier_stats, tiered_engine, tokens)

DISK = dict(kv_offload_disk_gb=0.001)


def _first_life(model_dir: str, directory: str) -> list[int]:
    """An engine answers a prompt, its blocks go down to disk, it closes: the next turn's prompt."""
    eng = tiered_engine(model_dir, kv_offload_dir=directory, **DISK)
    try:
        history = tokens(26, 7)
        answer, _ = run(eng, "first", history)
        push_out(eng, 1)
        assert all(h in eng.kv_tiers.disk for h in prompt_hashes(eng, history)[:6])
        return history + answer + tokens(5, 8)
    finally:
        eng.close()


def _block_files(directory: str) -> int:
    return sum(name.endswith(".kvb") for name in os.listdir(directory))


def test_other_weights_under_the_same_name_drop_every_file_and_recompute(llama, tmp_path, caplog):
    served = str(tmp_path / "served" / "llama")           # one path, one model id, two weights
    shutil.copytree(llama[0], served)
    directory = str(tmp_path / "kv")
    prompt = _first_life(served, directory)
    files = _block_files(directory)
    make_model(served, arch="llama", size="tiny", seed=1, progress=False)     # the upgrade: same shapes
    hf = HFReference(served)

    with caplog.at_level(logging.INFO, logger="kvmesh.kv_tiers"):
        eng = tiered_engine(served, kv_offload_dir=directory, **DISK)
    try:
        stats = tier_stats(eng)
        assert stats["disk_restored_blocks"] == 0 and _block_files(directory) == 0, stats
        [line] = [r.getMessage() for r in caplog.records if "another KV layout" in r.getMessage()]
        assert f"deleted {files} block files" in line and "weights_digest" in line, line
        assert kv_layout(eng)["weights_digest"] == eng.setup.weights_digest != ""   # what the scheduler pairs by
        answer, _ = run(eng, "second", prompt)
        assert answer == hf.greedy(prompt, len(answer))[0]
        assert tier_stats(eng)["loaded_blocks"]["disk"] == 0
        check_all_tiers(eng)
    finally:
        eng.close()


def test_the_same_weights_in_another_directory_restore(llama, tmp_path):
    first, second = str(tmp_path / "a" / "llama"), str(tmp_path / "b" / "llama")
    shutil.copytree(llama[0], first, copy_function=shutil.copyfile)
    directory = str(tmp_path / "kv")
    prompt = _first_life(first, directory)
    shutil.copytree(first, second, copy_function=shutil.copyfile)    # another pod's download: new mtimes
    shutil.rmtree(first)
    eng = tiered_engine(second, kv_offload_dir=directory, **DISK)
    try:
        assert tier_stats(eng)["disk_restored_blocks"] >= 6
        answer, cached = run(eng, "second", prompt)
        assert answer == llama[1].greedy(prompt, len(answer))[0] and cached >= 6 * 4
        assert tier_stats(eng)["loaded_blocks"]["disk"] >= 6
        check_all_tiers(eng)
    finally:
        eng.close()
