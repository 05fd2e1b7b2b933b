#!/usr/bin/env bash
# The GPU checks CPU CI cannot run, in stages that each fit one device call (10 minutes), for a
# machine without network: the Python wheels torch/triton/transformers lack are installed from
# .whl/ (made on the CPU machine: bench/README.md, "The device command"; carry it). Logs and
# JSON go to $OUT (default /tmp/gpu_checks).
#
#   bash scripts/gpu_checks.sh tests        the gpu-marked tests (one GPU: TP tests skip); not kernels/ nor the
#                                           grouped-GEMM test, whose folders turn Triton's interpreter on
#   bash scripts/gpu_checks.sh transfer     P/D hand-off GB/s and latency (zmq, shm, cuda_ipc) at 2k / 8k / 32k
#   bash scripts/gpu_checks.sh pd           one P + one D sharing the GPU (cuda_ipc) beside one mixed worker:
#                                           c=1, c=64 1024/128 and the prefill-heavy 4096/256 serving runs
#   bash scripts/gpu_checks.sh tiers        KV tiers: H2D/D2H against the pinned ceiling, load vs recompute
#   bash scripts/gpu_checks.sh structured   JSON-schema TPOT against unconstrained at batch 1 and 64, async and sync
#   bash scripts/gpu_checks.sh spec         speculative decoding: ngram, draft_model, mtp (and its oracle)
#   bash scripts/gpu_checks.sh engine       the engine lines (a regression check against BENCHMARKS.md)
set -euo pipefail
stage="${1:?stage: tests | transfer | pd | tiers | structured | spec | engine}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
case "$stage" in tests|transfer|pd|tiers|structured|spec|engine) ;;
  *) echo "unknown stage '$stage' (tests | transfer | pd | tiers | structured | spec | engine)" >&2; exit 2 ;;
esac
export OUT="${OUT:-/tmp/gpu_checks}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$ROOT"
else
  export PYTHONPATH="$ROOT"
fi
log="$OUT/$stage.log"
case "$stage" in
  tests)
    timeout -s TERM 560 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu_worker \
      --ignore tests/gpu_worker/kernels --ignore tests/gpu_worker/parallel/test_grouped_gemm_triton.py 2>&1 | tee "$log" ;;
  transfer)
    timeout -s TERM 560 python3 bench/gpu_bench.py --sections kv_transfer --time-budget 530 2>&1 | tee "$log" ;;
  pd)
    KVMESH_KV_TRANSPORT=cuda_ipc timeout -s TERM 560 python3 bench/serve_bench.py --sections single,pd \
      --single-runs c1,c64,ph --c64-prompts 320 --ph-prompts 192 --time-budget 540 2>&1 | tee "$log" ;;
  tiers)
    timeout -s TERM 560 python3 bench/gpu_bench.py --sections kv_tiers --time-budget 520 2>&1 | tee "$log" ;;
  structured)
    timeout -s TERM 290 python3 bench/gpu_bench.py --sections structured --time-budget 260 2>&1 | tee "$log"
    timeout -s TERM 270 python3 bench/gpu_bench.py --sections structured --sync-scheduling --time-budget 240 \
      2>&1 | tee -a "$log" ;;
  spec)
    timeout -s TERM 560 python3 bench/spec_decode_bench.py --methods ngram,draft_model,mtp 2>&1 | tee "$log" ;;
  engine)
    timeout -s TERM 560 python3 bench/gpu_bench.py --sections engine --time-budget 520 2>&1 | tee "$log" ;;
esac
