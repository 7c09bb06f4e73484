#!/usr/bin/env bash
# Issue 13 on one lent H200, in one call of at most 8.5 minutes: GPU tests of the new kernel
# variants and of fp32, the tuner on the cells where vLLM won, then the interleaved benchmark
# against vLLM's Triton fused MoE; the ratio tables are printed last.
#
# Usage (repo root on the device, .vllm-peer/ carried: benchmarks/extract_vllm_moe_peer.py writes it):
#   OUT=/some/dir bash benchmarks/records/h200_issue13.sh            # VLLM_PEER_INSTALLED=1: also the installed vLLM
# Assumes python3 with torch 2.11 + triton 3.6, no network. Every stage runs under `timeout`;
# the budget (seconds, wall) is the sum of the *_TIMEOUT values plus a few for setup and packing:
#   smoke 100 (four pytest processes at once: compiling, not running, is what takes the time)
#   tune 220 (its own deadline: no new cell after 185 s; each finished cell is already written)
#   bench 175 (its own deadline: no new (shape, M) after 150 s; rows are saved as they come)
# Results: $OUT/results.tgz (everything), $OUT/ratios.md, $OUT/summary.txt (at most 8 files come back).
set -u
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton-cache-issue13}"
OUT="${OUT:?set OUT}"
WORK="$(mktemp -d /tmp/issue13.XXXXXX)"
mkdir -p "$WORK/logs" "$WORK/bench"
T0=$(date +%s)
stage() { echo "== $1 at +$(( $(date +%s) - T0 )) s ($(date -u +%T))" | tee -a "$WORK/logs/stages.txt" >&2; }

stage env
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,temperature.gpu,utilization.gpu --format=csv
  python3 -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name())'
  python3 -c 'import json; m = json.load(open(".vllm-peer/MANIFEST.json")); print("vllm peer folder:", m["vllm_version"], m["wheel_sha256"][:16])' \
    || echo "NO .vllm-peer/ folder: vllm_triton will fall back to an installed vLLM, if any"
  if [[ "${VLLM_PEER_INSTALLED:-0}" == 1 ]]; then
    python3 -c 'import vllm; from vllm.model_executor.layers.fused_moe import fused_moe; print("installed vllm", vllm.__version__)' 2>&1 | tail -2
  fi
  git log --oneline -1 2>/dev/null || true
} 2>&1 | tee "$WORK/logs/env.txt"

# --- 1. GPU tests: the new variants in bf16, fp32 at odd shapes, vLLM's kernel on our alignment ----
stage smoke
ST=${SMOKE_TIMEOUT:-100}
PYT="python3 -m pytest -q -p no:cacheprovider -W ignore::RuntimeWarning"
timeout "$ST" $PYT tests/kernels/test_fused_moe.py -k "fp32 or tf32" > "$WORK/logs/smoke_fp32.txt" 2>&1 & P1=$!
timeout "$ST" $PYT tests/kernels/test_fused_moe.py -k "not real_shape and not fp32 and not tf32 and (naive or interleaved or bitwise)" > "$WORK/logs/smoke_new.txt" 2>&1 & P2=$!
timeout "$ST" $PYT tests/kernels/test_fused_moe.py -k "not real_shape and not fp32 and not tf32 and not naive and not interleaved and not bitwise" > "$WORK/logs/smoke_core.txt" 2>&1 & P3=$!
timeout "$ST" $PYT tests/kernels/test_vllm_moe_peer.py > "$WORK/logs/smoke_vllm_peer.txt" 2>&1 & P4=$!
wait $P1; R1=$?; wait $P2; R2=$?; wait $P3; R3=$?; wait $P4; R4=$?
for f in fp32 new core vllm_peer; do echo "smoke_$f: $(tail -1 "$WORK/logs/smoke_$f.txt")"; done | tee "$WORK/logs/smoke_summary.txt"
echo "smoke rc: fp32=$R1 new-variants=$R2 core=$R3 vllm-peer=$R4 (124 = timed out)" | tee -a "$WORK/logs/smoke_summary.txt"
GO=1
if [[ $R3 -ne 0 && $R3 -ne 124 ]]; then echo "CORE bf16 TESTS FAILED: no tuning or timing of a broken kernel" >&2; GO=0; fi

