#!/usr/bin/env bash
# Issue 34's closing run on one lent H200, in one call (~400 s on a fresh machine): first the decode cells,
# then the interleaved table over every M with both peers.
#   1. benchmarks/device/decode_probe.sh: the GPU tests of the decode paths (-k "gemv or naive or pdl": pdl's
#      bits at every shipped shape, eager and from a CUDA graph; naive + pdl against the aligned M = 1 entries'
#      bits; the GEMVs), then M = 1 .. 16: the shipped plan (`triton`, pdl on its naive entries), the same without
#      pdl (`triton_nopdl`), naive + pdl where the file is aligned (`triton_naive_pdl`), the GEMVs with PDL,
#      vLLM's Triton, and the one-launch read bound
#   2. benchmarks/device/kernel_bench.sh STAGES=bench: bundled vs vLLM's Triton vs FlashInfer CUTLASS, the seven
#      shapes, M = 1 .. 16384, 3 repeats, torch's grouped GEMMs alone beside them, clocks sampled
# Carried: .whl/ (the FlashInfer wheels and the fused_moe_90.so an earlier fi-build call brought back: no
# build here), .vllm-peer/. Budgets (s): DECODE_TESTS (80), DECODE_BENCH (90), DECODE_DEADLINE (60),
# FULL_BENCH (260), FULL_DEADLINE (225). At most 8 files come back: decode.md, decode_rows.jsonl, prefill.md,
# full_rows.jsonl, logs.tgz (every stage's logs, the tests, the clocks).
#   OUT=/some/dir bash benchmarks/device/issue34_final.sh
set -u
OUT="${OUT:?set OUT}"
W="$PWD/.issue34-run"
rm -rf "$W" && mkdir -p "$W/decode" "$W/full" "$OUT"
PEERS="triton triton_nopdl triton_naive_pdl triton_gemv_pdl" BOUNDS="weights_read weights_read_c4k" \
  TESTS_TIMEOUT="${DECODE_TESTS:-80}" BENCH_TIMEOUT="${DECODE_BENCH:-90}" BENCH_DEADLINE="${DECODE_DEADLINE:-60}" \
  OUT="$W/decode" bash benchmarks/device/decode_probe.sh > "$W/decode_stdout.txt" 2>&1
echo "decode stage done at $(date -u +%T)"
grep -E "^M=1|tests rc" "$W/decode_stdout.txt" "$W/decode/stages.txt" | cut -c1-200
# FI_PEER="" (no FlashInfer: nothing carried, no tactic tuning) and BENCH_M="1024 4096 16384" make this stage the
# prefill cells against vLLM's Triton and the grouped-GEMM bound alone (~120 s).
DECODE_PEERS="" BOUNDS="grouped_mm_gemms" BENCH_TIMEOUT="${FULL_BENCH:-260}" BENCH_DEADLINE="${FULL_DEADLINE:-225}" \
  OUT="$W/full" STAGES="bench" bash benchmarks/device/kernel_bench.sh > "$W/full_stdout.txt" 2>&1
echo "full stage done at $(date -u +%T)"
rm -f "$W/full/fused_moe_90.so"
cp "$W/decode/decode.md" "$OUT/decode.md" 2> /dev/null
cp "$W/decode/bench_rows.jsonl" "$OUT/decode_rows.jsonl" 2> /dev/null
cp "$W/full/prefill.md" "$OUT/prefill.md" 2> /dev/null
cp "$W/full/bench_rows.jsonl" "$OUT/full_rows.jsonl" 2> /dev/null
tar -C "$W" -czf "$OUT/logs.tgz" decode_stdout.txt full_stdout.txt decode/stages.txt decode/logs.tgz \
  full/results.tgz full/stages_bench.txt 2> /dev/null
cat "$OUT/prefill.md" 2> /dev/null | tail -60
