"""`kvmesh serve`: the launcher brings the whole stack up, serves, and stops cleanly on SIGTERM."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.integration.conftest import free_port
from tests.integration.serve_proc import Serve, cmdline
from tests.integration.stack import FAST, ROOT, redis_and_procs, wait_for, wait_ready


def test_serve_starts_serves_and_stops(tmp_path):
    """No --model: the built-in tiny model is made on first use (in KVMESH_CACHE_DIR)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env["KVMESH_LEASE_MS"] = "1500"          # env vars and flags meet in one config
    env["KVMESH_CACHE_DIR"] = str(tmp_path / "cache")
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--port", str(port),
                             "--device", "cpu", "--heartbeat-ms", "250", "--num-gpu-blocks", "512"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    tiny_model = str(tmp_path / "cache" / "models" / "llama-tiny")
    try:
        wait_ready(f"http://127.0.0.1:{port}", 180)
        import openai
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        r = client.chat.completions.create(model=os.path.basename(tiny_model), max_tokens=3,
                                           messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content is not None
        wait_for(lambda: "kvmesh is serving" in (tmp_path / "serve.log").read_text(), 10, "the launcher's banner")
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert proc.wait(30) == 0
        assert time.monotonic() - t0 < 20
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_rejects_unknown_env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env["KVMESH_WORKRES"] = "2"
    r = subprocess.run([sys.executable, "-m", "services.cli", "serve"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "KVMESH_WORKRES" in r.stderr and "KVMESH_WORKERS" in r.stderr


def test_serve_refuses_a_busy_port_before_starting_anything(tmp_path):
    """The gateway's port is checked first: exit 2 naming --port, no model made, no service started."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env["KVMESH_CACHE_DIR"] = str(tmp_path / "cache")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--port", str(port), "--device", "cpu"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert f"--port {port}" in r.stderr and "in use" in r.stderr, r.stderr
    assert "started" not in out and "kvmesh is serving" not in out, out[-3000:]
    assert not (tmp_path / "cache").exists()            # not even the built-in model was made
    assert time.monotonic() - t0 < 60


def test_gateway_logs_its_url_only_once_it_listens(tmp_path):
    """On a busy port the gateway exits without ever claiming to serve there."""
    with redis_and_procs(tmp_path) as (_redis, procs), socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        gateway = procs.start("gateway", "gateway", *FAST, "--port", str(port), "--zmq-port", "0")
        assert gateway.wait(60) != 0
        log = (tmp_path / "gateway.log").read_text()
        assert "gateway on http" not in log, log[-3000:]
        free = free_port()
        procs.start("gateway-ok", "gateway", *FAST, "--port", str(free), "--zmq-port", "0")
        wait_for(lambda: f"gateway on http://127.0.0.1:{free}" in (tmp_path / "gateway-ok.log").read_text(), 60,
                 "the gateway's URL once it listens")
        assert httpx.get(f"http://127.0.0.1:{free}/health", timeout=5).status_code == 200


def test_serve_refuses_out_of_range_flags_before_starting_anything():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    r = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--workers", "0"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--workers=0 needs --prefill-workers and --decode-workers" in r.stderr, r.stderr


def test_serve_stops_with_the_engines_reason_when_the_model_refuses_a_setting(tiny_model, tmp_path):
    """A value only the model can judge (a context longer than its positions) stops the stack with
    the worker's one-line reason, not a traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    r = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", tiny_model, "--port",
                        str(free_port()), "--device", "cpu", "--max-model-len", "1000000"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "cannot start the engine: --max-model-len: " in out, out[-3000:]
    assert "worker-0 exited with code 2 during start-up" in out and "Traceback" not in out, out[-3000:]


@pytest.mark.parametrize("flags, with_tokenizer", [((), False), (("--no-text-in-gateway",), True),
                                                   (("--no-detokenize-in-gateway",), True)])
def test_serve_starts_the_tokenizer_service_only_when_requests_reach_it(tiny_model, tmp_path, flags, with_tokenizer):
    """By default the gateway makes the text: no tokenizer process, and /ready does not wait for
    one (nor a prefix-cache index, which one worker never needs). With --no-text-in-gateway (or its deprecated spelling, which says so once) it is started,
    requests go through it, and /ready needs it: stopped past its lease, the stack is not ready."""
    serve = Serve(tmp_path, "--model", tiny_model, "--null-model", *flags)
    try:
        serve.wait_serving()
        tokenizer = serve.child(" tokenizer ")
        assert (tokenizer is not None) is with_tokenizer, serve.log()[-3000:]
        assert serve.child(" prefix-cache ") is None   # one worker: the scheduler never asks the index
        assert ("--text-in-gateway" in cmdline(serve.child(" gateway "))) is not with_tokenizer
        assert serve.log().count("is deprecated") == (1 if "--no-detokenize-in-gateway" in flags else 0)
        r = serve.openai().completions.create(model=os.path.basename(tiny_model), prompt="hi", max_tokens=4)
        assert r.usage.completion_tokens == 4
        if tokenizer is None:
            return
        os.kill(tokenizer, signal.SIGSTOP)    # alive to the supervisor, silent to the registry
        try:
            wait_for(lambda: _ready(serve) == (503, "no tokenizer is registered"), 30, "/ready to need the tokenizer")
        finally:
            os.kill(tokenizer, signal.SIGCONT)
        wait_for(lambda: _ready(serve)[0] == 200, 30, "/ready once the tokenizer is back")
    finally:
        serve.stop()


def _ready(serve: Serve) -> tuple[int, str]:
    r = httpx.get(serve.base_url + "/ready", timeout=5)
    return r.status_code, r.json().get("reason", "")