# --- 2. tuner on the cells vLLM won (plus M=1, where the naive plan is new), merged into the files ---
if [[ $GO == 1 ]]; then
  stage tune
  timeout "${TUNE_TIMEOUT:-220}" python3 benchmarks/tune_fused_moe.py --merge --workers 16 --deadline-s "${TUNE_DEADLINE:-185}" \
    --cells "Mixtral-8x7B TP2:256,1024,4096,16384" "Qwen3-30B-A3B TP1:4096,16384" "Llama-4-Scout TP2:4096,16384" \
            "Qwen3-30B-A3B TP1:1" "Mixtral-8x7B TP2:1" "Llama-4-Scout TP2:1" \
    > "$WORK/logs/tune.txt" 2>&1
  echo "tune rc=$?" | tee -a "$WORK/logs/stages.txt"
  grep -E "^[A-Z].* M=[0-9]+:|precompil|compile failed|REJECTED|deadline|wrote|Error" "$WORK/logs/tune.txt" | tail -40
  mkdir -p "$WORK/tuned_configs" && cp moe_eval/kernels/tuned_configs/*.json "$WORK/tuned_configs/"
fi

# --- 3. benchmark: ours against vLLM's Triton fused MoE, interleaved, whole call and GEMMs alone -----
if [[ $GO == 1 ]]; then
  stage bench
  PEERS="triton vllm_triton"
  [[ "${VLLM_PEER_INSTALLED:-0}" == 1 ]] && PEERS="$PEERS vllm_installed"
  timeout "${BENCH_TIMEOUT:-175}" python3 benchmarks/bench_fused_moe.py --out-dir "$WORK/bench" \
    --shapes "Qwen3-30B-A3B TP1" "Mixtral-8x7B TP2" "Llama-4-Scout TP2" --peers $PEERS \
    --skip-eager --skip-alignment --replays "${BENCH_REPLAYS:-20}" --precompile-workers 12 \
    --deadline-s "${BENCH_DEADLINE:-150}" \
    2> "$WORK/logs/bench_stderr.txt" > "$WORK/logs/bench_stdout.txt"
  echo "bench rc=$? (1: a target missed or a result wrong; 124: timed out)" | tee -a "$WORK/logs/stages.txt"
  grep -E "WRONG|not timed|not loaded|precompil" "$WORK/logs/bench_stderr.txt" | tail -20
  if [[ ! -s "$WORK/bench/ratios.md" && -s "$WORK/bench/rows.jsonl" ]]; then  # killed: tables from the saved rows
    python3 benchmarks/bench_fused_moe.py --out-dir "$WORK/bench" --report-only "$WORK/bench/rows.jsonl" > "$WORK/bench/ratios.md" 2>&1
  fi
fi

stage pack
{
  cat "$WORK/logs/stages.txt"; echo; cat "$WORK/logs/smoke_summary.txt" 2>/dev/null; echo
  grep -E "^[A-Z].* M=[0-9]+:" "$WORK/logs/tune.txt" 2>/dev/null
} > "$WORK/summary.txt"
mkdir -p "$OUT"
tar -C "$WORK" -czf "$OUT/results.tgz" .
cp "$WORK/summary.txt" "$OUT/summary.txt"
[[ -s "$WORK/bench/ratios.md" ]] && cp "$WORK/bench/ratios.md" "$OUT/ratios.md"
stage "done"
echo
grep -E "^\| (Qwen3|Mixtral|Llama)" "$WORK/bench/bench.md" 2>/dev/null | grep -E "\| (triton|vllm_[a-z]+)(:gemms)? \|" | tail -90 | cut -c1-110
echo
cat "$WORK/bench/ratios.md" 2>/dev/null || echo "no ratio tables (see $OUT/results.tgz: logs/bench_stderr.txt)"
