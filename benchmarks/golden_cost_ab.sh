#!/usr/bin/env bash
# What the golden gate costs a run whose golden is cached (issue 20: within 15 % of the run without it), as
# an A/B pair on one machine: A = the embedded default's list as shipped (golden gate and decode
# continuations on), B = the same three configs with `golden: false` and `decode_texts: 0` (the run as it
# was before the gate: accuracy, McNemar, the divergence gate's 16 scored texts). Interleaved A B A B ...
# (PAIRS pairs, 2 by default) so a drift of the machine's speed falls on both; the golden is made first
# (`moe-eval golden`) into WORK/goldens, so no A run makes it. Prints each run's seconds and the ratio of
# the medians (benchmarks/golden_cost_report.py, which also takes several WORK folders); each run's folder
# stays in WORK.
#
#   bash benchmarks/golden_cost_ab.sh WORK [options for both moe-eval golden and run, e.g. --gsm8k-dir DIR]
# MOE_EVAL (the checkout's .venv/bin/moe-eval by default) is the command. Another gate's cost, the same way:
# OFF_ALL (lines added to every config of B; default "decode_texts: 0") and OFF_BUNDLED (added to the
# bundled-kernel configs of B; default "golden: false"), e.g. OFF_ALL= OFF_BUNDLED="layer_check: false" for
# the layer check; then GATE_TIMINGS (the report's timings keys: "layer_sweep_seconds").
set -u
work="${1:?usage: golden_cost_ab.sh WORK [moe-eval options]}"; shift
mkdir -p "$work" && work=$(cd "$work" && pwd)
cd "$(dirname "$0")/.." || exit 2  # the checkout: config-cpu.txt and its configs
PAIRS="${PAIRS:-2}"
read -r -a cmd <<< "${MOE_EVAL:-.venv/bin/moe-eval}"
python="${PYTHON:-.venv/bin/python}"
export MOE_EVAL_GOLDEN_CACHE="$work/goldens"
# The list as moe-eval reads it (moe_eval.configs.selection.read_list: comments, blank lines, missing files refused),
# as paths relative to the checkout.
mapfile -t shipped < <("$python" -c 'import os; from pathlib import Path; from moe_eval.configs.selection import read_list
print(*(os.path.relpath(p) for p in read_list(Path("config-cpu.txt"))), sep="\n")')
# No configs would make both sides the default list, and the ratio a comparison of A with A.
[ "${#shipped[@]}" -gt 0 ] || { echo "no configs in config-cpu.txt"; exit 2; }
without=()
for config in "${shipped[@]}"; do  # the gate-less copies, beside each other as in configs/ (baseline paths hold)
  copy="$work/$config"
  mkdir -p "$(dirname "$copy")" && cp "$config" "$copy"
  printf '\n%s\n' "${OFF_ALL-decode_texts: 0}" >> "$copy"
  grep -q '^moe_backend:' "$copy" && printf '%s\n' "${OFF_BUNDLED-golden: false}" >> "$copy"
  without+=("$copy")
done
"${cmd[@]}" golden --hw cpu --output-dir "$work/golden-logs" "${shipped[@]}" "$@" > "$work/golden.log" 2>&1 || { echo "moe-eval golden failed: $work/golden.log"; exit 2; }
timed() {  # timed NAME CONFIG... : one run, its seconds on a line of its own
  local name=$1 t rc; shift; t=$(date +%s.%N)
  "${cmd[@]}" run --hw cpu --output-dir "$work/$name" "$@" > "$work/$name.log" 2>&1
  rc=$?
  echo "$name exit $rc seconds $(python3 -c "import sys; print(round(float(sys.argv[1]) - float(sys.argv[2]), 1))" "$(date +%s.%N)" "$t")"
}
for i in $(seq 1 "$PAIRS"); do
  timed "with-gate-$i" "${shipped[@]}" "$@"
  timed "without-gate-$i" "${without[@]}" "$@"
done | tee "$work/times.txt"
# Medians, ratio, and the gate's own seconds in each run with it; refuses a run that did not pass.
# shellcheck disable=SC2086  # GATE_TIMINGS: a list of keys
"$python" benchmarks/golden_cost_report.py "$work" ${GATE_TIMINGS:+--gate-timings $GATE_TIMINGS}
