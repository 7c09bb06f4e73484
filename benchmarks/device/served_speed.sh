#!/usr/bin/env bash
# Issue 42 on the lent H200: the served MoE calls' time per dispatch range, the speed gate, the eval's concurrency.
#   STAGE=probe      the timer's stamp kernels compile and time a sleep on this GPU (seconds; no kit needed)
#   STAGE=shipped    the GPU canary TP1 list (ROWS of: vllm = vLLM's Triton, bundled = the bundled Triton,
#                    fi = FlashInfer CUTLASS; default "vllm bundled", and fi with WITH_FI=1), LIMIT questions,
#                    one run into each name of RUN_NAME (default shipped; "fi-2 fi-3": two repeated runs, one
#                    after the other): every row timed, the bundled rows gated on speed against vLLM's row
#   STAGE=mutations  each of MUTATIONS on the bundled Triton row alone, with --baseline the shipped run (the
#                    same config before the change): each must fail by speed_gate alone
#   STAGE=twin       the Qwen3-30B-A3B twin's CUDA-graph pair (vLLM's Triton, bundled Triton; needs .gsm8k/), then
#                    the kernel benchmark at that shape (Qwen3-30B-A3B TP1) at the M the sweep serves, the bundled
#                    kernel and the installed vLLM's fused_experts interleaved: the served times beside it
#                    (BENCH=0: the pair alone; NOCHECK=1: a third row, the bundled one with layer_check false,
#                    to see what end-to-end time the paused layer check still costs)
#   STAGE=power      issue 54: the speed gate's evidence and power, per call size. MODEL=canary (the GPU canary
#                    TP1) or twin (Qwen3-30B-A3B, CUDA graphs; needs .gsm8k/), speed-only copies of its pair
#                    (no golden, texts or layer check; LIMIT questions): vLLM's row and the bundled row, then
#                    REPEATS more bundled rows and each of MUTATIONS (default "slow_range:range=all,pct=5,
#                    eager_pct=10": every range slowed at once, each judged on its own calls) with --baseline
#                    the pair's run, so each is judged against its own earlier run (and, by the tests,
#                    against vLLM's row). SPIN=1 first checks the slowdown's spin and the eager calls' gate
#                    on this GPU; GPU_TESTS=1 then the kernels' determinism tests; ALTERNATE_CLOCKS=1 runs
#                    every second repeat without the SM clock's sampling. $OUT/power-<MODEL>.json:
#                    every row slimmed (benchmarks/speed_table.py), for docs/data.
#   STAGE=concurrency  benchmarks/eval_concurrency.py on CONCURRENCY_ROWS (default "canary-vllm canary-bundled
#                    twin"): the canary's rows at CANARY_C, 200 questions; the twin's bundled row at TWIN_C,
#                    TWIN_Q GSM8K questions: seconds, tokens/s, answers changed, the paired gate per concurrency
# Results: $OUT/<stage>.tar.xz (results.json, logs, timing files; no weights), $OUT/<stage>.txt (the tables).
# Usage (repo root on the device; carried: .vgpu/, and for WITH_FI=1 .fi-lite/ from benchmarks/fi_module_cpu.sh,
# built with no GPU, or .fi-site/ left by kernel_bench.sh STAGES=fi-build on this warm machine):
#   OUT=... STAGE=shipped WITH_FI=1 LIMIT=100 bash benchmarks/device/served_speed.sh
#   OUT=... STAGE=shipped WITH_FI=1 ROWS="vllm fi" RUN_NAME="fi-2 fi-3" bash benchmarks/device/served_speed.sh
#   OUT=... STAGE=concurrency CONCURRENCY_ROWS=twin bash benchmarks/device/served_speed.sh
set -u
out="${OUT:-/tmp/speed-out}"; work=/tmp/speed; mkdir -p "$out" "$work"
stage="${STAGE:?set STAGE}"; limit="${LIMIT:-100}"
export MOE_EVAL_GOLDEN_CACHE=/tmp/goldens; mkdir -p "$MOE_EVAL_GOLDEN_CACHE"
tp=configs/canary-gpu-tp
declare -A canary_row=([vllm]=vllm-triton [bundled]=triton [fi]=fi-cutlass)
default_rows="vllm bundled"
if [ "${WITH_FI:-0}" = 1 ]; then
  source benchmarks/device/fi_site.sh && require_fi_site
  export EXTRA_PYTHONPATH="$PWD/$FI_SITE"
  check_fi_modules
  default_rows+=" fi"
