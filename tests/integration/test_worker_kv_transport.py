"""`kvmesh worker --kv-transport nixl` where the `nixl` package cannot be imported: the worker stops at
start-up, before loading the model, with one line naming the flag and the package (exit code 2), not
a traceback. The package is hidden here by a `nixl` module first on the path that fails to import,
as a missing one does."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.integration.stack import ROOT


def test_nixl_without_the_package_is_a_clear_start_up_error(tiny_model, tmp_path):
    hidden = tmp_path / "no-nixl" / "nixl"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('No module named nixl')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env["PYTHONPATH"] = os.pathsep.join([str(hidden.parent), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "services.cli", "worker", "--model", tiny_model, "--device", "cpu",
                        "--role", "prefill", "--kv-transport", "nixl",
                        "--redis-url", "redis://127.0.0.1:1"], cwd=ROOT, env=env,   # never reached
                       capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "--kv-transport nixl needs the `nixl` package (pip install nixl" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
