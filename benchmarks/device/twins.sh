#!/usr/bin/env bash
# Shape twins on the lent H200s (issue 21): run some configs of config-gpu-twins.txt with the committed code
# inside CUDA vLLM (the kit in .vgpu/), the twins built on the device (seeded, the same bytes everywhere).
#
#   bash benchmarks/device/twins.sh NAME CONFIG...           (from the checkout)
#
# Needs, carried: .vgpu (the kit), .gsm8k (GSM8K's train/test.jsonl: the twins answer a few questions and score
# 64 texts), optionally .goldens (golden cache of an earlier call) and RESUME=<carried run folder> (continue it).
# Extra `moe-eval run` options in RUN_OPTS (e.g. "--mutate scale_one_expert"). Packs $OUT/NAME.tar.xz (every
# run folder, no weights) and $OUT/goldens.tar.xz after the run, $OUT/NAME-run.log and $OUT/NAME-gpu.txt (the
# device as nvidia-smi names it).
set -u
name="${1:?usage: twins.sh NAME CONFIG...}"; shift
out="${OUT:-/tmp/twins-out}"; work="/tmp/twins-$name"
export MOE_EVAL_GOLDEN_CACHE=/tmp/goldens MOE_EVAL_CACHE=/tmp/moe-eval-cache
mkdir -p "$out" "$work" "$MOE_EVAL_GOLDEN_CACHE"
[ -d .goldens ] && cp -r --update=none .goldens/. "$MOE_EVAL_GOLDEN_CACHE"/
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/$name-gpu.txt"
t0=$(date +%s)
if [ -n "${RESUME:-}" ]; then
  mkdir -p "$work/run" && cp -r "$RESUME" "$work/run/" && target=(--resume "$(ls -d "$work"/run/*/ | head -1)")
else
  target=(--output-dir "$work/run")
fi
# RUN_TIMEOUT (s): SIGTERM the run then, as a CI system cancels a step: moe-eval stops the running config,
# tears its servers down and keeps what finished (exit 130), and this script still packs it.
# shellcheck disable=SC2086
timeout -s TERM "${RUN_TIMEOUT:-100000}" bash .vgpu/device_env.sh python3 -m moe_eval run --hw h200 --jobs auto \
  --gsm8k-dir .gsm8k "${target[@]}" ${RUN_OPTS:-} "$@" > "$work/run.log" 2>&1
echo "exit $? in $(( $(date +%s) - t0 )) s"
sleep 5  # the cancelled run's teardown
tail -40 "$work/run.log"
cp "$work/run.log" "$out/$name-run.log"
# Temporary name, then rename: a call killed mid-pack keeps the last whole archive.
tar -C "$work" -cJf "$out/$name.tar.xz.part" --exclude='*.safetensors' run && mv -f "$out/$name.tar.xz.part" "$out/$name.tar.xz"
tar -C "$MOE_EVAL_GOLDEN_CACHE" -cJf "$out/goldens.tar.xz.part" . && mv -f "$out/goldens.tar.xz.part" "$out/goldens.tar.xz"