fi
rows=()
for name in ${ROWS:-$default_rows}; do
  [ -n "${canary_row[$name]:-}" ] || { echo "ROWS: no row named '$name' (vllm, bundled, fi)"; exit 2; }
  if [ "$name" = "fi" ] && [ "${WITH_FI:-0}" != 1 ]; then echo "ROWS: fi needs WITH_FI=1"; exit 2; fi
  rows+=("$tp/Canary-Qwen3-MoE-BF16-${canary_row[$name]}.yaml")
done
# No configs would make moe-eval run the whole H200 list: never on a blank ROWS.
[ "${#rows[@]}" -gt 0 ] || { echo "ROWS: no row named (vllm, bundled, fi)"; exit 2; }
pack() {  # written under a temporary name, then renamed: a kill mid-pack leaves the last whole archive
  tar -C "$work" -cJf "$out/$stage.tar.xz.part" --exclude='*.safetensors' --exclude='triton-cache' . \
    && mv -f "$out/$stage.tar.xz.part" "$out/$stage.tar.xz"
}
child=0
on_signal() {
  if [ "$child" -gt 0 ]; then kill -TERM "$child" 2> /dev/null; wait "$child"; fi
  pack; exit 143
}
trap on_signal TERM INT
moe_eval() {
  bash .vgpu/device_env.sh python3 -m moe_eval "$@" & child=$!
  wait "$child"; local rc=$?; child=0; return "$rc"
}
moe_eval_bench() {
  bash .vgpu/device_env.sh python3 "$@" & child=$!
  wait "$child"; local rc=$?; child=0; return "$rc"
}
t0=$(date +%s)
case "$stage" in
  probe)
    python3 - <<'PY' 2>&1 | tee "$out/probe.txt"
import time, torch
from moe_eval.kernels.moe_timer import MoeTimer
t = MoeTimer("probe", None, "probe")
t.attach_device(torch.device("cuda"))
print("timed_on", t.snapshot()["timed_on"], "problem", t.device_problem)
x = torch.zeros(3, 8, device="cuda")
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    for _ in range(2):
        st = t.start(x); torch.cuda._sleep(2_000_000); t.stop(st, x)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        st = t.start(x); torch.cuda._sleep(2_000_000); t.stop(st, x)
for _ in range(100):
    g.replay()
