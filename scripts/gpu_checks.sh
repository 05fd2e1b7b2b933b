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
#   bash scripts/gpu_checks.sh spec         speculative decoding at batch 1 / 8 / 64: ngram (and draft_model, the
#                                           target as its own draft, where the GPU holds two 8B copies) on the 8B
#                                           model; mtp and its oracle on a 1B model with an MTP layer
#   bash scripts/gpu_checks.sh migration    a request moved mid-decode: with its KV (frames, cuda_ipc) or recomputed
#   bash scripts/gpu_checks.sh engine       the engine lines (a regression check against BENCHMARKS.md)
set -euo pipefail
stage="${1:?stage: tests | transfer | pd | tiers | structured | spec | migration | engine}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
case "$stage" in tests|transfer|pd|tiers|structured|spec|migration|engine) ;;
  *) echo "unknown stage '$stage' (tests | transfer | pd | tiers | structured | spec | migration | engine)" >&2; exit 2 ;;
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
    M8=/tmp/kvmesh-llama-8b M1=/tmp/kvmesh-llama-1b-mtp
    [ -f $M8/config.json ] || python3 -m services.cli make-model --arch llama --size 8b $M8
    [ -f $M1/config.json ] || python3 -m services.cli make-model --arch llama --size 1b --mtp-layers 1 $M1
    # two engines share the GPU at 0.42 each: a self-draft holds two copies of the 8B weights
    methods=ngram; [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ] \
      && methods=ngram,draft_model
    timeout -s TERM 330 python3 bench/spec_decode_bench.py --model-dir $M8 --methods $methods --batches 1,8,64 \
      2>&1 | tee "$log"
    timeout -s TERM 200 python3 bench/spec_decode_bench.py --model-dir $M1 --methods mtp --mtp-oracle-dir $M1-oracle \
      --batches 1,8,64 2>&1 | tee -a "$log" ;;
  migration)
    timeout -s TERM 560 python3 bench/serve_bench.py --sections migration --migration-modes peer,peer_ipc,recompute \
      --time-budget 540 2>&1 | tee "$log" ;;
  engine)
    timeout -s TERM 560 python3 bench/gpu_bench.py --sections engine --time-budget 520 2>&1 | tee "$log" ;;
esac
