#!/usr/bin/env bash
# The golden gate on the GPU canary (issue 20), one layout per call of the lent H200s:
#   the layout's pair as shipped (vLLM's own Triton kernel, the incumbent, then the bundled Triton kernel,
#   which makes the golden reference when the cache has none), then the same pair with each mutation of
#   MUTATIONS: the vLLM row carries over from the unmutated run (`--resume` keeps it: it is never mutated),
#   the bundled row runs mutated.
# Results (every config's results.json, logprobs, logs) are packed into $OUT/<layout>.tar.xz, the golden
# cache into $OUT/goldens.tar.xz; a .goldens/ folder in the checkout (carried) seeds the cache, and
# SHIPPED=<carried run folder> takes the shipped pair from an earlier call (rows deleted from it run again,
# unmutated) before the mutations.
#
#   bash benchmarks/device/canary_mutations.sh tp|tep|dep      (from the checkout; the kit in .vgpu/)
# WITH_FI=1 (tp only) adds the FlashInfer CUTLASS row to the pair, shipped and mutated; it needs FlashInfer
# with its BF16 module in .fi-site/ on this machine (benchmarks/device/kernel_bench.sh STAGES="fi-build", an
# earlier call on the same warm machine), which the servers then import (EXTRA_PYTHONPATH of the kit).
# ROWS (words of config file names) narrows the list to those rows and vLLM's.
set -u
layout="${1:?usage: canary_mutations.sh tp|tep|dep}"
MUTATIONS="${MUTATIONS-scale_one_expert}"  # MUTATIONS="": the shipped rows alone
out="${OUT:-/tmp/golden-out}"; work="/tmp/golden-$layout"
export MOE_EVAL_GOLDEN_CACHE=/tmp/goldens
mkdir -p "$out" "$work" "$MOE_EVAL_GOLDEN_CACHE"
[ -d .goldens ] && cp -r --update=none .goldens/. "$MOE_EVAL_GOLDEN_CACHE"/
pack() {  # after every stage: a call cut short by its time limit still brings back what finished
  # Written under a temporary name, then renamed: a kill mid-pack leaves the last whole archive (seen: a
  # timeout during a re-pack truncated it and lost every results.json).
  tar -C "$work" -cJf "$out/$layout.tar.xz.part" --exclude='*.safetensors' . && mv -f "$out/$layout.tar.xz.part" "$out/$layout.tar.xz"
  tar -C "$MOE_EVAL_GOLDEN_CACHE" -cJf "$out/goldens.tar.xz.part" . && mv -f "$out/goldens.tar.xz.part" "$out/goldens.tar.xz"
}
# A TERM or INT (a `timeout` around this script, a cancelled CI job) goes on to the running moe-eval, which
# tears its servers down and keeps what finished (exit 130); then the archives are packed. Without this,
# bash dies alone and moe-eval runs on unobserved (on the device tool, only the end of the call stops it).
child=0
on_signal() {
  echo "signal: stopping moe-eval (pid $child) and packing what finished" >&2
  if [ "$child" -gt 0 ]; then kill -TERM "$child" 2> /dev/null; wait "$child"; fi
  pack; exit 143
}
trap on_signal TERM INT
moe_eval() {  # device_env.sh execs python, so $child is moe-eval itself
  bash .vgpu/device_env.sh python3 -m moe_eval "$@" & child=$!
  wait "$child"; local rc=$?; child=0; return "$rc"
}
pair=("configs/canary-gpu-$layout/Canary-Qwen3-MoE-BF16-vllm-triton.yaml"
      "configs/canary-gpu-$layout/Canary-Qwen3-MoE-BF16-triton.yaml")
if [ "${WITH_FI:-0}" = 1 ]; then
  [ "$layout" = tp ] || { echo "WITH_FI=1: the FlashInfer canary config is TP1 only (configs/canary-gpu-tp)"; exit 2; }
  source benchmarks/device/fi_site.sh && require_fi_site
  export EXTRA_PYTHONPATH="$PWD/$FI_SITE"
  check_fi_modules
  pair+=("configs/canary-gpu-tp/Canary-Qwen3-MoE-BF16-fi-cutlass.yaml")
fi
# ROWS="fi-cutlass": only configs whose file name holds one of these words (vLLM's incumbent always) run,
# shipped and mutated: a row already measured in the carried SHIPPED folder is not run mutated again.
if [ -n "${ROWS:-}" ]; then
  chosen=("${pair[0]}")
  for c in "${pair[@]:1}"; do for w in $ROWS; do [[ "$(basename "$c")" == *"$w"* ]] && chosen+=("$c") && break; done; done
  pair=("${chosen[@]}")
fi
t0=$(date +%s)
if [ -n "${SHIPPED:-}" ]; then  # the shipped pair's run folder from an earlier call (carried)
  mkdir -p "$work/shipped" && cp -r "$SHIPPED" "$work/shipped/"
  # Rows removed from the carried folder (a row to run again with changed code) run now, unmutated; the
  # rest are kept as they are. A complete folder starts no server.
  moe_eval run --hw h200 --jobs auto --resume "$(ls -d "$work"/shipped/*/ | head -1)" "${pair[@]}" \
    > "$work/shipped.log" 2>&1
  echo "shipped (resumed): exit $? in $(( $(date +%s) - t0 )) s"
  pack
else
  moe_eval run --hw h200 --jobs auto --output-dir "$work/shipped" "${pair[@]}" > "$work/shipped.log" 2>&1
  echo "shipped: exit $? in $(( $(date +%s) - t0 )) s"
  pack
fi
shipped=$(ls -d "$work"/shipped/*/ | head -1)
mutate() {
  local m=$1 t; t=$(date +%s)
  cp -r "$shipped" "$work/mut-$m"
  rm -f "$work/mut-$m/summary.json"  # the shipped run's: the resumed run writes its own
  moe_eval run --hw h200 --jobs auto --resume "$work/mut-$m" --mutate "$m" "${pair[@]}" > "$work/mut-$m.log" 2>&1
  echo "--mutate $m: exit $? in $(( $(date +%s) - t )) s"
  pack
}
# One at a time: .vgpu/device_env.sh reinstalls the checkout into one folder on every call, so two
# invocations at once break each other (seen: a call running two side by side brought nothing back).
for m in $MUTATIONS; do mutate "$m"; done
grep -h "golden_gate" "$work"/*.log | cut -c1-400
pack
echo "total $(( $(date +%s) - t0 )) s"
