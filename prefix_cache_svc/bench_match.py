"""Time RadixIndex matches: 32k-token prompts (2k blocks of 16) against an index of ~1M blocks.

    python -m prefix_cache_svc.bench_match [--blocks 1000000] [--prompt-tokens 32768] [--queries 300]

The index holds chains of `prompt_blocks` blocks over 8 workers (half of them behind one of 8
shared "system prompts", every chain on two workers, one holding only a prefix, the tail in the
CPU tier of the other), so a query walks the whole chain through a branch point and the
per-worker bitmask path is exercised. Prints
p50/p99/max in milliseconds for a token walk (hashes the first block, follows tokens), a walk of
caller-supplied hashes, and the token walk plus msgpack decoding of the MatchRequest.
"""
from __future__ import annotations

import argparse
import gc
import random
import resource
import time

from prefix_cache_svc.hashing import block_hash
from prefix_cache_svc.radix_index import RadixIndex, pack_tokens
from prefix_cache_svc.core import PrefixCore
from services.protocol.kv_events import (
    ENCODER, MATCH_REQUEST_DECODER, BlockRemoved, BlockStored, KVEventBatch, MatchRequest, cache_salt_for,
)

MODEL = "bench-model"


def build(num_blocks: int, prompt_blocks: int, block_size: int, workers: int, rng: random.Random):
    """Chains of prompt_blocks blocks; half of them start with one of 8 shared "system prompts"
    of prompt_blocks/8 blocks, so walks cross branch points where the last-used child differs."""
    index = RadixIndex(block_size)
    step = 4 * block_size
    shared_blocks = prompt_blocks // 8
    systems = [[rng.randrange(150_000) for _ in range(shared_blocks * block_size)] for _ in range(8)]
    system_hashes: dict[int, list[bytes]] = {}
    chains = []
    while len(index) < num_blocks - prompt_blocks:
        system = rng.randrange(16)  # 0..7: a shared system prompt, 8..15: none
        tokens = systems[system] if system < 8 else []
        tokens = tokens + [rng.randrange(150_000) for _ in range(prompt_blocks * block_size - len(tokens))]
        packed = pack_tokens(tokens)
        hashes = list(system_hashes.get(system, []))
        for i in range(len(hashes), prompt_blocks):
            # the real chained hash where it matters (first blocks), any unique id elsewhere
            hashes.append(block_hash(None, MODEL, "", tokens[:block_size]) if i == 0 else rng.randbytes(16))
        if system < 8:
            system_hashes.setdefault(system, hashes[:shared_blocks])
        full_owner, part_owner = rng.sample(range(workers), 2)
        part_len = rng.randrange(prompt_blocks // 2, prompt_blocks)
        for i, h in enumerate(hashes):
            parent = hashes[i - 1] if i else None
            chunk = packed[i * step:(i + 1) * step]
            index.insert(f"w{full_owner}", h, parent, chunk, "gpu" if i < prompt_blocks * 3 // 4 else "cpu")
            if i < part_len:
                index.insert(f"w{part_owner}", h, parent, chunk, "gpu")
        chains.append((packed, hashes))
    return index, chains


def percentiles(samples: list[float]) -> str:
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))] * 1e3
    return f"p50 {pick(0.5):.3f} ms  p99 {pick(0.99):.3f} ms"


def time_it(fn, queries) -> tuple[list[float], list[float]]:
    """Wall-clock and CPU (this process) seconds per query: on a shared machine the CPU time
    leaves out the time other processes held the core."""
    wall, cpu = [], []
    for q in queries:
        t0, c0 = time.perf_counter(), time.process_time()
        fn(q)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--prompt-tokens", type=int, default=32_768)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    prompt_blocks = args.prompt_tokens // args.block_size
    t0 = time.perf_counter()
    index, chains = build(args.blocks, prompt_blocks, args.block_size, args.workers, rng)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"index: {len(index):,} blocks, {index.stats().ownerships:,} ownerships, "
          f"built in {time.perf_counter() - t0:.1f} s, peak RSS {rss_mb:,.0f} MiB")
    gc.freeze()  # what the service does after loading: the index is long-lived
    picks = [rng.choice(chains) for _ in range(args.queries)]
    res = index.match_tokens(picks[0][0], MODEL)
    assert res.workers and res.workers[0].matched_blocks == prompt_blocks, res
    wires = [ENCODER.encode(MatchRequest(model_id=MODEL, tokens=t)) for t, _ in picks]

    def decode_and_match(wire: bytes):
        req = MATCH_REQUEST_DECODER.decode(wire)
        return index.match_tokens(req.tokens, req.model_id, cache_salt_for(req.tenant_salt, req.cache_salt))

    for name, fn, qs in (
        ("match_tokens", lambda q: index.match_tokens(q[0], MODEL), picks),
        ("match_hashes", lambda q: index.match_hashes(q[1], q[0]), picks),
        ("decode+match_tokens", decode_and_match, wires),
    ):
        time_it(fn, qs[:20])  # warm up
        wall, cpu = time_it(fn, qs)
        print(f"{name:<20} {prompt_blocks} blocks: wall {percentiles(wall)} | cpu {percentiles(cpu)}")
    print(f"ingest: {ingest_rate(args.block_size, rng):,.0f} events/s through PrefixCore.on_batch "
          f"(BlockStored+BlockRemoved, 64 per batch)")
    return 0


def ingest_rate(block_size: int, rng: random.Random, num_events: int = 100_000) -> float:
    """Events per second the core applies (index + change list), as a worker's stream delivers them."""
    core = PrefixCore(block_size)
    tokens = [rng.randrange(150_000) for _ in range(block_size)]
    batches, parent, seq = [], None, 0
    for i in range(0, num_events, 64):
        events = []
        for _ in range(32):
            h = rng.randbytes(16)
            events.append(BlockStored(h, parent, tokens))
            events.append(BlockRemoved(parent) if parent is not None else BlockStored(rng.randbytes(16), None, tokens))
            parent = h
        batches.append(KVEventBatch(worker_id="w0", epoch=1, seq=seq, ts=0.0, events=events))
        seq += 1
    t0 = time.perf_counter()
    for batch in batches:
        core.on_batch(batch, 0.0)
        core.drain_changes()
    return len(batches) * 64 / (time.perf_counter() - t0)


if __name__ == "__main__":
    raise SystemExit(main())
