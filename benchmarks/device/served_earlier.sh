#!/usr/bin/env bash
# Issue 56's served item on one lent GPU: the Qwen3-30B-A3B CUDA-graph twin served by the bundled kernel as it
# is now, judged by every gate and by the speed gate per range against the same kernel as it was (e49cc3c).
#   STAGE=earlier  the twin's pair (vLLM's Triton, the bundled Triton) with this GPU's tuned files set aside for
#                  the run: on an H100 that is e49cc3c's kernel (it had no H100 file: the default heuristic,
#                  no pdl on aligned calls; its kernel code since only added that pdl, off unless a file asks)
#   STAGE=now      the bundled row alone with `--baseline` the earlier run: its golden, texts and layer check
#                  against that row, the speed gate per range against that row's calls
# Runs are kept in .limit-run/served/ (ignored: a chained call on the warm machine finds them; on a fresh one,
# carry .limit-run/served). The golden cache goes with them. Results: $OUT/served-<stage>.tar.xz (results,
# logs, timing; no weights), $OUT/served-<stage>.txt (the run's last lines), $OUT/gpu.txt.
# Usage (repo root on the device; carried: .vgpu, .gsm8k):
#   OUT=... STAGE=earlier bash benchmarks/device/served_earlier.sh
#   OUT=... STAGE=now bash benchmarks/device/served_earlier.sh
set -u
out="${OUT:?set OUT}"; stage="${STAGE:?set STAGE: earlier or now}"
keep="$PWD/.limit-run/served"; mkdir -p "$out" "$keep/goldens"
export MOE_EVAL_GOLDEN_CACHE="$keep/goldens"
unset MOE_EVAL_TUNED_DIR
twin=configs/twins-cuda-graph/Qwen3-30B-A3B-BF16-triton.yaml
nvidia-smi --query-gpu=name,uuid,driver_version,power.limit,clocks.max.sm --format=csv > "$out/gpu.txt"
git log --oneline -1 >> "$out/gpu.txt" 2>&1
gpu_file=$(python3 -c 'import torch; print(torch.cuda.get_device_name().replace(" ", "_"))')
aside="$keep/aside"
restore() { [ -d "$aside" ] && mv "$aside"/*.json moe_eval/kernels/tuned_configs/ 2> /dev/null; rmdir "$aside" 2> /dev/null; }
child=0
on_signal() { [ "$child" -gt 0 ] && kill -TERM "$child" 2> /dev/null && wait "$child"; restore; pack; exit 143; }
pack() {  # temporary name, then rename: a kill mid-pack keeps the last whole archive
  tar -C "$keep" -cJf "$out/served-$stage.tar.xz.part" --exclude='*.safetensors' "$stage" goldens \
    && mv -f "$out/served-$stage.tar.xz.part" "$out/served-$stage.tar.xz"
}
trap on_signal TERM INT
t0=$(date +%s)
case "$stage" in
  earlier)
    rm -rf "$keep/earlier"; mkdir -p "$aside"
    # e49cc3c shipped the H200's files and none for another GPU: elsewhere this GPU's files are newer than it.
    [ "$gpu_file" = NVIDIA_H200 ] || mv moe_eval/kernels/tuned_configs/*"device=$gpu_file.json" "$aside"/ 2> /dev/null
    echo "set aside for the earlier kernel: $(ls "$aside" | wc -l) tuned file(s) of $gpu_file" | tee "$out/served-$stage.txt"
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
bash .vgpu/device_env.sh python3 -m moe_eval run --hw h200 --gsm8k-dir .gsm8k "${args[@]}" \
  > "$keep/$stage.log" 2>&1 &
child=$!; wait "$child"; rc=$?; child=0
restore
echo "served $stage: exit $rc in $(( $(date +%s) - t0 )) s" | tee -a "$out/served-$stage.txt"
mkdir -p "$keep/$stage" && cp "$keep/$stage.log" "$keep/$stage/run.log"
tail -40 "$keep/$stage.log" | cut -c1-400 >> "$out/served-$stage.txt"
pack
tail -25 "$out/served-$stage.txt"
