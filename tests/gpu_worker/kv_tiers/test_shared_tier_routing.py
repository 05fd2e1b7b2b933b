"""What the shared tier tells routing: the store id every worker of a store agrees on (and a
tampered or copied id file is refused), the blocks a bound deletes or a read finds gone, and an
engine's KV events with tier "shared", which the prefix index credits to every worker announcing
the store's id and to no other."""
from __future__ import annotations

import os
import shutil
import threading

import msgspec

from gpu_worker.kv_tiers import shared_file, shared_store_id
from gpu_worker.kv_tiers.shared_tier import SharedTier
from gpu_worker.service.main import shared_tier_info
from prefix_cache_svc.core import PrefixCore
from services.protocol.kv_events import (
    SHARED_TIER_INFO, BlockRemoved, BlockStored, KVEventBatch, MatchRequest, pack_token_ids, shared_tier_id,
)
from tests.gpu_worker.kv_tiers.conftest import BLOCK_SIZE, push_out, run, tiered_engine, tokens
from tests.gpu_worker.kv_tiers.test_shared_tier import KEY, LAYOUT, OTHER_KEY, PAYLOAD, write


def test_workers_of_one_store_agree_on_its_id_and_no_other_store_shares_it(tmp_path):
    root = str(tmp_path / "shared")
    a = SharedTier(root, 1 << 20, LAYOUT, PAYLOAD, KEY)
    b = SharedTier(root, 1 << 20, LAYOUT, PAYLOAD, KEY)
    other_layout = SharedTier(root, 1 << 20, msgspec.structs.replace(LAYOUT, model_id="x"), PAYLOAD, KEY)
    other_key = SharedTier(root, 1 << 20, LAYOUT, PAYLOAD, OTHER_KEY)
    elsewhere = SharedTier(str(tmp_path / "other"), 1 << 20, LAYOUT, PAYLOAD, KEY)
    rank1 = SharedTier(root, 1 << 20, msgspec.structs.replace(LAYOUT, tp_size=2), PAYLOAD, KEY, rank=1)
    tiers = [a, b, other_layout, other_key, elsewhere, rank1]
    try:
        assert shared_tier_id(a.store_id) == a.store_id == b.store_id
        ids = {t.store_id for t in (a, other_layout, other_key, elsewhere)}
        assert len(ids) == 4 and None not in ids
        assert rank1.store_id is None               # rank 0 names a tensor-parallel engine's store
        path = os.path.join(a.directory, shared_store_id.NAME)
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        # a valid id file copied into another store's subdirectory does not verify there
        os.unlink(os.path.join(other_layout.directory, shared_store_id.NAME))
        shutil.copy(path, os.path.join(other_layout.directory, shared_store_id.NAME))
        assert shared_store_id.store_id(other_layout.directory, KEY) is None
        # nor does one whose id was changed by someone without the key (or that is damaged)
        with open(path, "r+b") as f:
            f.write(b"\x00" * 4)
        assert shared_store_id.store_id(a.directory, KEY) is None
        assert SharedTier(root, 1 << 20, LAYOUT, PAYLOAD, KEY).store_id is None   # no credit, still a tier
        os.unlink(path)                             # an operator deletes it: a new id is agreed on
        fresh = shared_store_id.store_id(a.directory, KEY)
        assert fresh is not None and fresh != a.store_id and shared_store_id.store_id(a.directory, KEY) == fresh
    finally:
        for t in tiers:
            t.close()


def test_a_store_id_that_is_no_regular_file_gives_no_id_and_never_blocks(tmp_path):
    """Whoever can write the directory may plant a directory or a FIFO as `store-id`: the worker
    starts, announcing no id (a FIFO's open must not wait for a writer)."""
    root = str(tmp_path / "shared")
    tier = SharedTier(root, 1 << 20, LAYOUT, PAYLOAD, KEY)
    tier.close()
    path = os.path.join(tier.directory, shared_store_id.NAME)
    os.unlink(path)
    os.mkdir(path)
    assert shared_store_id.store_id(tier.directory, KEY) is None
    os.rmdir(path)
    os.mkfifo(path)
    answer: list = []
    reader = threading.Thread(target=lambda: answer.append(shared_store_id.store_id(tier.directory, KEY)),
                              daemon=True)
    reader.start()
    reader.join(5)
    blocked = reader.is_alive()
    if blocked:                                     # let the stuck open return before the test ends
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
    assert not blocked and answer == [None]
    SharedTier(root, 1 << 20, LAYOUT, PAYLOAD, KEY).close()     # the tier itself still starts


