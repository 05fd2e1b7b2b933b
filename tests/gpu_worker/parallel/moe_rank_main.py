"""One rank of the 2-process MoE test (run by test_moe_parallel.py, not collected by pytest).

Every rank builds the same full SparseMoE from one seed, then its expert-parallel and its
tensor-parallel shard, and checks both against the full layer on identical inputs. Exit 0 = ok.
"""
from __future__ import annotations

import sys

import torch

from gpu_worker.models.moe import SparseMoE
from gpu_worker.parallel.state import ParallelContext, connect_store, init_parallel, open_store, shutdown_parallel

HIDDEN, INTER, EXPERTS, TOP_K = 32, 48, 8, 2


def full_layer() -> SparseMoE:
    torch.manual_seed(0)
    moe = SparseMoE(HIDDEN, INTER, EXPERTS, TOP_K, renormalize=True)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def shard_of(full: SparseMoE, ctx: ParallelContext) -> SparseMoE:
    moe = SparseMoE(HIDDEN, INTER, EXPERTS, TOP_K, renormalize=True, ctx=ctx)
    with torch.no_grad():
        moe.gate.weight.copy_(full.gate.weight)
        if ctx.expert_parallel:
            e0, n = moe.first_expert, moe.num_local_experts
            moe.w13.copy_(full.w13[e0:e0 + n])
            moe.w2.copy_(full.w2[e0:e0 + n])
        else:
            i = moe.intermediate
            a, b = ctx.rank * i, (ctx.rank + 1) * i
            moe.w13.copy_(torch.cat([full.w13[:, a:b], full.w13[:, INTER + a:INTER + b]], dim=1))
            moe.w2.copy_(full.w2[:, :, a:b])
    return moe


def main() -> int:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    store = connect_store("127.0.0.1", port, world, 60) if rank else open_store(world, timeout_s=60)
    if rank == 0:
        print(store.port, flush=True)   # the test reads the port and starts the other ranks
    ctx = init_parallel(rank, world, torch.device("cpu"), store, expert_parallel=True, timeout_s=60)
    full = full_layer()
    ep = shard_of(full, ctx)
    tp = shard_of(full, ParallelContext(rank, world, expert_parallel=False))
    assert ep.num_local_experts == EXPERTS // world and tp.intermediate == INTER // world
    for t in (1, 2, 5, 17, 64):
        x = torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(t))
        with torch.no_grad():
            ref = full(x)
            for name, layer in (("ep", ep), ("tp", tp)):
                got = layer(x)
                err = (got - ref).abs().max().item()
                assert got.shape == ref.shape and err < 1e-5, f"rank {rank} {name} T={t}: max err {err}"
    # skewed routing: every token picks the same experts (all on one rank)
    with torch.no_grad():
        ep.gate.weight.zero_(); ep.gate.weight[EXPERTS - 1] = 5.0; ep.gate.weight[EXPERTS - 2] = 4.0
        full.gate.weight.copy_(ep.gate.weight)
        x = torch.rand(9, HIDDEN, generator=torch.Generator().manual_seed(9))
        assert (ep(x) - full(x)).abs().max().item() < 1e-5
    shutdown_parallel()
    print(f"rank {rank} ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
