#!/usr/bin/env bash
# Starts the whole stack on this machine (CPU when there is no GPU), with an embedded Redis and,
# when no --model is given, a small built-in model. Extra arguments go to `kvmesh serve`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
exec "$ROOT/.venv/bin/kvmesh" serve "$@"
