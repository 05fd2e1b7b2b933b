"""The disk tier outlives its engine: a new engine on the same directory rebuilds the index from
the files (damaged, foreign, torn and surplus files dropped), serves the old chat's history from
disk with transformers' tokens, and its KV-event stream opens with those blocks, so the
prefix-cache index routes the history to it again. One engine per directory."""
from __future__ import annotations

import os

import pytest

from gpu_worker.kv_events import KVEventPublisher
from gpu_worker.kv_tiers import tier_file
from gpu_worker.kv_transfer.layout import KVLayout
from prefix_cache_svc.channels import EventSubscriber
from prefix_cache_svc.core import PrefixCore
from services.protocol.kv_events import MatchRequest, pack_token_ids
from tests.gpu_worker.kv_tiers.conftest import (
    BLOCK_SIZE, check_all_tiers, prompt_hashes, push_out, run, tier_stats, tiered_engine, tokens)
from tests.prefix_cache_svc.prefix_fakes import follow, planes, pumped

DISK = dict(kv_offload_disk_gb=0.001)


def _first_life(model_dir: str, directory: str) -> tuple[list[int], list[bytes]]:
    """An engine answers a prompt, its blocks are pushed down to disk, it closes: (the next turn's
    prompt, the hashes of its blocks)."""
    eng = tiered_engine(model_dir, kv_offload_dir=directory, **DISK)
    try:
        with pytest.raises(ValueError, match="kv_offload_dir: .* is in use by another engine"):
            tiered_engine(model_dir, kv_offload_dir=directory, **DISK)
        history = tokens(26, 7)
        answer, _ = run(eng, "first", history)
        push_out(eng, 1)
        assert all(h in eng.kv_tiers.disk for h in prompt_hashes(eng, history)[:6])
        check_all_tiers(eng)
        prompt = history + answer + tokens(5, 8)
        return prompt, prompt_hashes(eng, prompt)
    finally:
        eng.close()


def _damage(directory: str, keep: set[str]) -> None:
    """A flipped header byte, a foreign layout's file, a torn write: all unusable."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".kvb") and n not in keep)
    bad = os.path.join(directory, names[0])
    data = bytearray(open(bad, "rb").read())
    data[6] ^= 0xFF
    open(bad, "wb").write(bytes(data))
    foreign = KVLayout("another-model", BLOCK_SIZE, "float32", 1, 1, 8, 1)
    with open(os.path.join(directory, "ab" * 16 + ".kvb"), "wb") as f:
        f.write(b"".join(bytes(p) for p in tier_file.encode(b"\xab" * 16, foreign, b"x" * 64, None, range(4))))
    open(os.path.join(directory, "cd" * 16 + ".kvb.tmp"), "wb").write(b"torn")


def test_a_restarted_engine_serves_the_history_from_its_disk_tier(llama, tmp_path):
    model_dir, hf = llama
    directory = str(tmp_path / "kv")
    prompt, hashes = _first_life(model_dir, directory)
    _damage(directory, {h.hex() + ".kvb" for h in hashes[:6]})

    eng = tiered_engine(model_dir, kv_offload_dir=directory, **DISK)
    try:
        stats = tier_stats(eng)
        assert stats["disk_restored_blocks"] >= 6 and stats["disk_corrupt_files"] == 3, stats
        answer, cached = run(eng, "second", prompt)
        assert answer == hf.greedy(prompt, len(answer))[0]
        stats = tier_stats(eng)
        assert stats["loaded_blocks"]["disk"] >= 6 and cached >= 6 * BLOCK_SIZE, (stats, cached)
        check_all_tiers(eng)
    finally:
        eng.close()


def test_a_smaller_disk_keeps_the_newest_blocks(llama, tmp_path):
    model_dir, _ = llama
    directory = str(tmp_path / "kv")
    _first_life(model_dir, directory)
    mtimes = {n: os.stat(os.path.join(directory, n)).st_mtime_ns for n in os.listdir(directory) if n.endswith(".kvb")}
    eng = tiered_engine(model_dir, kv_offload_dir=directory, kv_offload_disk_gb=3e-6)    # a few files
    try:
        kept = {h.hex() + ".kvb" for h, _ in eng.kv_tiers.disk.hashes()}
        assert 0 < len(kept) < len(mtimes)
        dropped = set(mtimes) - kept
        assert min(mtimes[n] for n in kept) >= max(mtimes[n] for n in dropped)      # the newest stay
        check_all_tiers(eng)                                  # and the others' files are gone
    finally:
        eng.close()


async def test_the_index_routes_the_history_to_the_restarted_engine(llama, tmp_path):
    model_dir, _ = llama
    directory = str(tmp_path / "kv")
    prompt, _ = _first_life(model_dir, directory)
    eng = tiered_engine(model_dir, kv_offload_dir=directory, **DISK)
    pub = KVEventPublisher(eng.block_manager, "w2", epoch=1, plane=planes().worker, heartbeat_s=0.02)
    sub = EventSubscriber(planes().index)
    sub.connect(pub.events_addr)
    core = PrefixCore(eng.config.block_size)

    def disk_blocks() -> int:
        resp = core.match(MatchRequest(model_id=eng.block_manager.model_id, tokens=pack_token_ids(prompt)))
        w = resp.blocks_for("w2")
        return 0 if w is None else w.matched_blocks - w.gpu_cpu_blocks

    try:
        async with pumped(pub):
            # without the restored blocks in its stream, the index would see only heartbeats of
            # an empty worker until the first new block
            await follow(core, sub, pub, lambda: disk_blocks() >= 6)
    finally:
        sub.close()
        pub.close()
        eng.close()
