"""The NIXL transport between real worker processes (`--kv-transport nixl` on both): the prefill
worker's agent metadata goes to the decode worker over the CURVE ZMQ socket, the decode worker reads
the blocks through NIXL/UCX (host memory here) and acknowledges over ZMQ. Greedy tokens match one
engine, no KV frame moves; aborts and a decode worker killed mid-transfer leave no block held.
Skipped where the `nixl` extra is not installed (CI)."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.integration.pd_stack import pd_stack
from tests.integration.stack import wait_for
from tests.integration.test_disaggregation import LONG, offline, served, texts
from tests.integration.test_disaggregation_faults import prompt_of, stream

pytest.importorskip("nixl", reason="the nixl extra is not installed")
pytestmark = pytest.mark.timeout(600)
LEASE_MS = 2000
NIXL = ("--kv-transport", "nixl")


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    with pd_stack(tiny_model, tmp_path_factory.mktemp("pd-nixl-logs"), prefill_extra=NIXL, decode_extra=NIXL,
                  lease_ms=LEASE_MS) as stack:
        yield stack


def test_greedy_through_nixl_matches_one_engine_and_moves_no_frame(pd):
    assert pd.record("prefill-0").info["kv_transport"] == "nixl"
    got = served(pd, LONG, max_tokens=12, temperature=0)
    assert got == texts(pd.model, offline(pd.model, LONG, max_tokens=12, temperature=0))
    assert pd.worker_metric("prefill-0", "kvmesh_worker_kv_handoffs_total", 'outcome="ack"') >= 1
    assert pd.route_count("pd") >= 1
    assert pd.worker_metric("prefill-0", "kvmesh_worker_kv_handoff_bytes_total") == 0    # D read them
    assert pd.worker_metric("prefill-0", "kvmesh_worker_kv_handoff_streamed_blocks_total") == 0


def test_aborts_free_both_sides(pd):
    stages = [0, 1, 2, 5]                      # closed before a token, at the first, while decoding on D
    aborted = [threading.Thread(target=stream, args=(pd, prompt_of(40 + i), 200, k)) for i, k in enumerate(stages)]
    for t in aborted:
        t.start()
    for t in aborted:
        t.join(120)
    for worker in ("prefill-0", "decode-0"):
        wait_for(lambda: pd.no_blocks_held(worker), LEASE_MS / 1000 + 10, f"{worker} to hold no block")


def test_a_decode_worker_killed_mid_transfer_leaves_nothing_held_on_the_prefill_worker(pd):
    d_pid = pd.record("decode-0").info["pid"]
    os.kill(d_pid, signal.SIGSTOP)            # D reads nothing: P's Offer waits for an answer
    try:
        outcome: list = []
        client = threading.Thread(target=lambda: outcome.append(stream(pd, prompt_of(3), 50)))
        client.start()
        wait_for(lambda: pd.load("prefill-0").get("requests") == 1, 20, "P to hold the request")
        os.kill(d_pid, signal.SIGKILL)
    finally:
        os.kill(d_pid, signal.SIGCONT)
    pd.procs.procs.pop("decode-0").wait(30)
    t0 = time.monotonic()
    wait_for(lambda: pd.no_blocks_held("prefill-0"), LEASE_MS / 1000 + 5, "P's blocks free within the lease")
    assert time.monotonic() - t0 < LEASE_MS / 1000 + 5
    client.join(60)
    _, events = outcome[0]
    assert "error" in events[-1]               # the stream ended with an error, not a hang
