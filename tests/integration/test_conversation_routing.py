"""A 6-turn chat with OpenAI's `user` set, through `kvmesh serve --workers 2` with a host-memory KV
tier and a small device pool, driven by the official client: every turn after the first goes to the
worker of the first, even while a request of no conversation keeps that worker the busier one
(least_loaded would send the turn to the other); each turn's `cached_tokens` reports the history it
reused (loaded back from the host tier where the device evicted it), and the replies are the tokens
of the same chat on one worker without tiers. The history's way down does not depend on timing:
the busy request takes all but one block of the device pool (LOAD_PROMPT)."""
from __future__ import annotations

import re
import threading
import time

import httpx
import openai
import pytest

from tests.integration.serve_proc import Serve
from tests.integration.test_serve_supervision import _metrics_pages

TURNS = 6
REPLY_TOKENS = 8
BLOCK = 16
POOL_BLOCKS = 32
# The busy request fills the device pool whatever the timing: its prompt and reply take all but one
# block (it never outgrows the pool), so each turn's history has left the device for the host tier
# (but for at most one block) by the time the turn can be admitted: the turn waits for blocks
# until the busy request ends.
LOAD_TOKENS = 2 * BLOCK
LOAD_PROMPT = (POOL_BLOCKS - 1) * BLOCK - LOAD_TOKENS
SETTLE_S = 0.6                # > 2 worker heartbeats (250 ms): the scheduler's load view is current


def _chat(serve: Serve, model: str, busy: bool) -> list[tuple[str, int, int]]:
    """The chat's turns: [(reply, prompt_tokens, cached_tokens)]. busy: a request of no
    conversation streams on the least loaded worker while each later turn is sent."""
    client = serve.openai()
    messages, out = [], []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"Turn {turn}: tell me about the number {turn * 7} and blue."})
        load = _start_load(serve, model, turn) if busy and turn else None
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=REPLY_TOKENS, temperature=0,
                                           user="alice", extra_body={"ignore_eos": True})
        if load is not None:
            load.join(timeout=60)
            assert not load.is_alive(), "the busy request did not finish within 60 s"
        reply = r.choices[0].message.content
        out.append((reply, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
        messages.append({"role": "assistant", "content": reply})
        time.sleep(SETTLE_S)
    return out


def _start_load(serve: Serve, model: str, turn: int) -> threading.Thread:
    """A streamed completion of unrelated token ids, running once this returns (its first token is in)."""
    started = threading.Event()

    def stream() -> None:
        ids = [(turn * 131 + i * 17) % 900 + 50 for i in range(LOAD_PROMPT)]
        chunks = serve.openai().completions.create(model=model, prompt=ids, max_tokens=LOAD_TOKENS, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
        for _ in chunks:
            started.set()
        started.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    assert started.wait(60), "the busy request streamed nothing within 60 s"
    return thread


def _bad_keys_are_400s_and_cost_nothing(serve: Serve) -> None:
    client, model = serve.openai(), serve.openai().models.list().data[0].id
    for field in ("user", "conversation_id"):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_body={field: "x" * 257})
        assert err.value.body["param"] == field and "at most 256 characters" in err.value.body["message"]
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"conversation_id": "chat-2"})
    assert r.choices[0].finish_reason in ("stop", "length")


def _metric(page: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}{{{re.escape(want)}}} (\S+)$" if want else rf"^{re.escape(name)} (\S+)$"
    found = re.search(pattern, page, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="module")
def baseline(tiny_model, tmp_path_factory) -> list[tuple[str, int, int]]:
    """The same chat on one worker without tiers and with room for everything."""
    serve = Serve(tmp_path_factory.mktemp("plain"), "--model", tiny_model, "--workers", "1", "--device", "cpu",
                  "--num-gpu-blocks", "512")
    try:
        serve.wait_serving()
        return _chat(serve, serve.openai().models.list().data[0].id, busy=False)
    finally:
        serve.stop()


def test_a_chat_sticks_to_its_worker_and_reuses_its_history_from_the_host_tier(tiny_model, tmp_path, baseline):
    serve = Serve(tmp_path, "--model", tiny_model, "--workers", "2", "--device", "cpu", "--routing", "least_loaded",
                  "--num-gpu-blocks", str(POOL_BLOCKS), "--block-size", str(BLOCK), "--kv-offload-cpu-gb", "0.05",
                  "--kv-load-policy", "always")
    try:
        serve.wait_serving()
        turns = _chat(serve, serve.openai().models.list().data[0].id, busy=True)
        pages = _metrics_pages(serve.log())
        with httpx.Client(trust_env=False, timeout=10) as http:
            scheduler = http.get(pages["scheduler"]).text
            workers = {w: http.get(pages[w]).text for w in ("worker-0", "worker-1")}
        _bad_keys_are_400s_and_cost_nothing(serve)
    finally:
        serve.stop()

    # routing: one new conversation, then every turn kept on its worker, none moved
    routes = {o: _metric(scheduler, "kvmesh_scheduler_conversation_routes_total", outcome=o)
              for o in ("new", "kept", "moved")}
    assert routes == {"new": 1, "kept": TURNS - 1, "moved": 0}
    sent = {w: _metric(scheduler, "kvmesh_scheduler_dispatched_total", worker=w) for w in workers}
    assert sum(sent.values()) == 2 * TURNS - 1                     # the turns and the busy requests
    chat_worker = max(sent, key=sent.get)
    # the busy requests mostly ran on the chat's worker too (both idle: the lowest id), so while
    # each was running least_loaded alone would have sent the turn to the other worker
    assert sent[chat_worker] > TURNS + (TURNS - 1) // 2
    # the history came back from the host tier where the device pool had let it go: every turn
    # after the first loaded at least one block (the busy request left at most one on the device)
    assert _metric(workers[chat_worker], "kvmesh_kv_tier_loaded_blocks", tier="cpu") >= TURNS - 1

    # usage: each turn reuses (at least) the previous turn's prompt, to its last full block
    tier_lines = [line for line in workers[chat_worker].splitlines() if line.startswith("kvmesh_kv_tier_")
                  or line.startswith("kvmesh_prefix_cache") or "preempt" in line]
    reused = [prev // BLOCK * BLOCK - BLOCK <= cached < prompt
              for (_, prev, _), (_, prompt, cached) in zip(turns, turns[1:])]
    if not all(reused):       # pytest cuts a long assertion message short: the whole story on stdout
        print("turns (prompt, cached):", [t[1:] for t in turns], "\ndispatched:", sent,
              "\n" + "\n".join(tier_lines), "\nserve log:\n" + serve.log()[-12000:])
    assert all(reused), [t[1:] for t in turns]
    assert turns[0][2] == 0
    # tokens: the same replies as the chat on one worker without tiers
    assert [t[0] for t in turns] == [t[0] for t in baseline]
    assert [t[1] for t in turns] == [t[1] for t in baseline]
