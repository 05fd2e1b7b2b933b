"""A worker whose lease lapsed rejoins with a new epoch: WorkerCore drops the old epoch's work.

Over the real engine (its scheduler and block manager) with the CPU fake runner, so the block
pool's integrity is checked, not a counter.
"""
from __future__ import annotations

from gpu_worker.service.core import WorkerCore
from services.envelope import SCHEDULER
from services.protocol.messages import Dispatch, RequestFailed, StepOutput, StreamOpen, WorkerStatus
from services.protocol.sampling import SamplingParams
from tests.gpu_worker.engine.engine_fakes import make_engine


def dispatch(rid: str, epoch: int, *, n: int = 1, max_tokens: int = 200, prompt_len: int = 40) -> Dispatch:
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Dispatch(request_id=rid, epoch=epoch, prompt_token_ids=[3 + i % 40 for i in range(prompt_len)],
                    params=params, reply_addr="gw", detok_addr="d1")


def assert_no_block_in_use(core: WorkerCore) -> None:
    bm = core.engine.block_manager
    bm.check_integrity()                       # free + cached + used == total; ref counts match
    assert bm.num_used_blocks == 0, "blocks of dropped requests leaked"
    assert not core.engine.has_unfinished_requests() and not core.has_work()


def test_rejoin_drops_every_request_frees_its_blocks_and_emits_nothing_for_it():
    core = WorkerCore(make_engine(num_gpu_blocks=256, block_size=4, max_num_seqs=8), "w", 1)
    core.run([dispatch("a", 1), dispatch("b", 1, n=2), dispatch("c", 1, prompt_len=90)])
    for _ in range(3):
        core.run([])
    assert core.engine.block_manager.num_used_blocks > 0 and len(core.requests) == 3

    assert core.rejoin(2) == 3
    assert core.epoch == 2 and not core.requests
    assert_no_block_in_use(core)
    assert core.run([]) == []                  # no tokens, no Abort, no status for the old requests

    # the new incarnation serves, and says so with its epoch
    out = core.run([dispatch("new", 2, max_tokens=3)])
    assert isinstance(out[0].msg, StreamOpen)
    steps = [e.msg for e in out if isinstance(e.msg, StepOutput)]
    assert steps and all(m.epoch == 2 for m in steps)
    for _ in range(10):
        out = core.run([])
        if not core.has_work():
            break
    [status] = [e.msg for e in out if e.dest == SCHEDULER]
    assert isinstance(status, WorkerStatus) and status.epoch == 2 and status.finished == ["new"]
    assert_no_block_in_use(core)


def test_a_dispatch_for_another_epoch_is_refused_with_an_error():
    core = WorkerCore(make_engine(num_gpu_blocks=64, block_size=4), "w", 3)
    for epoch in (2, 4):                      # a stale incarnation's, and one not adopted yet
        [env] = core.run([dispatch(f"r{epoch}", epoch)])
        assert env.dest == "gw" and isinstance(env.msg, RequestFailed)
        assert (env.msg.status, env.msg.code) == (503, "worker_failed")
    assert not core.requests
    assert_no_block_in_use(core)
