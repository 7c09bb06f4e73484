#!/usr/bin/env bash
# Issue 16's measurement: two TP1 configs packed (--jobs 2, a GPU or a core set each) against the same two
# served one after the other (--jobs 1), wall time and results of each run (docs/jobs.md).
#
# Usage (repo root): bash benchmarks/device/measure_jobs.sh WORK_DIR STEP... [-- moe-eval run options]
#   seed        both configs once, the vLLM row first (the bundled row compares with it); fills every cache
#               (Triton, torch.compile) so that the timed steps start warm
#   packed      --jobs 2 --baseline WORK_DIR/seed
#   sequential  --jobs 1 --baseline WORK_DIR/seed
# A step's wall time goes to WORK_DIR/times.tsv, its console to WORK_DIR/STEP-N.log. A timed step whose seed is
# missing (a fresh machine) runs the seed first. CONFIGS picks the pair (default: the GPU canary's TP1 pair);
# MOE_EVAL ("python3 -m moe_eval" by default) the command.
# On the lent H200s: bash .vgpu/device_env.sh bash benchmarks/device/measure_jobs.sh /tmp/jobs seed packed -- --hw h200
set -u
WORK="${1:?usage: measure_jobs.sh WORK_DIR STEP... [-- moe-eval run options]}"; shift
STEPS=()
while [[ $# -gt 0 && "$1" != "--" ]]; do STEPS+=("$1"); shift; done
[[ "${1:-}" == "--" ]] && shift
RUN_OPTIONS=("$@")
CONFIGS="${CONFIGS:-configs/canary-gpu-tp/Canary-Qwen3-MoE-BF16-vllm-triton.yaml configs/canary-gpu-tp/Canary-Qwen3-MoE-BF16-triton.yaml}"
read -r -a MOE_EVAL_CMD <<< "${MOE_EVAL:-python3 -m moe_eval}"
mkdir -p "$WORK"

run_step() {  # step, then its moe-eval run options
  local step="$1"; shift
  local n=1 log; for log in "$WORK/$step"-[0-9]*.log; do [[ -e "$log" ]] && n=$((n + 1)); done
  local started; started=$(date +%s.%N)
  # shellcheck disable=SC2086  # CONFIGS is a list of paths
  "${MOE_EVAL_CMD[@]}" run "${RUN_OPTIONS[@]}" --output-dir "$WORK/$step-$n" "$@" $CONFIGS > "$WORK/$step-$n.log" 2>&1
  local rc=$?
  local wall; wall=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$started" "$(date +%s.%N)")
  printf '%s\t%s\t%s\t%s\n' "$step-$n" "$wall" "$rc" "$(date -u +%FT%TZ)" >> "$WORK/times.tsv"
  echo "== $step-$n: ${wall} s, exit $rc" >&2
  tail -n 12 "$WORK/$step-$n.log" >&2
}

for step in "${STEPS[@]}"; do
  case "$step" in
    seed) run_step seed --jobs 1 ;;
    packed|sequential)
      [[ -n "$(find "$WORK/seed-1" -name results.json 2>/dev/null)" ]] || { rm -rf "$WORK"/seed-1*; run_step seed --jobs 1; }
      jobs=1; [[ "$step" == packed ]] && jobs=2
      run_step "$step" --jobs "$jobs" --baseline "$WORK/seed-1" ;;
    *) echo "measure_jobs.sh: unknown step '$step' (seed, packed, sequential)" >&2; exit 2 ;;
  esac
done
