"""`kvmesh serve` refuses a --model or --host it cannot use before it starts anything: one line
naming the flag, exit 2 (the same as a bad value of any other flag)."""
import socket

import pytest

from services import launcher
from services.launcher import main


@pytest.fixture(autouse=True)
def _keep_test_logging(monkeypatch):
    """main() installs the service's root log handler: not inside the test process."""
    monkeypatch.setattr(launcher, "setup_logging", lambda *a, **k: None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_missing_model_dir_names_the_flag(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nope"), "--port", str(_free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert "--model" in err and "does not exist" in err and "\n" not in err


def test_dir_that_is_not_a_model_names_the_flag(tmp_path, capsys):
    assert main(["--model", str(tmp_path), "--port", str(_free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert "--model" in err and "config.json" in err and "\n" not in err


def test_host_that_is_not_this_machine_names_host_not_port(capsys):
    # 192.0.2.0/24 is TEST-NET-1: never an address of this machine, so binding it fails
    assert main(["--host", "192.0.2.1", "--port", str(_free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvmesh serve: --host 192.0.2.1") and "choose another --port" not in err


def test_model_dir_without_a_tokenizer_names_the_flag(tmp_path, capsys):
    """The gateway (or the tokenizer service) needs tokenizer.json: refused before the stack starts,
    not by a gateway that exits during start-up."""
    (tmp_path / "config.json").write_text("{}")
    assert main(["--model", str(tmp_path), "--port", str(_free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvmesh serve: --model {tmp_path}: ") and "tokenizer.json" in err and "\n" not in err


@pytest.mark.parametrize("argv, flag, why", [
    (["--speculative-config", "{bad"], "--speculative-config", "not valid JSON"),
    (["--speculative-config", '{"method": "eagle"}'], "--speculative-config", "method must be one of"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'], "--speculative-config", "[1, 8]"),
    (["--kv-offload-dir", "KV"], "--kv-offload-dir", "go together"),
    (["--kv-offload-shared-gb", "1"], "--kv-offload-shared-dir", "go together"),
    (["--kv-offload-cpu-gb", "1", "--no-enable-prefix-caching"], "--kv-offload-cpu-gb", "enable_prefix_caching"),
])
def test_engine_settings_refused_before_anything_starts(argv, flag, why, tmp_path, capsys, monkeypatch):
    """The engine's checks that need no model run in serve itself: one line naming the flag, not
    a worker's log line after Redis, the scheduler and the workers have started."""
    def started(*_a):
        raise AssertionError("the stack started")
    monkeypatch.setattr(launcher, "ensure_model", lambda model: started())
    monkeypatch.setattr(launcher.Stack, "start", lambda self, model: started())
    argv = [a.replace("KV", str(tmp_path / "kv")) for a in argv]
    assert main([*argv, "--port", str(_free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvmesh serve: {flag}: ") and why in err and "\n" not in err, err


def test_shared_tier_inside_the_disk_tiers_parent_is_not_refused(tmp_path, monkeypatch):
    """serve gives each worker <--kv-offload-dir>/<worker>: a shared tier beside those (in the
    same parent) overlaps none of them, and the workers accept it."""
    monkeypatch.setattr(launcher, "ensure_model", lambda model: (_ for _ in ()).throw(RuntimeError("checked")))
    kv = tmp_path / "kv"
    with pytest.raises(RuntimeError, match="checked"):
        main(["--kv-offload-dir", str(kv), "--kv-offload-disk-gb", "1", "--kv-offload-shared-dir", str(kv / "shared"),
              "--kv-offload-shared-gb", "1", "--port", str(_free_port())])


def _refuse_start(monkeypatch):
    def started(*_a):
        raise AssertionError("the stack started")
    monkeypatch.setattr(launcher, "ensure_model", lambda model: "model")
    monkeypatch.setattr(launcher.Stack, "start", lambda self, model: started())


def test_unreachable_redis_url_names_the_flag(capsys, monkeypatch):
    """A --redis-url nothing answers on is refused before any child starts (each child would
    only log that Redis is unreachable, and serve would wait out --ready-timeout-s)."""
    _refuse_start(monkeypatch)
    port = _free_port()                     # closed again: nothing listens there
    assert main(["--null-model", "--redis-url", f"redis://:secret@127.0.0.1:{port}/0",
                 "--port", str(_free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvmesh serve: --redis-url: cannot reach Redis at 127.0.0.1:{port}") and "\n" not in err
    assert "secret" not in err              # the URL's password is never echoed


def test_redis_url_that_refuses_the_password_names_the_flag(capsys, monkeypatch):
    from services.embedded_redis import EmbeddedRedis
    _refuse_start(monkeypatch)
    with EmbeddedRedis(password="the-real-one") as redis:
        assert main(["--null-model", "--redis-url", redis.url.replace("redis://", "redis://:wrong@"),
                     "--port", str(_free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvmesh serve: --redis-url: the Redis at ") and "password" in err and "\n" not in err
