#!/usr/bin/env bash
# Issue 56's served item on one lent GPU: the Qwen3-30B-A3B CUDA-graph twin served by the bundled kernel as it
# is now, judged by every gate and by the speed gate per range against the same kernel as it was.
#   STAGE=earlier  the twin's pair (vLLM's Triton, the bundled Triton) on the earlier revision's tile files: this
#                  GPU's files set aside for the run, EARLIER_TILES's file for this GPU (if it has one) put in
#                  their place; with none there the bundled kernel runs the default heuristic, as it did there
#   STAGE=now      the bundled row alone with `--baseline` the earlier run: its golden, texts and layer check
#                  against that row, the speed gate per range against that row's calls
# "The earlier kernel" is today's kernel code on the earlier revision's tiles. That is the earlier kernel where
# what the code gained since is off unless a file asks for it: between e49cc3c and 2026-12-07 the kernel code
# only added pdl on aligned calls (MoeTileConfig.pdl, off by default), so e49cc3c's kernel is this code on
# e49cc3c's files (it had none for an H100). EARLIER_TILES is a folder holding that revision's files, made here:
#   rm -rf .earlier-tiles && mkdir .earlier-tiles && git archive e49cc3c moe_eval/kernels/tuned_configs \
#     | tar -x --strip-components=3 -C .earlier-tiles
# Runs are kept in .limit-run/served/ (ignored: a chained call on the warm machine finds them; on a fresh one,
# carry .limit-run/served). The golden cache goes with them. Results: $OUT/served-<stage>.tar.xz (results,
# logs, timing; no weights), $OUT/served-<stage>.txt (the run's last lines), $OUT/gpu.txt.
# Usage (repo root on the device; carried: .vgpu, .gsm8k, and for STAGE=earlier .earlier-tiles):
#   OUT=... STAGE=earlier EARLIER_TILES=.earlier-tiles bash benchmarks/device/served_earlier.sh
#   OUT=... STAGE=now bash benchmarks/device/served_earlier.sh
set -u
out="${OUT:?set OUT}"; stage="${STAGE:?set STAGE: earlier or now}"
keep="$PWD/.limit-run/served"; mkdir -p "$out" "$keep/goldens"
export MOE_EVAL_GOLDEN_CACHE="$keep/goldens"
unset MOE_EVAL_TUNED_DIR
twin=configs/twins-cuda-graph/Qwen3-30B-A3B-BF16-triton.yaml
tiles=moe_eval/kernels/tuned_configs
nvidia-smi --query-gpu=name,uuid,driver_version,power.limit,clocks.max.sm --format=csv > "$out/gpu.txt"
gpu_file=$(python3 -c 'import torch; print(torch.cuda.get_device_name().replace(" ", "_"))')
aside="$keep/aside"
restore() {  # this GPU's files back, the earlier ones out (a later stage of this call serves today's)
  [ -d "$aside" ] || return 0
  rm -f "$tiles"/*"device=$gpu_file.json"
  mv "$aside"/*.json "$tiles"/ 2> /dev/null
  rmdir "$aside"
}
pack() {  # temporary name, then rename: a kill mid-pack keeps the last whole archive
  tar -C "$keep" -cJf "$out/served-$stage.tar.xz.part" --exclude='*.safetensors' "$stage" goldens \
    && mv -f "$out/served-$stage.tar.xz.part" "$out/served-$stage.tar.xz"
}
child=0
on_signal() {  # moe-eval stops the running config and tears its servers down on SIGTERM (exit 130)
  if [ "$child" -gt 0 ]; then kill -TERM "$child" 2> /dev/null; wait "$child"; fi
  restore; pack; exit 143
}
trap on_signal TERM INT
# A call killed hard (SIGKILL, the device's time limit) left the files moved: put them back before anything.
restore
t0=$(date +%s)
case "$stage" in
  earlier)
    src="${EARLIER_TILES:?set EARLIER_TILES: a folder of the tuned files of the earlier revision, see the header}"
    [ -d "$src" ] || { echo "EARLIER_TILES=$src: not a folder"; exit 2; }
    rm -rf "$keep/earlier"; mkdir -p "$aside"
    mv "$tiles"/*"device=$gpu_file.json" "$aside"/ 2> /dev/null
    cp "$src"/*"device=$gpu_file.json" "$tiles"/ 2> /dev/null
    {
      echo "today's files of $gpu_file set aside: $(ls "$aside" | wc -l)"
      echo "the earlier revision's files of $gpu_file in their place: $(ls "$src" | grep -c "device=$gpu_file.json")"
    } | tee "$out/served-$stage.txt"
    args=(--output-dir "$keep/earlier" "$twin")  # the config's baseline_config (vLLM's row) joins the run
    ;;
  now)
    base=$(ls -d "$keep"/earlier/*/ 2> /dev/null | tail -1)
    [ -n "$base" ] || { echo "STAGE=now: no earlier run in $keep/earlier (run STAGE=earlier or carry it)"; exit 2; }
    rm -rf "$keep/now"
    args=(--baseline "$base" --output-dir "$keep/now" "$twin")
    ;;
  *) echo "STAGE: earlier or now"; exit 2 ;;
esac
# The kit's launcher execs python: a SIGTERM reaches moe-eval itself, which stops the running config, tears
# its servers down and keeps what finished. RUN_TIMEOUT (s) sends it as a CI system cancels a step, early
# enough that the run's teardown and the pack below fit in the device's per-call limit.
timeout -s TERM "${RUN_TIMEOUT:-540}" bash .vgpu/device_env.sh python3 -m moe_eval run --hw h200 --gsm8k-dir .gsm8k \
  "${args[@]}" > "$keep/$stage.log" 2>&1 &
child=$!; wait "$child"; rc=$?; child=0
restore
echo "served $stage: exit $rc in $(( $(date +%s) - t0 )) s" | tee -a "$out/served-$stage.txt"
mkdir -p "$keep/$stage" && cp "$keep/$stage.log" "$keep/$stage/run.log"
tail -40 "$keep/$stage.log" | cut -c1-400 >> "$out/served-$stage.txt"
pack
tail -25 "$out/served-$stage.txt"
exit "$rc"
