#!/usr/bin/env bash
# Issue 34 on one lent H200, in one call (~90-130 s with compiles): the decode plans at M = 1, 2, 4, 8, 16 and
# the shapes of tile_configs.PREFILL_SHAPES.
#   1. env: GPU, versions, whether PDL is available
#   2. tests: test_fused_moe.py -k "gemv or naive or pdl" (bf16 on the GPU: the naive and GEMV plans at small
#      shapes, the GEMVs at every shipped shape at M = 1, 2, 4 with and without PDL, the tl.dot naive chain
#      with pdl (its bits eager and from a CUDA graph; naive + pdl against the aligned M = 1 entries' bits),
#      fp32 odd shapes)
#   3. bench: bench_fused_moe.py, CUDA graphs over rotated input sets, replays interleaved: PEERS (default:
#      the shipped plan `triton`, `triton_pdl` (pdl asked for), the GEMVs `triton_gemv*`, run at every M by
#      --gemv-force), vLLM's Triton kernel (`vllm_triton`, when .vllm-peer/ is carried) and BOUNDS (default:
#      benchmarks/bounds.py's one-launch weight reads); the table of issue 34 (us, TB/s on the weights, x the
#      copy floor) in decode.md and on stdout
# Usage (repo root on the device; carried: .vllm-peer/ from benchmarks/extract_vllm_moe_peer.py, optional):
#   OUT=/some/dir bash benchmarks/device/decode_probe.sh
# The kernels need only the image's torch and triton, so the checkout is imported as is (PYTHONPATH),
# as kernel_bench.sh does; PY="bash .vgpu/device_env.sh python3" runs it through the vLLM kit instead.
# Budgets (seconds, wall; ~350 at most in all): TESTS_TIMEOUT (120), BENCH_TIMEOUT (200), BENCH_DEADLINE
# (no new cell after, 150). Results in $OUT (at most 8 files come back): decode.md, bench_rows.jsonl,
# bench.json, stages.txt, and logs.tgz (env.txt, stages.txt, tests.txt, correctness.jsonl, bench_stderr.txt,
# clocks.csv: nvidia-smi's SM / memory clock and power every 250 ms through the benchmark).
set -u
OUT="${OUT:?set OUT}"
PY="${PY:-python3}"
RUN="$PWD/.decode-run"
mkdir -p "$RUN" "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 TRITON_CACHE_DIR="$RUN/triton-cache"
T0=$(date +%s)
stage() { echo "== $1 at +$(( $(date +%s) - T0 )) s ($(date -u +%T))" | tee -a "$OUT/stages.txt" >&2; }

# The issue's shapes, the ones furthest from the target first (a deadline drops the last).
SHAPES=("Qwen3-30B-A3B TP2" "Qwen3-30B-A3B TEP2" "Qwen3-30B-A3B TP1" "Llama-4-Scout TP2" "Llama-4-Scout TEP2"
        "Mixtral-8x7B TP2" "Mixtral-8x7B TEP2")
# The tuned plan, with programmatic dependent launch on its naive calls, and the GEMVs that led the last probes.
PEERS=(${PEERS:-triton triton_pdl triton_gemv triton_gemv_pdl triton_gemv_pdl_long})
# Practical bounds in the same replays (benchmarks/bounds.py): one launch reading the hit experts' weights.
BOUNDS=(${BOUNDS:-weights_read weights_read_c4k weights_read_c64k})
[[ -f .vllm-peer/MANIFEST.json ]] && PEERS+=(vllm_triton)

stage env
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,temperature.gpu --format=csv
  $PY -c 'import sys, torch, triton
from moe_eval.kernels.fused_moe import pdl_available
print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name())
print("PDL for the GEMVs:", pdl_available(torch.device("cuda")))'
  git log --oneline -1 2>/dev/null
  echo "peers: ${PEERS[*]}"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

stage tests
# ~110 tests, most of their time compiles: 4 processes on the one GPU when pytest-xdist is there (the image has it).
XDIST=(); $PY -c "import xdist" 2> /dev/null && XDIST=(-n 4)
MOE_EVAL_CORRECTNESS_LOG="$OUT/correctness.jsonl" timeout "${TESTS_TIMEOUT:-120}" \
  $PY -m pytest -q -p no:cacheprovider -W ignore::RuntimeWarning "${XDIST[@]}" tests/kernels/test_fused_moe.py \
  -k "gemv or naive or pdl" > "$OUT/tests.txt" 2>&1
echo "tests rc=$? (124 = timed out): $(tail -1 "$OUT/tests.txt")" | tee -a "$OUT/stages.txt"
grep -E "^(FAILED|ERROR)" "$OUT/tests.txt" | head -20

stage bench
# The SM clock, memory clock and power through the benchmark (the ceiling's context, issue 34).
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 250 \
  > "$OUT/clocks.csv" 2>&1 &
SMI=$!
timeout "${BENCH_TIMEOUT:-200}" $PY benchmarks/bench_fused_moe.py --out-dir "$RUN/bench" --shapes "${SHAPES[@]}" \
  --m 1 2 4 8 16 --peers "${PEERS[@]}" --bounds "${BOUNDS[@]}" --gemv-force --no-gemms-alone --skip-eager --skip-alignment \
  --replays "${BENCH_REPLAYS:-20}" --precompile-workers 12 --deadline-s "${BENCH_DEADLINE:-150}" \
  --decode-targets 2> "$OUT/bench_stderr.txt" > "$RUN/bench_stdout.txt"
echo "bench rc=$? (1: a target missed or a result wrong; 124: timed out)" | tee -a "$OUT/stages.txt"
kill "$SMI" 2> /dev/null
grep -E "WRONG|not timed|precompil|deadline|Error" "$OUT/bench_stderr.txt" | cut -c1-300 | tail -20
if [[ ! -s "$RUN/bench/decode.md" && -s "$RUN/bench/rows.jsonl" ]]; then  # killed: the table from the saved rows
  $PY benchmarks/bench_fused_moe.py --out-dir "$RUN/bench" --report-only "$RUN/bench/rows.jsonl" \
    --decode-targets > "$RUN/bench/decode.md" 2>&1
fi

stage pack
for f in decode.md bench.json; do [[ -s "$RUN/bench/$f" ]] && cp "$RUN/bench/$f" "$OUT/"; done
[[ -s "$RUN/bench/rows.jsonl" ]] && cp "$RUN/bench/rows.jsonl" "$OUT/bench_rows.jsonl"
stage done
# At most 8 files come back: the logs in one archive.
tar -C "$OUT" -czf "$OUT/logs.tgz" env.txt stages.txt tests.txt correctness.jsonl bench_stderr.txt clocks.csv 2> /dev/null \
  && rm -f "$OUT"/{env.txt,tests.txt,correctness.jsonl,bench_stderr.txt,clocks.csv}
cat "$OUT/decode.md" 2>/dev/null
