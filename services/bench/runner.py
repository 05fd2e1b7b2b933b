"""Drive one benchmark run: warm-up, paced arrivals, a concurrency cap, a progress bar.

Requests go out at absolute arrival offsets (arrivals.py). With --max-concurrency the sender waits
for a free slot; requests that fall behind then go out as soon as one frees (vLLM's behaviour:
the request clock starts when the request is actually sent). For multi-turn workloads the unit of
arrival and of --max-concurrency is the conversation: one request of a conversation is in flight
at a time, with --multi-turn-think-time between a reply and the next user message. Every
conversation sent is one user: its turns carry OpenAI's `user` field, `bench-<run>-<n>`, unique per
run, so a server that routes by it (kvmesh) keeps the turns on the worker holding the history.
"""
from __future__ import annotations

import asyncio
import itertools
import secrets
import sys
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import aiohttp
import numpy as np
from tqdm import tqdm

from services.bench.arrivals import iter_arrival_times
from services.bench.client import RequestInput, RequestResult, send_request
from services.bench.datasets import Conversation, SampleRequest


@dataclass(frozen=True)
class RunConfig:
    api_url: str
    model: str
    chat: bool
    headers: dict
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_requests: int = 1000  # items to send (cycling the dataset); ignored with duration
    duration: float | None = None  # seconds: send until then instead of num_requests
    num_warmups: int = 0
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict | None = None
    request_timeout: float = 600.0
    think_time: float = 0.0
    seed: int = 0
    disable_tqdm: bool = False


class RunOutput(NamedTuple):
    results: list[RequestResult]  # in send order (turns of a conversation in order)
    duration: float  # first send -> last completion, seconds
    t0: float  # perf_counter() at the start


def _session(cfg: RunConfig) -> aiohttp.ClientSession:
    # Pool sized to the concurrency cap (0 = unbounded when only the arrival rate limits load).
    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency or 0, limit_per_host=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout, sock_connect=30, sock_read=cfg.request_timeout)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=2**20, trust_env=False)


class _Sender:
    """Turns dataset items into requests on one session; counts them on the progress bar."""

    def __init__(self, cfg: RunConfig, session: aiohttp.ClientSession, count_tokens: Callable[[str], int],
                 pbar: tqdm | None):
        self.cfg, self.session, self.count_tokens, self.pbar = cfg, session, count_tokens, pbar

    def _input(self, prompt, prompt_len: int, output_len: int | None, user: str | None = None) -> RequestInput:
        c = self.cfg
        return RequestInput(c.api_url, c.model, prompt, prompt_len, output_len, c.chat, c.ignore_eos,
                            c.temperature, c.extra_body, user)

    async def _send(self, req: RequestInput) -> RequestResult:
        res = await send_request(self.session, req, self.cfg.headers)
        if self.pbar is not None:
            self.pbar.update(1)
        return res

    async def single(self, item: SampleRequest) -> list[RequestResult]:
        prompt = [{"role": "user", "content": item.prompt}] if self.cfg.chat else item.prompt
        return [await self._send(self._input(prompt, item.prompt_len, item.output_len))]

    async def conversation(self, conv: Conversation, user: str) -> list[RequestResult]:
        history: list[dict] = []
        history_len = 0  # tokens of the history so far
        results = []
        for i, turn in enumerate(conv.turns):
            if i and self.cfg.think_time:
                await asyncio.sleep(self.cfg.think_time)
            history.append({"role": "user", "content": turn.prompt})
            history_len += turn.prompt_len
            res = await self._send(self._input(list(history), history_len, turn.output_len, user))
            res.turn = i
            results.append(res)
            if not res.success:
                break  # the rest of the conversation has no reply to build on
            history.append({"role": "assistant", "content": res.generated_text})
            # the server's count of the reply where it reports one: no tokenizer call mid-run
            history_len += res.usage_output_tokens if res.usage_output_tokens is not None else \
                self.count_tokens(res.generated_text)
        return results

    def run(self, item, user: str) -> "asyncio.Future[list[RequestResult]]":
        return self.conversation(item, user) if isinstance(item, Conversation) else self.single(item)


def _num_requests(items: list, n: int) -> int:
    return sum(len(it.turns) if isinstance(it, Conversation) else 1 for it in itertools.islice(itertools.cycle(items), n))


async def _warmup(cfg: RunConfig, sender: _Sender, items: list) -> list[RequestResult]:
    """num_warmups requests (first turns for conversations), unpaced, results discarded by the caller."""
    firsts = [it.turns[0] if isinstance(it, Conversation) else it for it in items]
    warm = list(itertools.islice(itertools.cycle(firsts), cfg.num_warmups))
    sem = asyncio.Semaphore(cfg.max_concurrency or max(len(warm), 1))

    async def one(item):
        async with sem:
            return (await sender.single(item))[0]

    return list(await asyncio.gather(*(one(it) for it in warm)))


async def run_benchmark(items: list, cfg: RunConfig, count_tokens: Callable[[str], int],
                        on_warmup: Callable[[list[RequestResult]], None] | None = None) -> RunOutput:
    async with _session(cfg) as session:
        if cfg.num_warmups:
            results = await _warmup(cfg, _Sender(cfg, session, count_tokens, None), items)
            if on_warmup:
                on_warmup(results)
        total = None if cfg.duration else _num_requests(items, cfg.num_requests)
        pbar = None if cfg.disable_tqdm else tqdm(total=total, file=sys.stderr, unit="req", dynamic_ncols=True)
        sender = _Sender(cfg, session, count_tokens, pbar)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

        run_id = secrets.token_hex(4)   # this run's users are new to the server

        async def guarded(item, user: str) -> list[RequestResult]:
            try:
                return await sender.run(item, user)
            finally:
                if sem:
                    sem.release()

        times = iter_arrival_times(cfg.request_rate, cfg.burstiness, np.random.default_rng(cfg.seed))
        tasks = []
        t0 = time.perf_counter()
        for i, (item, offset) in enumerate(zip(itertools.cycle(items), times)):
            if cfg.duration is None and i >= cfg.num_requests:
                break
            if cfg.duration is not None and offset >= cfg.duration:
                break
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem:
                await sem.acquire()
            if cfg.duration is not None and time.perf_counter() - t0 >= cfg.duration:
                if sem:
                    sem.release()
                break
            tasks.append(asyncio.create_task(guarded(item, f"bench-{run_id}-{i}")))
        per_item = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if pbar is not None:
            pbar.close()
    return RunOutput([r for rs in per_item for r in rs], duration, t0)
