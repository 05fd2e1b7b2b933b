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
