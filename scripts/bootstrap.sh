#!/usr/bin/env bash
# Creates .venv and installs kvmesh with everything its tests need, once per pyproject change.
# Sourced by scripts/test.sh and scripts/serve.sh; safe to run again (it is a no-op when current).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.kvmesh-installed"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/bootstrap.sh" | sha256sum | cut -d' ' -f1)"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[bootstrap] creating $VENV" >&2
  python3 -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[bootstrap] installing dependencies (first run takes a few minutes)" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
  echo "$want" > "$STAMP"
fi
