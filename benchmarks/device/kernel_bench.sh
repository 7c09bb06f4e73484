#!/usr/bin/env bash
# Issue 23 on one lent H200, in chained calls (each while the machine is still warm from the one before,
# so the Triton cache, FlashInfer's install and build and the tuned files under .prefill-run/ are there):
#   STAGES="fi-build"       FlashInfer's BF16 fused_moe_90 (about 430 s of nvcc on 16 cores). Alone: beside
#                           the tuner's precompile it timed out at 530 s (2026-12-01, docs/perf.md)
#   STAGES="tune"           optional: the tuner over PREFILL_CELLS (the package's files are the start)
#   STAGES="tests bench"    GPU tests (the prefill path forced at every shipped shape, the real-shape and
#                           fp32 tests on the tuned files, FlashInfer's correctness tests), then the
#                           interleaved benchmark: bundled vs vLLM's Triton vs FlashInfer CUTLASS at the
#                           per-rank shapes of the shipped configs, M = 1 .. 16384, 3 repeats
# A cold machine works too when the earlier call's files are carried back: fused_moe_90.so in .whl/ (placed
# where FlashInfer loads it with no build) and, after a tune, the tuned files as .prefill-run/tuned/.
#
# Usage (repo root on the device; carried: .whl/ with the two wheels of docs/flashinfer.md,
# .vllm-peer/ from benchmarks/extract_vllm_moe_peer.py):
#   OUT=/some/dir STAGES="fi-build" bash benchmarks/device/kernel_bench.sh
#   OUT=/some/dir STAGES="tests bench" bash benchmarks/device/kernel_bench.sh
# Budgets (seconds, wall): BUILD_TIMEOUT, TUNE_DEADLINE / TUNE_TIMEOUT, TESTS_TIMEOUT,
# BENCH_DEADLINE / BENCH_TIMEOUT. The bench's peers and sizes: DECODE_PEERS (none by default; e.g. "triton_nopdl
# triton_naive_pdl", timed at M <= 16 only), FI_PEER ("" leaves FlashInfer out), BOUNDS, BENCH_M (default: the
# benchmark's M = 1 .. 16384). Results: $OUT/*.txt, $OUT/*.md, $OUT/tuned.tgz, $OUT/results.tgz
# (the run tool does not bring back files whose names hold '=' or ',', such as the tuned files).
set -u
OUT="${OUT:?set OUT}"
STAGES="${STAGES:?set STAGES}"
RUN="$PWD/.prefill-run"
mkdir -p "$RUN/logs" "$RUN/tuned" "$OUT"
source benchmarks/device/fi_site.sh
export PYTHONPATH="$PWD/$FI_SITE:$PWD" PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="$RUN/triton-cache" FLASHINFER_WORKSPACE_BASE="$RUN/fi-ws"
export MOE_EVAL_TUNED_DIR="$RUN/tuned"
# Seeded from the package's files whatever the stages (a shape's file there replaces the package's whole):
# a "tests bench" call on a machine that never ran "tune" read an empty folder and every test of the tuned
# files failed on that, not on the kernel (2026-12-01).
for f in moe_eval/kernels/tuned_configs/*.json; do [[ -f "$RUN/tuned/$(basename "$f")" ]] || cp "$f" "$RUN/tuned/"; done
T0=$(date +%s)
stage() { echo "== $1 at +$(( $(date +%s) - T0 )) s ($(date -u +%T))" | tee -a "$RUN/logs/stages.txt" >&2; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

SHAPES=("Qwen3-30B-A3B TP1" "Mixtral-8x7B TP2" "Qwen3-30B-A3B TEP2" "Llama-4-Scout TP2" "Qwen3-30B-A3B TP2"
        "Mixtral-8x7B TEP2" "Llama-4-Scout TEP2")
# The two shapes new to the tuned files get the whole grid first (the tests want every M); then the
# prefill sizes of the others, the shapes where the bundled kernel trailed first.
PREFILL_CELLS=("Mixtral-8x7B TEP2:1,16,64,256,1024,4096,16384" "Llama-4-Scout TEP2:1,16,64,256,1024,4096,16384"
               "Mixtral-8x7B TP2:1024,4096,16384" "Qwen3-30B-A3B TP1:4096,1024,16384"
               "Llama-4-Scout TP2:4096,1024,16384" "Qwen3-30B-A3B TEP2:1024,4096,16384"
               "Qwen3-30B-A3B TP2:1024,4096,16384" "Mixtral-8x7B TP2:256")

stage "env ($STAGES)"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,temperature.gpu,utilization.gpu --format=csv
  python3 -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name())'
  nproc; (nvcc --version | tail -1) 2>&1
  ls "$RUN" "$RUN/tuned" 2>&1 | tr '\n' ' '; echo
} 2>&1 | tee "$RUN/logs/env_${STAGES// /_}.txt"

# FlashInfer from the carried wheels, once per machine; a carried fused_moe_90.so is placed where
# FlashInfer loads it instead of building.
# A light site (benchmarks/fi_module_cpu.sh: no C++ sources, so no JIT) is replaced by the wheels here.
if ! python3 -c 'import flashinfer.jit, tvm_ffi.libinfo' 2> /dev/null || [[ ! -d "$FI_SITE/flashinfer/data/csrc" ]]; then
  # --upgrade: a folder left half-written by an earlier call is replaced whole (a stale tvm_ffi without
  # `libinfo` broke the build on 2026-12-01).
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target "$FI_SITE" .whl/*.whl \
    || echo "FlashInfer wheels not installed" >&2
  rm -f "$FI_SITE/.from-fi-lite"  # a wheel install now: fi_site.sh unpacks no archive over it
fi
AOT="$FI_AOT_DIR"
if [[ -f .whl/fused_moe_90.so && ! -f "$AOT/fused_moe_90.so" ]]; then
  mkdir -p "$AOT" && cp .whl/fused_moe_90.so "$AOT/"
fi

if has fi-build; then
  stage fi-build
  if [[ -f "$AOT/fused_moe_90.so" ]]; then
    echo "fused_moe_90.so already placed: no build" | tee "$RUN/logs/fi_build.txt"
  else
    MAX_JOBS="${FI_JOBS:-16}" timeout "${BUILD_TIMEOUT:-560}" python3 benchmarks/flashinfer_h200.py \
      --out-dir "$RUN/fi" --skip-timing --skip-correctness > "$RUN/logs/fi_build.txt" 2>&1
    echo "fi-build rc=$?" >> "$RUN/logs/fi_build.txt"
    [[ -f "$RUN/fi/fused_moe_90.so" ]] && mkdir -p "$AOT" && cp "$RUN/fi/fused_moe_90.so" "$AOT/"
    grep -E "build:|rc=|Error" "$RUN/logs/fi_build.txt" | tail -5
  fi
fi

if has tune; then
  stage tune
  timeout "${TUNE_TIMEOUT:-500}" python3 benchmarks/tune_fused_moe.py --merge --out-dir "$RUN/tuned" \
    --workers "${TUNE_WORKERS:-16}" --precompile-timeout-s 150 --deadline-s "${TUNE_DEADLINE:-440}" \
    --cells "${PREFILL_CELLS[@]}" \
    > "$RUN/logs/tune.txt" 2>&1
  echo "tune rc=$?" | tee -a "$RUN/logs/stages.txt"
  grep -E "^[A-Z].* M=[0-9]+:|precompil|compile failed|REJECTED|deadline|Error" "$RUN/logs/tune.txt" | cut -c1-330 | tail -45
fi

if has tests; then
  stage tests
  # 4 processes on the one GPU when pytest-xdist is there (the image has it): most of the time compiles.
  XDIST=(); python3 -c "import xdist" 2> /dev/null && XDIST=(-n 4)
  PYT="python3 -m pytest -q -p no:cacheprovider -W ignore::RuntimeWarning ${XDIST[*]}"
  MOE_EVAL_CORRECTNESS_LOG="$RUN/logs/correctness.jsonl" timeout "${TESTS_TIMEOUT:-150}" $PYT tests/kernels/test_fused_moe.py \
    -k "prefill or persistent or real_shape or fp32 or pdl" \
    > "$RUN/logs/tests_fused_moe.txt" 2>&1; R1=$?
  timeout 90 $PYT tests/kernels/test_flashinfer_cutlass.py tests/kernels/test_tile_configs.py \
    > "$RUN/logs/tests_fi_tiles.txt" 2>&1; R2=$?
  for f in tests_fused_moe tests_fi_tiles; do echo "$f: $(tail -1 "$RUN/logs/$f.txt")"; done | tee "$RUN/logs/tests_summary.txt"
  echo "tests rc: fused_moe=$R1 flashinfer+tiles=$R2 (124 = timed out)" | tee -a "$RUN/logs/tests_summary.txt"
  grep -E "^(FAILED|ERROR)" "$RUN/logs/tests_fused_moe.txt" "$RUN/logs/tests_fi_tiles.txt" | head -20
fi

if has bench; then
  stage bench
  # The SM and memory clocks and the power through the benchmark: the ceilings' context (issue 34).
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 250 \
    > "$RUN/logs/clocks.csv" 2>&1 &
  SMI=$!
  # Beside the three peers, the practical bounds of benchmarks/bounds.py in the same replays.
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/bench_fused_moe.py --out-dir "$RUN/bench" --shapes "${SHAPES[@]}" \
    --peers triton ${DECODE_PEERS:-} vllm_triton ${FI_PEER-flashinfer_cutlass} \
    --bounds ${BOUNDS:-grouped_mm_gemms weights_read} ${BENCH_M:+--m $BENCH_M} \
    --no-gemms-alone --skip-eager --skip-alignment \
    --replays "${BENCH_REPLAYS:-10}" --repeats 3 --precompile-workers 12 --deadline-s "${BENCH_DEADLINE:-290}" \
    --prefill-targets 2> "$RUN/logs/bench_stderr.txt" > "$RUN/logs/bench_stdout.txt"
  echo "bench rc=$? (1: a target missed or a result wrong; 124: timed out)" | tee -a "$RUN/logs/stages.txt"
  kill "$SMI" 2> /dev/null
  grep -E "WRONG|not timed|precompil|tuned .* in" "$RUN/logs/bench_stderr.txt" | cut -c1-300 | tail -20
  if [[ ! -s "$RUN/bench/prefill.md" && -s "$RUN/bench/rows.jsonl" ]]; then  # killed: tables from the saved rows
    python3 benchmarks/bench_fused_moe.py --out-dir "$RUN/bench" --report-only "$RUN/bench/rows.jsonl" \
      --prefill-targets > "$RUN/bench/prefill.md" 2>&1
  fi
fi

stage pack
tar -C "$RUN" -czf "$OUT/tuned.tgz" tuned
cp "$RUN/logs/stages.txt" "$OUT/stages_${STAGES// /_}.txt"
[[ -f "$AOT/fused_moe_90.so" ]] && cp "$AOT/fused_moe_90.so" "$OUT/" && md5sum "$OUT/fused_moe_90.so"
[[ -s "$RUN/bench/prefill.md" ]] && cp "$RUN/bench/prefill.md" "$OUT/"
[[ -s "$RUN/bench/rows.jsonl" ]] && cp "$RUN/bench/rows.jsonl" "$OUT/bench_rows.jsonl"
kept=(logs); for d in bench "fi"; do [[ -d "$RUN/$d" ]] && kept+=("$d"); done
tar -C "$RUN" --exclude triton-cache --exclude fi-ws --exclude tuned -czf "$OUT/results.tgz" "${kept[@]}"
stage "done"
cat "$RUN/bench/prefill.md" 2>/dev/null