def test_blocks_the_bound_deletes_or_a_read_misses_are_reported_gone(tmp_path):
    file_bytes = len(b"".join(bytes(p) for p in shared_file.encode(KEY, b"\0" * 16, LAYOUT, bytearray(PAYLOAD),
                                                                   None, (0,) * 4)))
    tier = SharedTier(str(tmp_path / "shared"), 10 * file_bytes, LAYOUT, PAYLOAD, KEY, max_queued=2)
    try:
        written = []
        for i in range(30):
            written.append(write(tier, i))
            tier.drain()
        first = tier.take_gone(limit=3)             # a few stats per call on the engine thread
        gone = first + tier.take_gone()
        kept = [h for h in written if tier.holds(h)]
        assert len(first) == 3
        assert gone and sorted(gone) == sorted(set(written) - set(kept))     # each once, oldest first
        assert gone == [h for h in written if h in set(gone)]
        assert tier.take_gone() == []
        os.unlink(tier._path(kept[0]))              # another worker's bound deleted it
        assert tier.read(kept[0]) is None and tier.take_gone() == [kept[0]]
        write(tier, 0)                               # deleted, then written again before the report
        tier.drain()
        os.unlink(tier._path(kept[1]))
        tier.read(kept[1])
        write(tier, written.index(kept[1]))
        assert tier.take_gone() == []               # it is there again: the index keeps it
    finally:
        tier.close()


class Events:
    """A block-manager listener: the engine's KV events, as one batch per call of `batch`."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id, self.seq, self.pending = worker_id, -1, []

    def on_stored(self, block_hash, parent, token_ids, tier="gpu"):
        self.pending.append(BlockStored(block_hash, parent, list(token_ids), tier))

    def on_removed(self, block_hash, tier="gpu"):
        self.pending.append(BlockRemoved(block_hash, tier))

    def on_missing(self, block_hash, tier):
        self.pending.append(BlockRemoved(block_hash, tier, missing=True))

    def on_cleared(self, tier=None):
        raise AssertionError("not in this test")

    def batch(self) -> KVEventBatch:
        self.seq += 1
        out, self.pending = self.pending, []
        return KVEventBatch(worker_id=self.worker_id, epoch=1, seq=self.seq, ts=0.0, events=out)


def test_an_engines_shared_blocks_are_credited_to_every_worker_of_the_store(llama, tmp_path):
    model_dir, _ = llama
    shared = dict(kv_offload_shared_dir=str(tmp_path / "shared"), kv_offload_shared_gb=0.001,
                  kv_offload_shared_key=KEY)
    a = tiered_engine(model_dir, num_gpu_blocks=16, **shared)       # no host tier: evictions go to shared
    b = tiered_engine(model_dir, **shared)
    events = Events("a")
    a.block_manager.add_listener(events)
    try:
        store = a.kv_tiers.shared.store_id
        assert shared_tier_info(a) == {SHARED_TIER_INFO: store} == shared_tier_info(b)
        history = tokens(30, 1)
        run(a, "turn-0", history)
        push_out(a, 1)
        a.kv_tiers.shared.drain()                                       # its files are written
        a.kv_tiers.flush()
        core = PrefixCore(BLOCK_SIZE)
        core.set_readers({"a": store, "b": store, "c": "f" * 32})       # c reads another store
        core.on_batch(events.batch(), 0.0)
        full = (len(history) - 1) // BLOCK_SIZE

        def credited():
            resp = core.match(MatchRequest(model_id=a.block_manager.model_id, tokens=pack_token_ids(history)))
            return {w.worker_id: w.any_blocks for w in resp.workers}
        assert credited() == {"a": full, "b": full}
        # a file gone (another worker's bound) is found on a read and reported by the next flush
        first = next(h for h in core.index.blocks_of(store, "shared") if core.index.parent_and_tokens(h)[0] is None)
        os.unlink(a.kv_tiers.shared._path(first))
        assert a.kv_tiers.shared.read(first) is None
        a.kv_tiers.flush()
        core.on_batch(events.batch(), 0.0)
        assert credited() == {}                                         # the prefix's first block is gone
        core.index.check_integrity()
    finally:
        a.close()
        b.close()
