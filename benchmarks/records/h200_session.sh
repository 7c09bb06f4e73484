#!/usr/bin/env bash
# One lent-H200 session: GPU smoke tests, tuning, benchmark, correctness at the real shapes.
# Every stage is time-boxed and logs under $OUT; a failing smoke test stops the session early
# (no point tuning a broken kernel). Usage (repo root): OUT=/some/dir bash benchmarks/records/h200_session.sh [stages]
# stages: any of smoke tune bench correct (default: all four, in that order).
set -u
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton-cache}"
OUT="${OUT:?set OUT}"
STAGES="${*:-smoke tune bench correct}"
mkdir -p "$OUT/logs"
{
  date -u; nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv
  python3 -c 'import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name())'
} 2>&1 | tee "$OUT/logs/env.txt"
stage_time() { echo "== $1 $(date -u +%T)" >&2; }

if [[ " $STAGES " == *" smoke "* ]]; then
  stage_time smoke
  timeout "${SMOKE_TIMEOUT:-80}" python3 -m pytest tests/kernels/test_fused_moe.py -q -x -k "not real_shape" -p no:cacheprovider 2>&1 | tee "$OUT/logs/smoke.txt" | tail -5
  if [[ ${PIPESTATUS[0]} -ne 0 ]]; then echo "SMOKE FAILED: stopping" >&2; STAGES=""; fi
fi
if [[ " $STAGES " == *" tune "* ]]; then
  stage_time tune
  timeout "${TUNE_TIMEOUT:-330}" python3 benchmarks/tune_fused_moe.py ${TUNE_ARGS:-} 2>&1 | tee "$OUT/logs/tune.txt" | grep -E "^[A-Z].* M=|precompil|wrote|Error|error" | tail -60
  mkdir -p "$OUT/tuned_configs" && cp moe_eval/kernels/tuned_configs/*.json "$OUT/tuned_configs/" 2>/dev/null
fi
if [[ " $STAGES " == *" bench "* ]]; then
  stage_time bench
  timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/bench_fused_moe.py --out-dir "$OUT/bench" ${BENCH_ARGS:-} \
    2> "$OUT/logs/bench_stderr.txt" > "$OUT/logs/bench_stdout.txt"
  echo "bench rc=$?"; grep -E "triton .* us" "$OUT/logs/bench_stderr.txt" | tail -60
fi
if [[ " $STAGES " == *" correct "* ]]; then
  stage_time correct
  MOE_EVAL_CORRECTNESS_LOG="$OUT/correctness.jsonl" timeout "${CORRECT_TIMEOUT:-120}" \
    python3 -m pytest tests/kernels/test_fused_moe.py -q -m gpu -k real_shape -p no:cacheprovider 2>&1 | tee "$OUT/logs/correct.txt" | tail -4
fi
stage_time "done"
# At most 8 files come back: pack everything into one archive beside the console log.
tar -C "$OUT" -czf /tmp/results.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/results.tgz "$OUT/results.tgz"
