"""Prefill/decode hand-offs under faults, real processes: aborts at every stage free every block on
both workers and touch no other request; a decode worker dead mid-transfer leaves its request to
go on in one stream and nothing held on the prefill worker; a prefill worker dead mid-transfer still completes its
client's request in one stream. The decode worker is held mid-transfer with SIGSTOP: the prefill
worker has streamed the first token and waits for it."""
from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.integration.pd_stack import CHUNK, pd_stack
from tests.integration.stack import wait_for
from tests.integration.test_disaggregation import offline, texts

pytestmark = pytest.mark.timeout(600)
LEASE_MS = 2000


@pytest.fixture
def pd(tiny_model, tmp_path):
    with pd_stack(tiny_model, tmp_path, lease_ms=LEASE_MS) as stack:
        yield stack


def prompt_of(seed: int, length: int = 4 * CHUNK) -> list[int]:
    return [(seed * 31 + 7 * i) % 1000 + 5 for i in range(length)]


def stream(pd, prompt, max_tokens: int, chunks_before_close: int | None = None,
           events: list[dict] | None = None) -> tuple[str, list[dict]]:
    """A streamed greedy completion: its text and its events ([DONE] excluded; also appended to
    `events` as they come); closes the connection after `chunks_before_close` data events (0: as
    soon as the response starts)."""
    body = {"model": pd.model.rsplit("/", 1)[-1], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    events = [] if events is None else events
    with httpx.Client(timeout=60) as http, http.stream("POST", pd.base_url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if chunks_before_close is not None and len(events) >= chunks_before_close:
                break
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    text = "".join(c["text"] for e in events for c in e.get("choices", []))
    return text, events


def shm_segments() -> set[str]:
    """The hand-off's shared-memory segments (--kv-transport auto: P and D share this host)."""
    return set(glob.glob("/dev/shm/kvmesh-kv-*"))


def test_aborts_at_every_stage_free_both_sides_and_spare_other_requests(pd):
    segments = shm_segments()
    keep = prompt_of(99)
    expected = texts(pd.model, offline(pd.model, keep, max_tokens=40, temperature=0))[0]
    kept: list[str] = []
    survivor = threading.Thread(target=lambda: kept.append(stream(pd, keep, 40)[0]))
    survivor.start()
    # closed: before any token (queued or prefilling on P), at the first token (the hand-off
    # starts), and while decoding on D
    stages = [0, 1, 0, 2, 1, 5, 0, 3, 8]
    aborted = [threading.Thread(target=stream, args=(pd, prompt_of(i), 200, k)) for i, k in enumerate(stages)]
    for t in aborted:
        t.start()
    for t in [*aborted, survivor]:
        t.join(120)
    assert kept == [expected]
    for worker in ("prefill-0", "decode-0"):
        wait_for(lambda: pd.no_blocks_held(worker), LEASE_MS / 1000 + 10, f"{worker} to hold no block")
    assert pd.worker_metric("prefill-0", "kvmesh_worker_kv_handoff_shm_frames_total") >= 1
    wait_for(lambda: shm_segments() <= segments, LEASE_MS / 1000 + 10, "no shared-memory segment left")


def test_a_decode_worker_dead_mid_transfer_loses_no_token_and_leaves_nothing_held_on_the_prefill_worker(pd):
    prompt = prompt_of(3)      # its first token is whole characters (a lone UTF-8 byte would be held back)
    expected = texts(pd.model, offline(pd.model, prompt, max_tokens=50, temperature=0))[0]
    first = texts(pd.model, offline(pd.model, prompt, max_tokens=1, temperature=0))[0]
    assert first.isprintable() and first
    d_pid = pd.record("decode-0").info["pid"]
    os.kill(d_pid, signal.SIGSTOP)            # D reads nothing: P's Offer waits for an answer
    try:
        outcome: list = []
        client = threading.Thread(target=lambda: outcome.append(stream(pd, prompt, 50)))
        client.start()
        # P streams the first token without waiting for the transfer
        wait_for(lambda: pd.load("prefill-0").get("requests") == 1, 20, "P to hold the request")
        os.kill(d_pid, signal.SIGKILL)
    finally:
        os.kill(d_pid, signal.SIGCONT)
    pd.procs.procs.pop("decode-0").wait(30)
    t0 = time.monotonic()
    wait_for(lambda: pd.no_blocks_held("prefill-0"), LEASE_MS / 1000 + 5, "P's blocks free within the lease")
    assert time.monotonic() - t0 < LEASE_MS / 1000 + 5
    # ended by its lease, or sooner by the scheduler's Abort once D's worker lease lapsed (P's
    # sender thread stops mid-send for it)
    ended = [pd.worker_metric("prefill-0", "kvmesh_worker_kv_handoffs_total", f'outcome="{o}"')
             for o in ("timeout", "abort")]
    assert sum(ended) == 1, ended
    client.join(60)
    text, events = outcome[0]
    assert text.startswith(first), events      # the first token came from P, without waiting for D
    # whichever came first, P's hand-off lease (P decodes the request itself and says so: the
    # scheduler drops D's half) or the scheduler seeing D's worker lease lapse (P lets go of its
    # half quietly and the request moves on from the token the client had, to P, the one worker
    # left), the client gets one stream, every token once
    assert text == expected and all("error" not in e for e in events), events


def test_a_prefill_worker_dead_mid_transfer_still_completes_the_request(pd):
    prompt = prompt_of(2)      # its first token is whole characters: the client sees it at once
    expected = texts(pd.model, offline(pd.model, prompt, max_tokens=30, temperature=0))[0]
    first = texts(pd.model, offline(pd.model, prompt, max_tokens=1, temperature=0))[0]
    assert first.isprintable() and first
    d_pid, p_pid = pd.record("decode-0").info["pid"], pd.record("prefill-0").info["pid"]
    os.kill(d_pid, signal.SIGSTOP)
    try:
        outcome: list = []
        seen: list[dict] = []
        client = threading.Thread(target=lambda: outcome.append(stream(pd, prompt, 30, events=seen)))
        client.start()
        wait_for(lambda: seen, 30, "the first token at the client (from P, D stopped)")
        assert seen[0]["choices"][0]["text"] == first
        os.kill(p_pid, signal.SIGKILL)         # P waits for D's answer to its Offer
    finally:
        os.kill(d_pid, signal.SIGCONT)
    pd.procs.procs.pop("prefill-0").wait(30)
    client.join(120)
    text, events = outcome[0]
    assert text == expected                    # every token once: none lost, none repeated
    assert all("error" not in e for e in events)
    assert pd.route_count("rerun") == 1         # D recomputed it
    wait_for(lambda: pd.no_blocks_held("decode-0"), LEASE_MS / 1000 + 10, "D to hold no block")



def held_stream(pd, prompt, first: threading.Event, leave: threading.Event) -> None:
    """A streamed greedy completion whose client holds the connection open after the first data
    event until `leave` is set (at most 60 s), then goes away."""
    body = {"model": pd.model.rsplit("/", 1)[-1], "prompt": prompt, "max_tokens": 50, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", pd.base_url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                first.set()
                leave.wait(60)      # inside the loop: leaving it closes the response
                break


def test_a_stopped_decode_worker_stalls_nothing_else_on_the_prefill_worker(tiny_model, tmp_path):
    """P's hand-offs run on a thread of their own: while one waits for a stopped D (its lease is a
    minute here, and D's worker lease longer: the scheduler does not abort it), P streams another request's first token; that request's client leaving frees its
    blocks at once though its hand-off is queued behind the waiting one, and the first client
    leaving ends the waiting hand-off and frees its blocks at once, not at the lease."""
    # D's worker lease outlives the test: stopped, it stays registered (silent, not dead)
    with pd_stack(tiny_model, tmp_path, lease_ms=60_000, decode_extra=("--lease-ms", "120000")) as pd:
        d_pid = pd.record("decode-0").info["pid"]
        os.kill(d_pid, signal.SIGSTOP)
        try:
            a_first, a_leave = threading.Event(), threading.Event()
            a = threading.Thread(target=held_stream, args=(pd, prompt_of(3), a_first, a_leave))
            a.start()
            assert a_first.wait(30), "a's first token (from P; its hand-off waits for D now)"
            wait_for(lambda: pd.load("prefill-0").get("requests") == 1, 10, "P to hold a")
            b_events: list[dict] = []
            t0 = time.monotonic()
            b = threading.Thread(target=stream, args=(pd, prompt_of(2), 50, 1, b_events))
            b.start()
            wait_for(lambda: b_events, 15, "b's first token while a's hand-off waits")
            b.join(30)
            wait_for(lambda: pd.load("prefill-0").get("requests") == 1, 10, "P to let go of b")
            a_leave.set()
            a.join(30)
            wait_for(lambda: pd.no_blocks_held("prefill-0"), 10, "P to free a's blocks")
            assert time.monotonic() - t0 < 40                  # well inside a's lease
            assert pd.worker_metric("prefill-0", "kvmesh_worker_kv_handoffs_total", 'outcome="abort"') == 1
            assert pd.worker_metric("prefill-0", "kvmesh_worker_kv_handoff_expiries_total") == 0
        finally:
            os.kill(d_pid, signal.SIGCONT)



def test_a_decode_worker_without_room_leaves_the_request_to_the_prefill_worker(tiny_model, tmp_path):
    """D's pool (12 blocks) holds one of two concurrent 10-block prompts: D refuses the other's KV,
    P decodes that one itself, and each client sees one stream, token for token what one engine
    streams."""
    with pd_stack(tiny_model, tmp_path, decode_extra=("--num-gpu-blocks", "12")) as pd:
        prompts = [prompt_of(seed, length=150) for seed in (5, 6)]
        expected = [texts(pd.model, offline(pd.model, p, max_tokens=30, temperature=0))[0] for p in prompts]
        results: dict[int, tuple[str, list[dict]]] = {}
        clients = [threading.Thread(target=lambda i=i: results.__setitem__(i, stream(pd, prompts[i], 30)))
                   for i in range(2)]
        for c in clients:
            c.start()
        for c in clients:
            c.join(120)
        assert [results[i][0] for i in range(2)] == expected
        assert all("error" not in e for i in range(2) for e in results[i][1])
        assert pd.route_count("pd") == 2
        assert pd.worker_metric("prefill-0", "kvmesh_worker_kv_handoffs_total", 'outcome="refused"') == 1
        assert pd.worker_metric("prefill-0", "kvmesh_worker_kv_handoffs_total", 'outcome="ack"') == 1
        for worker in ("prefill-0", "decode-0"):
            wait_for(lambda: pd.no_blocks_held(worker), 10, f"{worker} to hold no block")
