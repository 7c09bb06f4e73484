#!/usr/bin/env bash
# Issue 56 on one lent H100 or H200: the bundled kernel against the one-launch read (decode) and the vendor
# grouped GEMMs (prefill), vLLM's Triton and FlashInfer CUTLASS interleaved in the same replays.
#   STAGES="tests decode"   the GPU tests of the decode launches (pdl on naive and aligned calls: the bits of
#                           the plain launches, eager and from a CUDA graph; the same tokens in another order;
#                           bitwise repeatable), then the decode table: M = 1, 8, 40 at the seven shipped
#                           per-rank shapes, the shipped plan, its variants (DECODE_PEERS), both peers and the
#                           read bounds; the verdict is bench_fused_moe.read_tables' (within 1.10x of the read)
#   STAGES="prefill"        M = 1024, 4096, 16384: the shipped plan, both peers and torch's grouped GEMMs alone;
#                           with PREFILL_GEMMS=1 (the default) the bundled call's GEMMs alone too (`triton:gemms`),
#                           so the report splits a cell's gap between the GEMMs and the rest of the call
#   STAGES="tune ..."       first: the tuner at M = 8 and 40 (TUNE_M) of every shape on this GPU, merged into
#                           the files the later stages read (tuned.tgz comes back); KEEP_TUNED=1 in a later
#                           call on the warm machine keeps them; TUNE_SHAPES="Qwen3-30B-A3B TP2 ..." tunes those only.
#                           A prefill tuning: TUNE_M=1024,4096,16384 and PREFILL_PEERS="triton_package triton_default"
#                           (the package's own tiles for this GPU beside the fresh ones, in the same replays)
# Chained calls reuse the Triton cache and FlashInfer's site while the machine is warm.
#
# Usage (repo root on the device; carried: .vllm-peer/ from benchmarks/extract_vllm_moe_peer.py, .fi-lite/
# from benchmarks/fi_module_cpu.sh; without them the peer is left out and the table says so):
#   OUT=/some/dir STAGES="tests decode" bash benchmarks/device/limit_bench.sh
# Tiles: the package's files for this GPU; where a shape has none (an H100: every shape but Qwen3-30B-A3B
# TP1 before 2026-12-07), the H200's file under this GPU's name (MOE_EVAL_TUNED_DIR), so tiles of the package are timed,
# and env.txt lists which files were borrowed so. Budgets (s): TESTS_TIMEOUT (150), DECODE_TIMEOUT (300),
# PREFILL_TIMEOUT (330). Results in $OUT: decode.md, prefill.md, *_rows.jsonl, logs.tgz.
set -u
OUT="${OUT:?set OUT}"
STAGES="${STAGES:?set STAGES}"
RUN="$PWD/.limit-run"
mkdir -p "$RUN/logs" "$RUN/tuned" "$OUT"
source benchmarks/device/fi_site.sh
export PYTHONPATH="$PWD/$FI_SITE:$PWD" PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="$RUN/triton-cache" FLASHINFER_WORKSPACE_BASE="$RUN/fi-ws"
T0=$(date +%s)
stage() { echo "== $1 at +$(( $(date +%s) - T0 )) s ($(date -u +%T))" | tee -a "$RUN/logs/stages.txt" >&2; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

SHAPES=("Qwen3-30B-A3B TP2" "Qwen3-30B-A3B TEP2" "Qwen3-30B-A3B TP1" "Llama-4-Scout TP2" "Llama-4-Scout TEP2"
        "Mixtral-8x7B TP2" "Mixtral-8x7B TEP2")
# BENCH_SHAPES="Qwen3-30B-A3B TP2,Qwen3-30B-A3B TP1": those only (comma-separated), in that order.
[[ -n "${BENCH_SHAPES:-}" ]] && IFS=, read -r -a SHAPES <<< "$BENCH_SHAPES"
PEERS=()
[[ -f .vllm-peer/MANIFEST.json ]] && PEERS+=(vllm_triton)
place_fi_lite > "$RUN/logs/fi_site.txt" 2>&1 && [[ -f "$FI_AOT_DIR/fused_moe_90.so" ]] && PEERS+=(flashinfer_cutlass)

stage "env ($STAGES)"
GPU_FILE_NAME=$(python3 -c 'import torch; print(torch.cuda.get_device_name().replace(" ", "_"))')
# A chained call keeps what an earlier "tune" wrote here (KEEP_TUNED=1).
[[ "${KEEP_TUNED:-0}" == 1 ]] || rm -f "$RUN/tuned"/*.json
for f in moe_eval/kernels/tuned_configs/*device=NVIDIA_H200.json; do
  own="${f/device=NVIDIA_H200.json/device=$GPU_FILE_NAME.json}"
  [[ -f "$own" || -f "$RUN/tuned/$(basename "$own")" ]] || cp "$f" "$RUN/tuned/$(basename "$own")"
done
export MOE_EVAL_TUNED_DIR="$RUN/tuned"
{
  date -u
  nvidia-smi --query-gpu=name,uuid,driver_version,power.limit,clocks.max.sm,temperature.gpu --format=csv
  python3 -c 'import sys, torch, triton
from moe_eval.kernels.fused_moe import pdl_available
print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name())
print("PDL:", pdl_available(torch.device("cuda")))'
  git log --oneline -1 2> /dev/null; git status --short | head -5
  echo "peers beside the bundled kernel: ${PEERS[*]:-none}"; cat "$RUN/logs/fi_site.txt"
  echo "H200 tiles borrowed under this GPU's name: $(ls "$RUN/tuned" | tr '\n' ' ')"
} 2>&1 | tee "$RUN/logs/env_${STAGES// /_}.txt"

if has tune; then
  # The decode sizes where the aligned tiles decide (M = 8, 40) tuned on this GPU, merged into the files above
  # (the package's own files for this GPU join them first, so a merge keeps their other entries). The tuner
  # writes no pdl: the decode stage's triton_pdl / triton_nopdl say where it pays.
  for f in moe_eval/kernels/tuned_configs/*device=$GPU_FILE_NAME.json; do [[ -f "$f" ]] && cp "$f" "$RUN/tuned/"; done
  stage tune
  CELLS=(); for s in "${SHAPES[@]}"; do [[ -z "${TUNE_SHAPES:-}" || "$TUNE_SHAPES" == *"$s"* ]] && CELLS+=("$s:${TUNE_M:-8,40}"); done
  timeout "${TUNE_TIMEOUT:-330}" python3 benchmarks/tune_fused_moe.py --merge --out-dir "$RUN/tuned" \
    --workers 16 --precompile-timeout-s 120 --deadline-s "${TUNE_DEADLINE:-270}" --cells "${CELLS[@]}" \
    > "$RUN/logs/tune.txt" 2>&1
  echo "tune rc=$?" | tee -a "$RUN/logs/stages.txt"
  grep -E "^[A-Z].* M=[0-9]+:|precompil|compile failed|REJECTED|deadline|Error" "$RUN/logs/tune.txt" | cut -c1-250 | tail -30
  tar -C "$RUN" -czf "$OUT/tuned.tgz" tuned  # file names with '=' and ',' do not come back alone
fi

if has tests; then
  stage tests
  XDIST=(); python3 -c "import xdist" 2> /dev/null && XDIST=(-n 4)
  MOE_EVAL_CORRECTNESS_LOG="$RUN/logs/correctness.jsonl" timeout "${TESTS_TIMEOUT:-150}" \
    python3 -m pytest -q -p no:cacheprovider -W ignore::RuntimeWarning "${XDIST[@]}" tests/kernels/test_fused_moe.py \
    -k "pdl or same_tokens or repeatable or deterministic or sum_in_gemm2" > "$RUN/logs/tests.txt" 2>&1
  echo "tests rc=$? (124 = timed out): $(tail -1 "$RUN/logs/tests.txt")" | tee -a "$RUN/logs/stages.txt"
  grep -E "^(FAILED|ERROR)" "$RUN/logs/tests.txt" | head -20
fi

bench() {  # name, timeout, then bench_fused_moe.py's arguments
  local name=$1 limit=$2; shift 2
  stage "$name"
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 250 \
    > "$RUN/logs/clocks_$name.csv" 2>&1 &
  local smi=$!
  timeout "$limit" python3 benchmarks/bench_fused_moe.py --out-dir "$RUN/$name" --shapes "${SHAPES[@]}" \
    --no-gemms-alone --skip-eager --skip-alignment --precompile-workers 12 --deadline-s $((limit - 40)) "$@" \
    2> "$RUN/logs/${name}_stderr.txt" > "$RUN/logs/${name}_stdout.txt"
  echo "$name rc=$? (1: a target missed or a result wrong; 124: timed out)" | tee -a "$RUN/logs/stages.txt"
  kill "$smi" 2> /dev/null
  grep -E "WRONG|not timed|deadline|Error" "$RUN/logs/${name}_stderr.txt" | cut -c1-300 | tail -20
  [[ -s "$RUN/$name/rows.jsonl" ]] && cp "$RUN/$name/rows.jsonl" "$OUT/${name}_rows.jsonl"
}

if has decode; then
  # shellcheck disable=SC2086
  bench decode "${DECODE_TIMEOUT:-300}" --m ${DECODE_M:-1 8 40} --replays 20 --repeats 3 --decode-targets \
    --peers triton ${DECODE_PEERS:-triton_pdl triton_nopdl triton_naive_forced triton_gemv_pdl triton_default} "${PEERS[@]}" \
    --bounds weights_read weights_read_c4k weights_read_c64k
  [[ -s "$OUT/decode_rows.jsonl" ]] && python3 benchmarks/bench_fused_moe.py --out-dir "$RUN/decode" \
    --report-only "$OUT/decode_rows.jsonl" --decode-targets > "$OUT/decode.md" 2>&1
fi

if has prefill; then
  # shellcheck disable=SC2086
  bench prefill "${PREFILL_TIMEOUT:-330}" --m 1024 4096 16384 --replays 10 --repeats 3 --prefill-targets \
    --peers triton ${PREFILL_PEERS-triton_default} "${PEERS[@]}" --bounds grouped_mm_gemms \
    $([[ "${PREFILL_GEMMS:-1}" == 1 ]] && echo --gemms-alone)
  [[ -s "$OUT/prefill_rows.jsonl" ]] && python3 benchmarks/bench_fused_moe.py --out-dir "$RUN/prefill" \
    --report-only "$OUT/prefill_rows.jsonl" --prefill-targets > "$OUT/prefill.md" 2>&1
fi

stage pack
tar -C "$RUN" -czf "$OUT/logs_${STAGES// /_}.tgz" logs
cat "$OUT/decode.md" "$OUT/prefill.md" 2> /dev/null | grep -v "^$" | tail -80
