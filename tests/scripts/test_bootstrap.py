"""scripts/bootstrap.sh shows its progress: a line per step with its time, and pip's own output.

Runs the real script, offline, on a copy of the repository root holding a one-module package: its
.venv (made without pip) sees this environment's packages, pip, setuptools and torch included,
through a .pth file, and PIP_NO_INDEX keeps pip off the network."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = """[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "bootstrap-probe"
version = "0"

[project.optional-dependencies]
test = []

[tool.setuptools]
py-modules = ["bootstrap_probe"]
"""


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "bootstrap.sh", root / "scripts" / "bootstrap.sh")
    (root / "pyproject.toml").write_text(PYPROJECT)
    (root / "bootstrap_probe.py").write_text("")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / ".venv")], check=True, timeout=120)
    site = subprocess.run([str(root / ".venv" / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    Path(site, "outer-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return root


def _bootstrap(root: Path) -> subprocess.CompletedProcess:
    # pip reads the variable of a --no-X flag inverted: PIP_NO_BUILD_ISOLATION=0 builds without
    # isolation, with this environment's setuptools (isolation would download one)
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0"}
    return subprocess.run(["bash", str(root / "scripts" / "bootstrap.sh")], env=env, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)


def test_each_step_is_announced_with_its_time_and_pip_shows_its_own_progress(tmp_path):
    root = _root(tmp_path)
    t0 = time.monotonic()
    r = _bootstrap(root)
    assert r.returncode == 0, r.stderr[-3000:]
    err = r.stderr
    for step in ("1/3 pip", "2/3 torch", "3/3 kvmesh"):
        assert f"[bootstrap] {step}" in err, err[-3000:]
        assert any(line.startswith(f"[bootstrap] {step}") and ": done in " in line for line in err.splitlines())
    assert "Requirement already satisfied: torch==2.13.0" in err          # pip's own lines, not -q
    assert "Successfully installed bootstrap-probe" in err
    assert "\r" not in err and "━" not in err                            # no progress-bar redraws off a terminal
    assert r.stdout == ""                                                # all of it on stderr
    assert time.monotonic() - t0 < 300

    again = _bootstrap(root)                                             # current: says and does nothing
    assert again.returncode == 0 and again.stderr == "" and again.stdout == ""
