"""`kvmesh worker` settings that only the loaded engine can judge (the KV tiers' directories and
sizes, a context longer than the model's positions) end the worker with exit 2 and one log line
naming the flag, as load_or_exit does for a bad value before anything loads."""
from __future__ import annotations

import logging

import pytest

from gpu_worker.service import main as worker_main


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    from gpu_worker.make_model import make_model
    return str(make_model(tmp_path_factory.mktemp("model") / "llama", arch="llama", size="tiny", progress=False))


def _worker(llama: str, *flags: str) -> list[str]:
    return ["--model", llama, "--device", "cpu", "--redis-url", "redis://127.0.0.1:1/0", "--insecure-internal-planes",
            "--port", "0", "--zmq-port", "0", "--metrics-port", "-1", "--num-gpu-blocks", "16", *flags]


@pytest.mark.parametrize("flags, line", [
    (("--kv-offload-dir", "/proc/kvmesh-kv", "--kv-offload-disk-gb", "1"),
     "cannot start the engine: --kv-offload-dir: '/proc/kvmesh-kv' is on a pseudo-filesystem"),
    (("--kv-offload-dir", "/sys/kvmesh-kv", "--kv-offload-disk-gb", "1"),
     "cannot start the engine: --kv-offload-dir: '/sys/kvmesh-kv' is on a pseudo-filesystem"),
    (("--max-model-len", "1000000"), "cannot start the engine: --max-model-len: "),
])
def test_a_setting_the_engine_refuses_is_named_by_its_flag(llama, flags, line, monkeypatch, caplog):
    monkeypatch.setattr(worker_main, "setup_logging", lambda *a, **k: None)
    with caplog.at_level(logging.ERROR, logger="kvmesh.worker"):
        assert worker_main.main(_worker(llama, *flags)) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith(line), errors
    assert "invalid engine argument" not in errors[0] and "filesystem of" not in errors[0]
