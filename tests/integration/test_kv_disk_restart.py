"""A worker with a disk KV tier, told to leave (SIGTERM), writes its cached KV to its directory;
`kvmesh serve` restarts it under the same id on the same directory (as Kubernetes restarts a pod's
container on its volume), and the restarted worker serves the prompt's prefix from disk: the same
tokens, `cached_tokens` reporting the reuse. Workers on a shared directory leave theirs there for
any worker of the node. Real processes, the official client."""
from __future__ import annotations

import os
import re
import signal

from tests.integration.serve_proc import Serve
from tests.integration.stack import wait_for
from tests.integration.test_serve_supervision import _redis_url, _worker_pid_in_registry

BLOCK = 16
PROMPT = [(i * 37) % 900 + 50 for i in range(9 * BLOCK + 3)]      # 9 full blocks and a bit


def _complete(serve: Serve, model: str) -> tuple[str, int]:
    r = serve.openai().completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens


def test_a_drained_worker_leaves_its_kv_on_disk_and_restarts_warm(tiny_model, tmp_path):
    directory = tmp_path / "kv"
    serve = Serve(tmp_path, "--model", tiny_model, "--workers", "1", "--device", "cpu", "--num-gpu-blocks", "256",
                  "--block-size", str(BLOCK), "--kv-offload-dir", str(directory), "--kv-offload-disk-gb", "0.05")
    try:
        serve.wait_serving()
        model = serve.openai().models.list().data[0].id
        text, cached = _complete(serve, model)                  # its blocks stay on the device
        assert cached == 0
        own_dir = directory / "worker-0"                          # serve: one directory per worker
        assert not [n for n in os.listdir(own_dir) if n.endswith(".kvb")]

        redis_url, drained = _redis_url(serve), serve.child("--worker-id worker-0")
        os.kill(drained, signal.SIGTERM)
        wait_for(lambda: f"worker-0 (pid {drained}) exited with code 0; restarting it in" in serve.log(), 60,
                 "worker-0's drain and exit")
        files = [n for n in os.listdir(own_dir) if n.endswith(".kvb")]
        assert len(files) >= 9, files                            # the prompt's full blocks at least
        assert re.search(r"KV drain to the disk tier: wrote \d+ cached blocks", serve.log())

        wait_for(lambda: (p := serve.child("--worker-id worker-0")) not in (None, drained)
                 and _worker_pid_in_registry(redis_url, "worker-0") == p, 90, "worker-0 to be back")
        assert re.search(r"KV disk tier .*worker-0: restored \d+ blocks", serve.log())
        again, cached = _complete(serve, model)                 # an empty device: the prefix came from disk
        assert again == text
        assert cached >= 8 * BLOCK, cached
        assert serve.stop() == 0
    finally:
        serve.stop()


def test_drained_workers_leave_their_kv_in_the_shared_tier_and_any_worker_loads_it(tiny_model, tmp_path):
    """Two workers on one shared directory (a node's `kvOffload.shared`): both told to leave write
    their cached KV there, and whichever worker takes the next request loads the prefix from it,
    authenticated with the key every worker derives from the stack's trust material."""
    directory = tmp_path / "shared"
    serve = Serve(tmp_path, "--model", tiny_model, "--workers", "2", "--device", "cpu", "--num-gpu-blocks", "256",
                  "--block-size", str(BLOCK), "--kv-offload-shared-dir", str(directory),
                  "--kv-offload-shared-gb", "0.05")
    try:
        serve.wait_serving()
        model = serve.openai().models.list().data[0].id
        text, cached = _complete(serve, model)
        assert cached == 0
        redis_url = _redis_url(serve)
        for worker in ("worker-0", "worker-1"):          # one of them holds the prompt's blocks
            drained = serve.child(f"--worker-id {worker}")
            os.kill(drained, signal.SIGTERM)
            wait_for(lambda: f"{worker} (pid {drained}) exited with code 0; restarting it in" in serve.log(), 60,
                     f"{worker}'s drain and exit")
            wait_for(lambda: (p := serve.child(f"--worker-id {worker}")) not in (None, drained)
                     and _worker_pid_in_registry(redis_url, worker) == p, 90, f"{worker} to be back")
        assert re.search(r"KV drain to the shared tier: wrote [1-9]\d* cached blocks", serve.log())
        files = [f for _, _, names in os.walk(directory) for f in names if f.endswith(".kvb")]
        assert len(files) >= 9, files
        again, cached = _complete(serve, model)          # both devices empty: the prefix came from the shared tier
        assert again == text
        assert cached >= 8 * BLOCK, cached
        assert serve.stop() == 0
    finally:
        serve.stop()
