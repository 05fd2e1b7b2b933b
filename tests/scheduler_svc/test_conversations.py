"""Conversation-aware routing in the scheduler core: a conversation's turns go to the worker of its
last turn (which holds the history's KV) until that worker is gone, draining, overloaded or the
entry expired; tenants cannot steer each other's conversations; P/D keeps the decode worker."""
from __future__ import annotations

from scheduler_svc.conversations import ConversationTable
from scheduler_svc.core import Limits, SchedulerCore
from scheduler_svc.routing import WorkerView, least_loaded
from services.protocol.messages import AwaitKV, Dispatch, Submit, WorkerStatus
from services.protocol.sampling import SamplingParams

GW, DT = "tcp://gw:1", "tcp://detok:1"
TTL = 60.0
CONV = "0f" * 16
LAYOUT = {"model_id": "m", "block_size": 16, "kv_dtype": "float32", "num_layers": 2, "num_kv_heads": 2,
          "head_dim": 16, "tp_size": 1}


def submit(rid: str, conversation: str = "", tenant: str = "t", prompt_len: int = 8) -> Submit:
    return Submit(request_id=rid, tenant=tenant, prompt_token_ids=list(range(prompt_len)),
                  params=SamplingParams(max_tokens=4), reply_addr=GW, detok_addr=DT, conversation=conversation)


def worker(wid: str, role: str = "mixed", seqs: int = 4, epoch: int = 1) -> WorkerView:
    return WorkerView(id=wid, epoch=epoch, addr=f"tcp://{wid}:1", role=role, max_num_seqs=seqs, max_model_len=4096,
                      kv_addr=f"tcp://{wid}:2#worker" if role == "decode" else "", kv_layout=LAYOUT)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def core_with(*views: WorkerView, table: bool = True, max_load: float = 1.0, clock: Clock | None = None,
              min_prefill: int = 256) -> SchedulerCore:
    clock = clock or Clock()
    core = SchedulerCore(Limits(conversation_max_load=max_load, pd_min_prefill_tokens=min_prefill),
                         scorer=least_loaded, clock=clock,
                         conversations=ConversationTable(TTL) if table else None)
    core.set_workers(list(views))
    return core


def dispatched_to(out) -> str:
    [env] = [e for e in out if isinstance(e.msg, Dispatch)]
    return env.dest.split("//")[1].split(":")[0]


def finish(core: SchedulerCore, wid: str, rid: str) -> None:
    core.worker_status(WorkerStatus(worker_id=wid, epoch=1, running=0, waiting=0, free_blocks=10,
                                    cached_blocks=0, total_blocks=10, finished=[rid]))


def busy(core: SchedulerCore, wid: str, n: int) -> None:
    """n requests of no conversation in flight on wid (the scheduler's own count of it)."""
    core.workers[wid].inflight |= {f"{wid}-load-{i}" for i in range(n)}


# ---- the table ------------------------------------------------------------------------------

def test_table_remembers_expires_forgets_and_is_bounded():
    table = ConversationTable(ttl_s=10, max_entries=3)
    table.record("t", "a", "w1", now=0)
    assert table.lookup("t", "a", now=10) == "w1"
    assert table.lookup("t", "a", now=10.5) is None and len(table) == 0     # expired, dropped
    table.record("t", "a", "w1", now=20)
    assert table.lookup("other", "a", now=20) is None                        # keyed by tenant too
    table.record("t", "b", "w2", now=21)
    table.forget_worker("w1")
    assert table.lookup("t", "a", now=21) is None and table.lookup("t", "b", now=21) == "w2"
    for i in range(5):
        table.record("t", f"c{i}", "w2", now=22 + i)
    assert len(table) == 3 and table.lookup("t", "b", now=27) is None       # least recently used went first
    table.record("t", "late", "w2", now=100)                                 # expired ones drop as it goes
    assert len(table) == 1


# ---- routing --------------------------------------------------------------------------------

def test_the_next_turn_goes_where_the_last_one_ran_even_when_another_worker_is_less_loaded():
    core = core_with(worker("w1"), worker("w2"))
    assert dispatched_to(core.submit(submit("t1", CONV))) == "w1"           # both idle: lowest id
    finish(core, "w1", "t1")
    busy(core, "w1", 2)                                                      # w1 now busier than w2
    assert dispatched_to(core.submit(submit("other"))) == "w2"              # plain requests follow load
    finish(core, "w2", "other")
    assert dispatched_to(core.submit(submit("t2", CONV))) == "w1"           # the conversation stays


def test_without_the_table_the_turn_follows_load():
    core = core_with(worker("w1"), worker("w2"), table=False)
    assert dispatched_to(core.submit(submit("t1", CONV))) == "w1"
    finish(core, "w1", "t1")
    busy(core, "w1", 2)
    assert dispatched_to(core.submit(submit("t2", CONV))) == "w2"


