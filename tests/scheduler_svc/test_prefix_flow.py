"""Cache-aware routing's flow in the core: a submission asks the prefix-cache index where its prefix
is (a PrefixQuery the shell answers with its one gRPC call), the answer routes it; no answer (index
down or slow) routes by load; recent dispatches top up what the index cannot know yet."""
from __future__ import annotations

import asyncio
import time

import pytest

from scheduler_svc.core import SchedulerCore
from scheduler_svc.main import ask_index
from scheduler_svc.prefix_hints import PREFIX_INDEX, PrefixHints, PrefixQuery
from scheduler_svc.recent import RecentDispatches
from scheduler_svc.routing import CacheAware, WorkerView
from services.prefix_client import PrefixClient
from services.prefix_hash import chain_hashes
from services.protocol.kv_events import (
    PREFIX_GRPC_SERVICE, MatchRequest, MatchResponse, WorkerMatch, cache_salt_for)
from services.protocol.messages import Abort, Admitted, Dispatch, RequestFailed, Submit
from services.protocol.sampling import SamplingParams
from services.transport import Method, grpc_server, unary_handler

GW = "tcp://gw:1"
SYSTEM = list(range(100, 164))          # a shared system prompt: 4 blocks of 16


def prompt(question: int) -> list[int]:
    return SYSTEM + [1000 + question] * 16


def submit(rid: str, tokens: list[int], salt: str = "") -> Submit:
    return Submit(request_id=rid, tenant="t", prompt_token_ids=tokens, params=SamplingParams(max_tokens=4),
                  cache_salt=salt, reply_addr=GW, detok_addr="tcp://dt:1")


def worker(wid: str, epoch: int = 1) -> WorkerView:
    return WorkerView(id=wid, epoch=epoch, addr=f"tcp://{wid}:1", max_num_seqs=8, max_model_len=4096,
                      model_id="m", block_size=16)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def cache_aware_core(clock=None) -> SchedulerCore:
    core = SchedulerCore(scorer=CacheAware(), prefix_hints=PrefixHints(RecentDispatches(ttl_s=2.0)),
                         **({"clock": clock} if clock else {}))
    core.set_workers([worker("w0"), worker("w1")])
    return core


def dispatched_to(out) -> list[str]:
    return [e.dest.split("//")[1].split(":")[0] for e in out if isinstance(e.msg, Dispatch)]


def ask(core: SchedulerCore, msg: Submit) -> PrefixQuery:
    """Submit; the core admits it and asks for a match instead of dispatching."""
    out = core.submit(msg)
    [query] = [e.msg for e in out if e.dest == PREFIX_INDEX]
    assert [type(e.msg) for e in out if e.dest == GW] == [Admitted] and not dispatched_to(out)
    return query


def hit(wid: str, blocks: int) -> MatchResponse:
    return MatchResponse(block_size=16, query_blocks=5, workers=[WorkerMatch(wid, blocks, blocks, blocks)])


def test_a_hit_on_one_worker_routes_there():
    core = cache_aware_core()
    query = ask(core, submit("a", prompt(1), salt=cache_salt_for("key-1", "chat-7")))
    assert query == PrefixQuery("a", "m", prompt(1), "key-1", "chat-7")
    assert core.queue_depth == 1 and core.num_inflight == 0       # waits out of the queue for the answer
    assert dispatched_to(core.prefix_matched("a", hit("w1", 4))) == ["w1"]   # (by load alone: w0, the tie-break)
    assert core.queue_depth == 0 and core.workers["w1"].inflight == {"a"}


def test_no_query_without_a_choice_or_without_prefix_hints():
    core = cache_aware_core()
    core.set_workers([worker("w0")])
    assert dispatched_to(core.submit(submit("one", prompt(1)))) == ["w0"]          # one worker: nothing to ask
    plain = SchedulerCore()
    plain.set_workers([worker("w0"), worker("w1")])
    out = plain.submit(submit("p", prompt(1)))
    assert dispatched_to(out) == ["w0"] and not [e for e in out if e.dest == PREFIX_INDEX]


