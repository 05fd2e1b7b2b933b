#!/usr/bin/env bash
# Creates .venv and installs kvmesh with everything its tests need, once per pyproject change.
# Run by scripts/test.sh and scripts/serve.sh; safe to run again (it is a no-op when current).
# Every step says what it does and how long it took, and pip shows its own progress: bars on a
# terminal, one line per package on CI (no terminal: bars would only redraw into the log).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.kvmesh-installed"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/bootstrap.sh" | sha256sum | cut -d' ' -f1)"

if [ -t 2 ]; then progress=(); else progress=(--progress-bar off); fi

step() {  # step WHAT COMMAND...: one line before, one after with the time taken; pip's output on stderr
  local what="$1" t0=$SECONDS
  shift
  echo "[bootstrap] $what" >&2
  "$@" >&2
  echo "[bootstrap] $what: done in $((SECONDS - t0)) s" >&2
}

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV" python3 -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[bootstrap] installing dependencies in 3 steps (the first run takes a few minutes)" >&2
  pip=("$VENV/bin/python" -m pip install --disable-pip-version-check "${progress[@]}")
  step "1/3 pip" "${pip[@]}" --upgrade pip
  # The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
  step "2/3 torch 2.13.0" "${pip[@]}" "torch==2.13.0"
  step "3/3 kvmesh and its dependencies (-e .[test])" "${pip[@]}" -e "$ROOT[test]"
  echo "$want" > "$STAMP"
fi
