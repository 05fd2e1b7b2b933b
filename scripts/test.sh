#!/usr/bin/env bash
# Runs the whole test suite on a fresh machine: venv, dependencies, Redis and helm come with it.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/gpu_worker -k parity
# (-n 0 runs in one process: a later -n overrides the default below).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
[ -f "$ROOT/scripts/install_helm.sh" ] && bash "$ROOT/scripts/install_helm.sh"
export PATH="$ROOT/.venv/bin:$ROOT/.cache/bin:$PATH"
export TRITON_INTERPRET=1   # Triton kernels run on the CPU through the interpreter
cd "$ROOT"
# --durations: the slowest tests in every run's log, to keep CI well under its 20 minutes.
# -n: pytest-xdist workers, one per core of CI's 2-core machine (KVMESH_TEST_WORKERS to change);
# --dist loadfile keeps a file's tests, and its module fixtures (a stack, a model), on one worker.
exec python -m pytest -q -p no:cacheprovider --durations=15 \
  -n "${KVMESH_TEST_WORKERS:-2}" --dist loadfile "$@"
