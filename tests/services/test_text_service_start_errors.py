"""The services that load the model's tokenizer (`kvmesh gateway --text-in-gateway`, `kvmesh
tokenizer`) refuse a --model whose tokenizer cannot be loaded as any bad flag is refused: one
line naming the flag and exit 2 (which `kvmesh serve` reports as a refused setting, not as a
crash to restart), not a traceback."""
import json
import logging

import pytest

from services.gateway import main as gateway_main
from tokenizer_svc import main as tokenizer_main

NO_REDIS = ["--insecure-internal-planes", "--redis-url", "redis://127.0.0.1:1", "--log-level", "error"]
SERVICES = {
    "gateway": (gateway_main, ["--text-in-gateway", "--port", "1", "--zmq-port", "0"]),   # never bound
    "tokenizer": (tokenizer_main, ["--port", "0", "--zmq-port", "0", "--metrics-port", "-1"]),
}


@pytest.fixture(autouse=True)
def _keep_test_logging(monkeypatch):
    """main() installs the service's root log handler: not inside the test process."""
    for module, _ in SERVICES.values():
        monkeypatch.setattr(module, "setup_logging", lambda *a, **k: None)


def _model_dirs(tmp_path):
    missing = tmp_path / "nope"
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text(json.dumps({"model_type": "llama"}))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "tokenizer.json").write_text("{not json")
    return {"missing": (missing, "does not exist"), "no-tokenizer": (no_tokenizer, "tokenizer.json"),
            "corrupt": (corrupt, "not a valid tokenizer file")}


@pytest.mark.parametrize("service", list(SERVICES))
@pytest.mark.parametrize("case", ["missing", "no-tokenizer", "corrupt"])
def test_unloadable_tokenizer_is_a_refused_flag(service, case, tmp_path, caplog):
    module, args = SERVICES[service]
    model, why = _model_dirs(tmp_path)[case]
    with caplog.at_level(logging.ERROR):
        assert module.main([*NO_REDIS, *args, "--model", str(model)]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith(f"--model {model}: ") and why in errors[0], errors