def test_an_overloaded_worker_lets_the_conversation_move_and_it_stays_moved():
    core = core_with(worker("w1", seqs=4), worker("w2", seqs=4), max_load=0.5)
    assert dispatched_to(core.submit(submit("t1", CONV))) == "w1"
    finish(core, "w1", "t1")
    busy(core, "w1", 2)                                                      # 2 / 4 in flight: at the limit
    assert dispatched_to(core.submit(submit("t2", CONV))) == "w2"
    finish(core, "w2", "t2")
    busy(core, "w2", 1)
    core.workers["w1"].inflight.clear()
    assert dispatched_to(core.submit(submit("t3", CONV))) == "w2"           # its history is on w2 now


def test_a_draining_or_gone_worker_lets_the_conversation_move():
    core = core_with(worker("w1"), worker("w2"))
    core.submit(submit("t1", CONV))
    finish(core, "w1", "t1")
    draining = worker("w1")
    draining.draining = True
    core.set_workers([draining, worker("w2")])
    assert dispatched_to(core.submit(submit("t2", CONV))) == "w2"
    finish(core, "w2", "t2")
    # w2 gone, its entry with it; w1 restarted (draining ends only with its epoch)
    core.set_workers([worker("w1", epoch=2), worker("w3")])
    assert core.conversations.lookup("t", CONV, core.clock()) is None
    assert dispatched_to(core.submit(submit("t3", CONV))) == "w1"


def test_an_expired_conversation_is_routed_like_any_request():
    clock = Clock()
    core = core_with(worker("w1"), worker("w2"), clock=clock)
    core.submit(submit("t1", CONV))
    finish(core, "w1", "t1")
    busy(core, "w1", 1)
    clock.now += TTL + 1
    assert dispatched_to(core.submit(submit("t2", CONV))) == "w2"


def test_another_tenant_cannot_steer_a_conversation():
    core = core_with(worker("w1"), worker("w2"))
    core.submit(submit("t1", CONV, tenant="key0"))
    finish(core, "w1", "t1")
    busy(core, "w1", 2)
    assert dispatched_to(core.submit(submit("x", CONV, tenant="key1"))) == "w2"   # same key, other tenant
    finish(core, "w2", "x")
    busy(core, "w2", 3)
    assert dispatched_to(core.submit(submit("t2", CONV, tenant="key0"))) == "w1"  # key0's still on w1


def test_with_prefill_and_decode_pools_the_conversation_keeps_its_decode_worker():
    core = core_with(worker("p", "prefill"), worker("d1", "decode"), worker("d2", "decode"), min_prefill=4)
    out = core.submit(submit("t1", CONV, prompt_len=64))
    [await_kv] = [e for e in out if isinstance(e.msg, AwaitKV)]
    assert await_kv.dest == "tcp://d1:1"
    finish(core, "p", "t1")
    finish(core, "d1", "t1")
    busy(core, "d1", 2)
    out = core.submit(submit("t2", CONV, prompt_len=96))
    [await_kv] = [e for e in out if isinstance(e.msg, AwaitKV)]
    [dispatch] = [e for e in out if isinstance(e.msg, Dispatch)]
    assert await_kv.dest == "tcp://d1:1" and dispatch.msg.handoff_to == "tcp://d1:2#worker"


def test_the_table_exists_unless_round_robin_or_a_zero_ttl():
    from scheduler_svc.main import conversation_table
    from services.config import SchedulerConfig

    assert conversation_table(SchedulerConfig()).ttl_s == 600.0
    assert conversation_table(SchedulerConfig(routing="least_loaded", route_conversation_ttl_s=5)).ttl_s == 5
    assert conversation_table(SchedulerConfig(routing="round_robin")) is None
    assert conversation_table(SchedulerConfig(route_conversation_ttl_s=0)) is None


def test_a_tenant_past_its_share_evicts_its_own_conversations_not_another_tenants():
    # one API key naming a new conversation per request must not push every other key's
    # conversations out of the table (their next turns would lose their KV's worker)
    table = ConversationTable(ttl_s=1e9, max_entries=10)
    for i in range(3):
        table.record("victim", f"v{i}", "w1", now=i)
    for i in range(1000):
        table.record("flood", f"f{i}", "w2", now=10 + i)
    assert len(table) == 10
    assert all(table.lookup("victim", f"v{i}", now=2000) == "w1" for i in range(3))
    assert table.lookup("flood", "f999", now=2000) == "w2" and table.lookup("flood", "f0", now=2000) is None
    table.forget_worker("w2")
    assert len(table) == 3 and table.lookup("victim", "v0", now=2000) == "w1"
    # one tenant alone keeps the whole table, least recently used first out
    table.record("victim", "v3", "w1", now=2001)
    assert len(table) == 4