def test_recent_dispatches_top_up_what_the_index_cannot_know_yet():
    clock = Clock()
    core = cache_aware_core(clock)
    miss = MatchResponse(block_size=16, query_blocks=5, workers=[])
    ask(core, submit("a", prompt(1)))
    assert dispatched_to(core.prefix_matched("a", miss)) == ["w0"]                 # an idle tie: w0
    clock.now += 1.0
    ask(core, submit("b", prompt(2)))        # the index still says nobody holds the system prompt...
    assert dispatched_to(core.prefix_matched("b", miss)) == ["w0"]                 # ...w0 was just sent it
    ask(core, submit("c", prompt(3), salt="other tenant"))
    assert dispatched_to(core.prefix_matched("c", miss)) == ["w1"]                 # other salt: by load
    clock.now += 2.5                          # past the 2 s the index takes to learn: load decides
    ask(core, submit("d", prompt(4)))
    assert dispatched_to(core.prefix_matched("d", miss)) == ["w1"]
    ask(core, submit("e", prompt(5)))
    assert dispatched_to(core.prefix_matched("e", miss)) == ["w1"]                 # d's, just recorded there
    system = chain_hashes(None, "m", "", SYSTEM, 16)
    assert core.prefix_hints.recent.held(system, clock.now) == {"w1": 4}
    core.set_workers([worker("w0"), worker("w1", epoch=2)])   # w1 restarted: its cache is empty
    assert core.prefix_hints.recent.held(system, clock.now) == {}


def test_abort_while_the_index_is_asked():
    core = cache_aware_core()
    ask(core, submit("a", prompt(1)))
    out = core.abort(Abort(request_id="a"))
    assert [(e.dest, type(e.msg)) for e in out] == [(GW, RequestFailed)]
    assert core.prefix_matched("a", hit("w1", 4)) == []                            # the late answer: nothing
    assert not core.requests and not core.tenant_inflight and core.queue_depth == 0
    assert core.submit(submit("a", prompt(1)))                                     # the id is free again
    assert not core.workers["w0"].inflight and not core.workers["w1"].inflight


# ---- the shell's one gRPC call, against a real gRPC server on 127.0.0.1 ---------------------------
class Index:
    """A prefix-cache index stand-in on a real gRPC socket: answers `answer`, after `delay_s`."""

    def __init__(self, answer: MatchResponse, delay_s: float = 0.0) -> None:
        self.answer, self.delay_s, self.asked = answer, delay_s, []

    async def match(self, req: MatchRequest, context) -> MatchResponse:
        self.asked.append(req)
        await asyncio.sleep(self.delay_s)
        return self.answer

    async def __aenter__(self) -> str:
        self.server, port = grpc_server("127.0.0.1", 0, None)
        self.server.add_generic_rpc_handlers([unary_handler(
            PREFIX_GRPC_SERVICE, {"Match": Method(self.match, MatchRequest, frozenset({"scheduler"}))}, None)])
        await self.server.start()
        return f"127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        await self.server.stop(0)


async def route(core: SchedulerCore, client: PrefixClient, rid: str) -> tuple[list[str], float]:
    """One submission through the core and the shell's gRPC call: (its worker, seconds the call took)."""
    query = ask(core, submit(rid, prompt(int(rid[-1]))))
    t = time.perf_counter()
    match = await asyncio.wait_for(ask_index(client, query), 5)
    took = time.perf_counter() - t
    return dispatched_to(core.prefix_matched(rid, match)), took


@pytest.fixture
def busy_w0():
    """Both workers cache-aware; w0 already runs a request, so load alone picks w1."""
    core = cache_aware_core()
    core.submit(submit("busy", list(range(8))))   # too short to hash: no recent top-up from it
    core.prefix_matched("busy", None)
    assert core.workers["w0"].inflight == {"busy"}
    return core


async def test_an_index_answer_over_grpc_routes_to_the_holder(busy_w0):
    index = Index(hit("w0", 4))
    async with index as target:
        client = PrefixClient(target, None, timeout_s=2.0)
        try:
            workers, _ = await route(busy_w0, client, "r1")
            assert workers == ["w0"]
        finally:
            await client.close()
    [req] = index.asked
    assert req.model_id == "m" and len(req.tokens) == 4 * len(prompt(1))


async def test_a_slow_index_falls_back_to_load(busy_w0):
    async with Index(hit("w0", 4), delay_s=3.0) as target:
        client = PrefixClient(target, None, timeout_s=0.1, cooldown_s=5.0)
        try:
            workers, took = await route(busy_w0, client, "r1")
            assert workers == ["w1"] and took < 2.0          # the deadline, not the index's answer
            workers, took = await route(busy_w0, client, "r2")
            assert workers == ["w1"] and took < 0.5          # the breaker is open: no call at all
        finally:
            await client.close()


async def test_a_down_index_falls_back_to_load(busy_w0):
    async with Index(hit("w0", 4)) as target:
        pass                                                   # a port nothing listens on any more
    client = PrefixClient(target, None, timeout_s=0.5)
    try:
        workers, took = await route(busy_w0, client, "r1")
        assert workers == ["w1"] and took < 2.0
    finally:
        await client.close()
