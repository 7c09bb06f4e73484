#!/usr/bin/env bash
# The layer check on the lent H200 (issue 32), from the checkout with the kit in .vgpu/ (carried):
#   1. its GPU tests (the device kernels against the torch definition, under CUDA graphs); a failure stops here;
#   2. the GPU canary's TP1 pair as shipped and under each mutation of MUTATIONS
#      (benchmarks/device/canary_mutations.sh tp: archives in $OUT, SHIPPED=<carried run folder> skips the pair);
#   3. the checks' lines of every run, for the docs.
#
#   MUTATIONS="scale_expert_decode scale_expert_large" bash benchmarks/device/layer_check_canary.sh
# TESTS=0 skips step 1 (an earlier call on the same code ran it); RUN_TIMEOUT (s) bounds step 2 with a TERM,
# after which what finished is packed.
set -u
out="${OUT:-/tmp/layer-out}"
mkdir -p "$out"
if [ "${TESTS:-1}" = 1 ]; then
  bash .vgpu/device_env.sh python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_layer_check.py \
    > "$out/gpu-tests.log" 2>&1
  rc=$?
  tail -15 "$out/gpu-tests.log"
  [ "$rc" = 0 ] || { echo "layer-check GPU tests: exit $rc; no serving run"; exit 1; }
fi
MUTATIONS="${MUTATIONS:-scale_expert_decode}" timeout -s TERM "${RUN_TIMEOUT:-100000}" \
  bash benchmarks/device/canary_mutations.sh tp
grep -h "layer_check\|\] \[.*: \(PASS\|FAIL\)" /tmp/golden-tp/*.log | cut -c1-600
