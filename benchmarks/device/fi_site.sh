# shellcheck shell=bash
# Sourced by the H200 scripts (from the repo root): where FlashInfer and its BF16 module live on a warm
# machine. benchmarks/device/kernel_bench.sh installs FlashInfer into .fi-site/ and builds (or places) the module;
# the canary scripts' WITH_FI=1 rows import it from there.
FI_SITE=.fi-site
FI_AOT_DIR="$FI_SITE/flashinfer/data/aot/fused_moe_90"

require_fi_site() {  # exit 2, saying what to run, where FlashInfer's module is not here
  [ -f "$FI_AOT_DIR/fused_moe_90.so" ] && return 0
  echo "WITH_FI=1: no $FI_SITE/ with fused_moe_90.so here: run benchmarks/device/kernel_bench.sh STAGES=fi-build first"
  exit 2
}
