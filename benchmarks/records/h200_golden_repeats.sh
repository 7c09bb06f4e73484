#!/usr/bin/env bash
# Issue 20's calibration on ONE GPU (docs/logprob-gate.md): repeated runs of the GPU canary's TP1 pair as
# shipped (vLLM's own Triton kernel, the incumbent; the bundled Triton kernel, golden-gated), and the bundled
# row with another valid tile set. The canary's servers ask 0.3 of the GPU's memory: PARALLEL (<= 3) runs
# share the GPU, each one moe-eval process with --jobs 1.
#   cold: runs 1..PARALLEL, each from empty caches of its own (HOME: vLLM's torch.compile cache, Triton's,
#         moe-eval's models; TORCHINDUCTOR_CACHE_DIR; its own golden cache, so each makes the golden: the
#         goldens' cold-start noise).
#   warm: runs PARALLEL+1..REPEATS on run 1's caches and golden, beside the tile variant: a copy of run 1
#         whose bundled row reruns (`--resume`) with MOE_EVAL_TUNED_DIR = benchmarks/tile_variant.py's file.
# WORK (/tmp/repeats) is laid out as benchmarks/calibrate_golden.sh's (correct-i/, goldens-i/, tile-variant/):
# benchmarks/golden_calibration_table.py reads it. Each run, when it ends, is packed with its log and golden
# cache into $OUT/<run>.tar.xz (under a temporary name, then renamed: a kill mid-pack loses no archive), so a
# call cut short by its time limit still brings back every run that finished.
#
#   serial: the tile variant, then the runs numbered in RERUN, one at a time, on run 1's golden (extract an
#         earlier call's correct-1.tar.xz into /tmp/repeats on a fresh machine).
# Sharing the GPU is this script's, not moe-eval's: two vLLM servers starting at once on one GPU can break
# each other's memory profiling ("Error in memory profiling", "No available memory for the cache blocks";
# seen once in each of cold and warm): such a run exits 3 and says so; rerun it serially.
#
#   bash .vgpu/device_env.sh bash benchmarks/records/h200_golden_repeats.sh cold|warm|serial
#   WITH_FI=1 adds the FlashInfer CUTLASS row to every run (see below); ROWS picks the rows; TILE_VARIANT=0
#   leaves the tile variant out of warm and serial.
set -u
phase="${1:?usage: h200_golden_repeats.sh cold|warm|serial}"
REPEATS="${REPEATS:-5}"; PARALLEL="${PARALLEL:-3}"
work=/tmp/repeats; out="${OUT:-/tmp/repeats-out}"
mkdir -p "$work" "$out"
# ROWS: the canary TP1 configs each run serves (their names less "Canary-Qwen3-MoE-BF16-"); the incumbent
# (vllm-triton) first. ROWS="vllm-triton fi-cutlass" repeats FlashInfer's row alone beside it (its golden then
# made by that row): the bundled Triton row already has its repeated runs.
ROWS="${ROWS:-vllm-triton triton}"
[ "${WITH_FI:-0}" = 1 ] && [[ " $ROWS " != *" fi-cutlass "* ]] && ROWS="$ROWS fi-cutlass"
pair=()
for row in $ROWS; do
  config="configs/canary-gpu-tp/Canary-Qwen3-MoE-BF16-$row.yaml"
  [ -f "$config" ] || { echo "ROWS: no $config"; exit 2; }
  pair+=("$config")
done
# Without configs moe-eval would run the whole h200 list.
[ "${#pair[@]}" -gt 0 ] || { echo "ROWS is empty"; exit 2; }
# The tile variant reruns the bundled Triton row: with no such row it would test nothing.
TILE_VARIANT="${TILE_VARIANT:-1}"
if [ "$TILE_VARIANT" = 1 ] && [[ " $ROWS " != *" triton "* ]]; then
  echo "TILE_VARIANT=1 reruns the bundled Triton row: add triton to ROWS, or set TILE_VARIANT=0"; exit 2
fi
if [[ " $ROWS " == *" fi-cutlass "* ]]; then  # the FlashInfer CUTLASS row (issue 20 asks 5 runs of it)
  # FlashInfer and its BF16 module come from an earlier call on this warm machine (benchmarks/device/kernel_bench.sh
  # STAGES=fi-build, .fi-site/); device_env.sh has set PYTHONPATH already, so .fi-site/ joins it here.
  source benchmarks/device/fi_site.sh && require_fi_site
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/$FI_SITE"
fi
run() {  # run NAME HOME GOLDENS [moe-eval run options...]
  local name=$1 home=$2 goldens=$3 t rc; shift 3; t=$(date +%s)
  mkdir -p "$home"
  HOME="$home" TORCHINDUCTOR_CACHE_DIR="$home/inductor" MOE_EVAL_GOLDEN_CACHE="$goldens" \
    python3 -m moe_eval run --hw h200 --jobs 1 "$@" > "$work/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc in $(( $(date +%s) - t )) s" | tee -a "$work/$name.log"
  tar -C "$work" -cJf "$out/$name.tar.xz.part" --exclude='*.safetensors' "$name" "$name.log" "${goldens#"$work"/}" \
    && mv -f "$out/$name.tar.xz.part" "$out/$name.tar.xz"
}
t0=$(date +%s)
case "$phase" in
  cold)
    for i in $(seq 1 "$PARALLEL"); do
      run "correct-$i" "$work/home-$i" "$work/goldens-$i" --output-dir "$work/correct-$i" "${pair[@]}" &
      sleep 20  # staggered: three torch.compile warm-ups at once share 16 cores
    done
    wait ;;
  warm|serial)
    first=$(ls -d "$work"/correct-1/*/ 2>/dev/null | head -1)
    [ -n "$first" ] || { echo "$phase: no $work/correct-1 (run the cold phase first, or extract it there)"; exit 2; }
    if [ "$phase" = warm ]; then
      for i in $(seq $((PARALLEL + 1)) "$REPEATS"); do
        run "correct-$i" "$work/home-1" "$work/goldens-1" --output-dir "$work/correct-$i" "${pair[@]}" &
      done
    fi
    if [ "$TILE_VARIANT" = 1 ]; then  # TILE_VARIANT=0: the repeats alone
      python3 benchmarks/tile_variant.py "$work/tiles" --experts 8 --F 128 --D 256 --top-k 2
      mkdir -p "$work/tile-variant" && cp -r "$first" "$work/tile-variant/" && cp -r "$work/tiles" "$work/tile-variant/"
      resumed=$(ls -d "$work"/tile-variant/*/ | head -1)
      rm -f "$resumed/summary.json"  # run 1's: the resumed run writes its own
      rm -f "$resumed"/canary-gpu-tp/Canary-Qwen3-MoE-BF16-triton/results.json  # the bundled row reruns; vLLM's row stays
      MOE_EVAL_TUNED_DIR="$work/tiles" run tile-variant "$work/home-1" "$work/goldens-1" --resume "$resumed" "${pair[@]}"
    fi
    # serial: one server on the GPU at a time (two starting at once broke vLLM's memory profiling: seen in warm
    # and cold), then the runs of RERUN (run numbers) on run 1's golden.
    for i in ${RERUN:-}; do
      run "correct-$i" "$work/home-1" "$work/goldens-1" --output-dir "$work/correct-$i" "${pair[@]}"
    done
    wait ;;
esac
grep -h "golden_gate\|exit" "$work"/*.log | cut -c1-300 | tail -40
echo "$phase total $(( $(date +%s) - t0 )) s"
