"""The scheduler with held draws (Request.draw_waits: a grammar still compiling): such a
sequence computes all of its tokens but the last, draws nothing, and holds up no one."""
from __future__ import annotations

from gpu_worker.block_manager import BlockManager
from gpu_worker.scheduler import Scheduler
from gpu_worker.sequence import Request, Sequence
from services.protocol.sampling import SamplingParams

BLOCK = 4


def add(sched: Scheduler, rid: str, prompt_len: int, arrival: int, held: bool = False) -> Sequence:
    prompt = [(7 * i + arrival) % 40 + 2 for i in range(prompt_len)]
    request = Request(rid, prompt, SamplingParams(max_tokens=8), 0, "", arrival, 0, 8)
    request.draw_waits = held
    seq = Sequence(request, 0, list(prompt), len(prompt))
    request.seqs.append(seq)
    sched.add(seq)
    return seq


def step(sched: Scheduler) -> dict[str, tuple[int, bool]]:
    """One schedule, its tokens taken as computed: request id -> (tokens, samples)."""
    out = sched.schedule()
    done = {item.seq.request_id: (item.num_new_tokens, item.samples) for item in out.scheduled}
    for seq, num_new in out.scheduled:
        seq.num_computed_tokens += num_new
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(3)          # the draw
    return done


def test_a_held_sequence_prefills_all_but_its_last_token_then_waits():
    sched = Scheduler(BlockManager(64, BLOCK, "m", True), 8, 6, True)
    held = add(sched, "held", 10, 0, held=True)
    add(sched, "plain", 3, 1)
    assert step(sched) == {"held": (6, False)}                       # a chunk of the budget
    assert step(sched) == {"held": (3, False), "plain": (3, True)}   # all but the last token
    for _ in range(3):
        assert step(sched) == {"plain": (1, True)}                   # the others go on
    held.request.draw_waits = False                                 # compiled
    assert step(sched) == {"held": (1, True), "plain": (1, True)}


def test_a_waiting_sequence_with_only_its_held_token_left_is_passed_over():
    sched = Scheduler(BlockManager(64, BLOCK, "m", True), 8, 64, True)
    add(sched, "held", 1, 0, held=True)      # one-token prompt: nothing to compute before its draw
    add(sched, "plain", 5, 1)
    assert step(sched) == {"plain": (5, True)}
    assert [s.request_id for s in sched.waiting] == ["held"]


def test_a_preempted_held_sequence_is_recomputed_up_to_its_held_token():
    bm = BlockManager(4, BLOCK, "m", False)                # 16 slots
    sched = Scheduler(bm, 8, 64, True)
    held = add(sched, "held", 9, 1, held=True)
    first = add(sched, "first", 4, 0)
    assert step(sched) == {"first": (4, True), "held": (8, False)}   # 2 blocks each: the pool is full
    for _ in range(4):
        assert step(sched) == {"first": (1, True)}     # first fills its 2nd block
    assert step(sched) == {"first": (1, True)}         # its 3rd block: held (arrived later) is preempted
    assert held in sched.waiting and held.num_computed_tokens == 0 and sched.num_preemptions == 1
    sched.finish(first, "stop")
    assert step(sched) == {"held": (8, False)}
    held.request.draw_waits = False
    assert step(sched) == {"held": (1, True)}
    bm.check_integrity()