torch.cuda.synchronize()
row = t.snapshot()["table"][1]
print("M=2-16 after 2 eager + 100 replays:", row, "mean us", row[1] / row[0] / 1e3)
calls, ns, replayed, replayed_ns = row[0], row[1], row[4], row[5]  # core/moe_timing.FIELDS
# 100 of 102 calls of ~1 ms replayed: ~98 % of the time (the host's launch gaps are small beside a 1 ms sleep)
ok = (calls, replayed) == (102, 100) and 0.95 * ns < replayed_ns < ns
print("replayed", replayed, "of", calls, "calls,", replayed_ns / ns, "of the time:", "OK" if ok else "WRONG")
raise SystemExit(0 if ok else 1)
PY
    echo "probe: exit ${PIPESTATUS[0]}" | tee -a "$out/probe.txt"
    ;;
  shipped)
    for run in ${RUN_NAME:-shipped}; do
      t=$(date +%s)
      moe_eval run --hw h200 --limit "$limit" --output-dir "$work/$run" "${rows[@]}" > "$work/$run.log" 2>&1
      echo "$run: exit $? in $(( $(date +%s) - t )) s" | tee -a "$out/$stage.txt"
      tail -40 "$work/$run.log" >> "$out/$stage.txt"
      pack
    done
    ;;
  twin)
    cg=configs/twins-cuda-graph
    pair=("$cg/Qwen3-30B-A3B-BF16-vllm.yaml" "$cg/Qwen3-30B-A3B-BF16-triton.yaml")
    if [ "${NOCHECK:-0}" = 1 ]; then  # the bundled row again without the layer check, gated against vLLM's
      nocheck="$work/nocheck/Qwen3-30B-A3B-BF16-triton-nocheck.yaml"; mkdir -p "$work/nocheck"
      sed "s|^baseline_config: .*|baseline_config: $PWD/$cg/Qwen3-30B-A3B-BF16-vllm.yaml|" "${pair[1]}" > "$nocheck"
      echo "layer_check: false" >> "$nocheck"
      pair+=("$nocheck")
    fi
    moe_eval run --hw h200 --gsm8k-dir .gsm8k --output-dir "$work/twin" "${pair[@]}" > "$work/twin.log" 2>&1
    echo "twin pair: exit $? in $(( $(date +%s) - t0 )) s" | tee -a "$out/$stage.txt"
    tail -30 "$work/twin.log" >> "$out/$stage.txt"
    pack
    if [ "${BENCH:-1}" != 1 ]; then
      echo "kernel bench: skipped (BENCH=0)" | tee -a "$out/$stage.txt"
    else
      t=$(date +%s)
      VLLM_PEER_INSTALLED=1 PYTHONUNBUFFERED=1 timeout "${BENCH_TIMEOUT:-240}" bash .vgpu/device_env.sh python3 \
        benchmarks/bench_fused_moe.py --out-dir "$work/bench" --shapes "Qwen3-30B-A3B TP1" \
        --m ${BENCH_M:-1 8 40 100 600 1500 8192} --peers triton vllm_installed --skip-alignment --skip-eager \
        --no-gemms-alone --repeats 3 > "$work/bench.log" 2>&1
      echo "kernel bench: exit $? in $(( $(date +%s) - t )) s" | tee -a "$out/$stage.txt"
      tail -30 "$work/bench.log" >> "$out/$stage.txt"
    fi
    ;;
  power)
    if [ "${SPIN:-0}" = 1 ]; then
      bash .vgpu/device_env.sh python3 benchmarks/device/slowdown_probe.py 2>&1 | tee "$out/spin.txt"
    fi
    if [ "${GPU_TESTS:-0}" = 1 ]; then
      timeout 240 bash .vgpu/device_env.sh python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused_moe.py \
        -k "another_order or bitwise_repeatable" 2>&1 | tail -15 | tee "$out/gpu-tests.txt"
      echo "gpu tests: exit ${PIPESTATUS[0]}" | tee -a "$out/gpu-tests.txt"
    fi
    case "${MODEL:-canary}" in
      canary) src=$tp; v=Canary-Qwen3-MoE-BF16-vllm-triton; b=Canary-Qwen3-MoE-BF16-triton; data=() ;;
      twin) src=configs/twins-cuda-graph; v=Qwen3-30B-A3B-BF16-vllm; b=Qwen3-30B-A3B-BF16-triton
            data=(--gsm8k-dir .gsm8k) ;;
      *) echo "MODEL: canary or twin"; exit 2 ;;
    esac
    lite="$work/${MODEL:-canary}-lite/$(basename "$src")"; mkdir -p "$lite"
    for name in $v $b; do  # the speed measurement alone: the other gates' work left out (last key wins)
      { cat "$src/$name.yaml"; printf '\ngolden: false\nlogprob_texts: 0\ndecode_texts: 0\nlayer_check: false\n'; } \
        > "$lite/$name.yaml"
    done
    pairdir="$work/${MODEL:-canary}-pair"
    t=$(date +%s)
    moe_eval run --hw h200 --limit "${LIMIT:-20}" "${data[@]}" --output-dir "$pairdir" "$lite/$v.yaml" "$lite/$b.yaml" \
      > "$pairdir.log" 2>&1
    echo "pair: exit $? in $(( $(date +%s) - t )) s" | tee -a "$out/$stage.txt"
    grep -E "speed_gate|PASS|FAIL" "$pairdir.log" | cut -c1-600 >> "$out/$stage.txt"
    pack
    base=$(ls -d "$pairdir"/*/ | tail -1)
    runs=()
    # ALTERNATE_CLOCKS=1: every second repeat without the SM clock's sampling (an nvidia-smi that refuses
    # --loop-ms first on its PATH; its other queries pass through), to see whether the polling moves the calls.
    # Only where a real nvidia-smi exists: a wrapper calling itself by name would never return.
    noclock_bin="$work/noclock-bin"; real_smi=$(command -v nvidia-smi || true)
    if [ "${ALTERNATE_CLOCKS:-0}" = 1 ]; then
      [ -n "$real_smi" ] || { echo "ALTERNATE_CLOCKS=1: no nvidia-smi on PATH"; exit 2; }
      mkdir -p "$noclock_bin"
      { echo '#!/bin/sh'
        echo 'case " $* " in *--loop-ms*) echo "clock sampling off for this row" >&2; exit 3;; esac'
        printf 'exec %q "$@"\n' "$real_smi"; } > "$noclock_bin/nvidia-smi"
      chmod +x "$noclock_bin/nvidia-smi"
    fi
    for i in $(seq 1 "${REPEATS:-1}"); do
      if [ "${ALTERNATE_CLOCKS:-0}" = 1 ] && [ $((i % 2)) = 0 ]; then
        runs+=("repeat${i}noclock:")
      else
        runs+=("repeat$i:")
      fi
    done
    for m in ${MUTATIONS-slow_range:range=all,pct=5,eager_pct=10}; do runs+=("mut:$m"); done
    for entry in "${runs[@]}"; do
      name=${entry%%:*}; m=${entry#*:}; t=$(date +%s)
      [ "$name" = mut ] && name="mut-$(echo "$m" | tr -c 'A-Za-z0-9.-' '_')"
      path="$PATH"; [[ "$name" == *noclock ]] && path="$noclock_bin:$PATH"
      PATH="$path" moe_eval run --hw h200 --limit "${LIMIT:-20}" "${data[@]}" --baseline "$base" \
        ${m:+--mutate "$m"} --output-dir "$work/${MODEL:-canary}-$name" "$lite/$b.yaml" > "$work/${MODEL:-canary}-$name.log" 2>&1
      echo "$name ${m:-}: exit $? in $(( $(date +%s) - t )) s" | tee -a "$out/$stage.txt"
      grep -E "speed_gate" "$work/${MODEL:-canary}-$name.log" | cut -c1-600 >> "$out/$stage.txt"
      pack
      # every finished row so far, slimmed: what a kill at the next row leaves is still whole
      mapfile -t done_runs < <(ls -d "$pairdir"/*/ "$work/${MODEL:-canary}"-repeat*/*/ "$work/${MODEL:-canary}"-mut*/*/ \
        2> /dev/null)
      bash .vgpu/device_env.sh python3 benchmarks/speed_table.py "${done_runs[@]}" \
        --slim "$out/power-${MODEL:-canary}.json" > "$out/power-${MODEL:-canary}-table.md" 2>&1
    done
    ;;
  concurrency)
    declare -A study=(
      [canary-vllm]="$tp/Canary-Qwen3-MoE-BF16-vllm-triton.yaml:${CANARY_C:-16 64 200}:200"
      [canary-bundled]="$tp/Canary-Qwen3-MoE-BF16-triton.yaml:${CANARY_C:-16 64 200}:200"
      [twin]="configs/twins-cuda-graph/Qwen3-30B-A3B-BF16-triton.yaml:${TWIN_C:-16 64 256}:${TWIN_Q:-512}"
    )
    keys="${CONCURRENCY_ROWS:-canary-vllm canary-bundled twin}"
    for key in $keys; do  # every name known before the first server starts
      [ -n "${study[$key]:-}" ] || { echo "CONCURRENCY_ROWS: no row named '$key' (${!study[*]})"; exit 2; }
    done
    for key in $keys; do
      IFS=: read -r config cs q <<< "${study[$key]}"; name=$(basename "$config" .yaml); t=$(date +%s)
      # shellcheck disable=SC2086
      PYTHONUNBUFFERED=1 moe_eval_bench benchmarks/eval_concurrency.py "$config" --hw h200 --gsm8k-dir .gsm8k \
        --concurrency $cs --limit "$q" --out "$work/concurrency/$name.json" > "$work/concurrency-$name.log" 2>&1
      echo "$name: exit $? in $(( $(date +%s) - t )) s" | tee -a "$out/$stage.txt"
      tail -8 "$work/concurrency-$name.log" >> "$out/$stage.txt"
      pack
    done
    ;;
  mutations)
    shipped=$(ls -d "$work"/shipped/*/ | tail -1)  # the newest shipped run
    for m in ${MUTATIONS:-extra_weight_copy small_batch_bypassed poor_tiles}; do
      t=$(date +%s)
      moe_eval run --hw h200 --limit "$limit" --baseline "$shipped" --mutate "$m" \
        --output-dir "$work/mut-$m" "$tp/Canary-Qwen3-MoE-BF16-triton.yaml" > "$work/mut-$m.log" 2>&1
      echo "--mutate $m: exit $? in $(( $(date +%s) - t )) s" | tee -a "$out/$stage.txt"
      grep -E "speed_gate|FAIL|PASS" "$work/mut-$m.log" | cut -c1-400 >> "$out/$stage.txt"
      pack
    done
    ;;
esac
pack
echo "total $(( $(date +%s) - t0 )) s"
# The device tool returns at most 8 files from $OUT (its README, Limits): past that, which come back is not
# ours to choose (2026-12-06: a twin run's slim JSON stayed behind). Say so while the machine is still warm.
files=$(find "$out" -type f | wc -l)
if [ "$files" -gt 8 ]; then
  echo "served_speed: $files files under $out; the device tool returns 8: copy what you need elsewhere" >&2
fi
