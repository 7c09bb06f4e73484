#!/usr/bin/env bash
# The layer check's cells at real shapes on the lent H200 (issue 40), from the checkout with the kit in
# .vgpu/ and GSM8K in .gsm8k/ (both carried):
#
#   STEPS="tests twin:qwen3 least:qwen3:M=1 layer:qwen3:1:0.98" bash benchmarks/device/layer_cells.sh
#
# Steps, in order, each one `moe-eval run` (a row alone: its config copied without baseline_config and with
# `golden: false`, so one server per run; the layer check needs no incumbent row):
#   tests                 the layer check's and the SiLU slope's GPU tests (a failure stops here)
#   twin:NAME             the CUDA-graph twin's bundled Triton row as shipped (qwen3, mixtral, scout)
#   canary                the GPU canary's TP1 bundled Triton row as shipped
#   least:NAME:RANGE      twin NAME again (--resume), its least-routed expert (read from the shipped run's
#                         tables) 1 % short in RANGE only: --mutate scale_expert:expert=E,range=RANGE
#   layer:NAME:L:S        twin NAME again, expert 0 scaled by S in layer L only, every range
#   silu:NAME:N           NAME (a twin or canary) N times with --mutate silu_slope (+0.5 %), each a new run
#   nocheck:NAME:N        NAME N times with `layer_check: false` (the cost's B side: no sampling, no sweep)
# Each step's output folder and log go to $OUT/layer-cells.tar.xz (tables, results.json, logs; no weights),
# re-packed after every step, so a call cut short keeps what finished. RUN_TIMEOUT (s) bounds one step;
# ROW_OPTS go to every `moe-eval run` (e.g. "--limit 40": the canary's questions, shipped and resumed alike).
set -u
out="${OUT:-/tmp/lc-out}"; work="/tmp/lc"
export MOE_EVAL_CACHE=/tmp/moe-eval-cache
mkdir -p "$out" "$work/configs" "$work/runs"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$work/gpu.txt"
pack() {
  tar -C "$work" -cJf "$out/layer-cells.tar.xz.part" --exclude='*.safetensors' --exclude='samples.jsonl' . \
    && mv -f "$out/layer-cells.tar.xz.part" "$out/layer-cells.tar.xz"
}
child=0
on_signal() {
  echo "signal: stopping moe-eval (pid $child) and packing what finished" >&2
  if [ "$child" -gt 0 ]; then kill -TERM "$child" 2> /dev/null; wait "$child"; fi
  pack; exit 143
}
trap on_signal TERM INT
moe_eval() {  # device_env.sh execs python, so $child is moe-eval itself
  timeout -s TERM "${RUN_TIMEOUT:-540}" bash .vgpu/device_env.sh python3 -m moe_eval "$@" & child=$!
  wait "$child"; local rc=$?; child=0; return "$rc"
}
alone() {  # CONFIG -> its copy without an incumbent or golden, in a folder of the same family name
  # ($EXTRA_LINES added too: the nocheck step's `layer_check: false`)
  local family; family="$(basename "$(dirname "$1")")"
  mkdir -p "$work/configs/$family"
  grep -v '^baseline_config:' "$1" > "$work/configs/$family/$(basename "$1")"
  printf 'golden: false\n%s\n' "${EXTRA_LINES:-}" >> "$work/configs/$family/$(basename "$1")"
  echo "$work/configs/$family/$(basename "$1")"
}
config_of() {
  case "$1" in
    qwen3) alone configs/twins-cuda-graph/Qwen3-30B-A3B-BF16-triton.yaml ;;
    mixtral) alone configs/twins-cuda-graph/Mixtral-8x7B-BF16-triton.yaml ;;
    scout) alone configs/twins-cuda-graph/Llama-4-Scout-BF16-triton.yaml ;;
    canary) alone configs/canary-gpu-tp/Canary-Qwen3-MoE-BF16-triton.yaml ;;
  esac
}
row() {  # NAME LOGNAME [moe-eval run options]: one run, its checks' lines printed
  local name=$1 log=$2; shift 2
  local t0; t0=$(date +%s)
  # shellcheck disable=SC2086
  moe_eval run --hw h200 --gsm8k-dir .gsm8k ${ROW_OPTS:-} "$@" "$(config_of "$name")" > "$work/$log.log" 2>&1
  local rc=$?
  echo "== $log: exit $rc in $(( $(date +%s) - t0 )) s"
  grep -h "layer_check\|jit_while\|: \(PASS\|FAIL\|INCOMPLETE\|ERROR\)" "$work/$log.log" | cut -c1-700
  pack
}
shipped_dir() { find "$work/runs/$1" -mindepth 1 -maxdepth 1 -type d | sort | head -1; }
resume() {  # NAME LOGNAME MUTATION: the shipped run copied, then run again mutated
  local name=$1 log=$2 mutation=$3
  rm -rf "$work/runs/$log" && mkdir -p "$work/runs/$log" && cp -r "$(shipped_dir "$name")" "$work/runs/$log/"
  row "$name" "$log" --resume "$(shipped_dir "$log")" --mutate "$mutation"
}
for step in ${STEPS:-tests twin:qwen3}; do
  IFS=: read -r kind a b c <<< "$step"
  case "$kind" in
    tests)
      bash .vgpu/device_env.sh python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_layer_check.py \
        tests/kernels/test_mutations.py -k "layer_check or cuda_graphs or silu" > "$work/gpu-tests.log" 2>&1
      rc=$?; tail -15 "$work/gpu-tests.log"; pack
      [ "$rc" = 0 ] || { echo "GPU tests: exit $rc; nothing served"; exit 1; } ;;
    twin|canary)
      name=${a:-canary}
      row "$name" "$name" --output-dir "$work/runs/$name" ;;
    least)
      expert=$(bash .vgpu/device_env.sh python3 benchmarks/layer_targets.py "$(shipped_dir "$a")" --least-routed "$b")
      echo "least-routed expert of $a in $b: $expert"
      resume "$a" "least-$a" "scale_expert:expert=$expert,range=$b" ;;
    layer)
      resume "$a" "layer-$a-$b" "scale_expert:expert=0,layer=$b,scale=$c" ;;
    silu)
      for i in $(seq 1 "${b:-1}"); do
        row "$a" "silu-$a-$i" --output-dir "$work/runs/silu-$a-$i" --mutate silu_slope
      done ;;
    nocheck)
      for i in $(seq 1 "${b:-1}"); do
        EXTRA_LINES="layer_check: false" row "$a" "nocheck-$a-$i" --output-dir "$work/runs/nocheck-$a-$i"
      done ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
pack
