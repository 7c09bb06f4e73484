#!/usr/bin/env bash
# Calibration of the golden gate on a list as shipped (issue 20; docs/logprob-gate.md): REPEATS runs of the
# correct kernels (the first with an empty golden cache: it makes the golden; the second with another empty
# cache: a second golden, its noise), then one run per mutation of MUTATIONS on a copy of the first run
# (`--resume` keeps vLLM's rows, which are never mutated; the bundled rows run mutated). Every run folder
# lands in WORK; benchmarks/golden_calibration_table.py WORK prints the table.
#
#   bash benchmarks/calibrate_golden.sh WORK [moe-eval run options, e.g. --hw cpu --gsm8k-dir DIR]
# MOE_EVAL ("moe-eval" by default) is the command; on the H200: MOE_EVAL="bash .vgpu/device_env.sh python3 -m moe_eval".
# More repeats later into the same WORK: FIRST=3 REPEATS=5 MUTATIONS="" (runs 3..5). COLD=1 gives each run a
# HOME of its own (WORK/home-i: vLLM's torch.compile cache, Triton's, moe-eval's built models start empty),
# so the run starts from cold caches throughout, not only from an empty golden cache.
set -u
work="${1:?usage: calibrate_golden.sh WORK [moe-eval run options]}"; shift
mkdir -p "$work" && work=$(cd "$work" && pwd)  # absolute: each run's HOME lies in it
REPEATS="${REPEATS:-2}"
MUTATIONS="${MUTATIONS-scale_one_expert scale_one_expert_small stale_gate_rows routing_temperature_slip scale_routing_weights bf16_down_accumulation}"
read -r -a cmd <<< "${MOE_EVAL:-moe-eval}"
mkdir -p "$work"
for i in $(seq "${FIRST:-1}" "$REPEATS"); do
  t=$(date +%s); cold=()
  if [ "${COLD:-0}" = 1 ]; then  # every cache a run reads, empty: HOME's, and those set elsewhere by variables
    mkdir -p "$work/home-$i"
    cold=(-u XDG_CACHE_HOME -u VLLM_CACHE_ROOT -u TRITON_CACHE_DIR -u MOE_EVAL_CACHE  # env: options first
          HOME="$work/home-$i" TORCHINDUCTOR_CACHE_DIR="$work/home-$i/inductor")
  fi
  env "${cold[@]}" MOE_EVAL_GOLDEN_CACHE="$work/goldens-$i" "${cmd[@]}" run "$@" --output-dir "$work/correct-$i" > "$work/correct-$i.log" 2>&1
  echo "correct-$i: exit $? in $(( $(date +%s) - t )) s"
done
[ -n "$MUTATIONS" ] || exit 0
first=$(ls -d "$work"/correct-1/*/ | head -1)
for m in $MUTATIONS; do
  t=$(date +%s)
  mkdir -p "$work/mutate-$m" && cp -r "$first" "$work/mutate-$m/"
  # The copy's summary.json is run 1's: the resumed run writes its own (benchmarks/golden_calibration_table.py
  # counts a row where its run's summary says it ran), so a run that dies first leaves none, not run 1's.
  rm -f "$work/mutate-$m"/*/summary.json
  MOE_EVAL_GOLDEN_CACHE="$work/goldens-1" "${cmd[@]}" run "$@" --resume "$(ls -d "$work/mutate-$m"/*/ | head -1)" \
    --mutate "$m" > "$work/mutate-$m.log" 2>&1
  echo "--mutate $m: exit $? in $(( $(date +%s) - t )) s"
done
