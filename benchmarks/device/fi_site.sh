# shellcheck shell=bash
# Sourced by the H200 scripts (from the repo root): where FlashInfer and its BF16 module live on a warm
# machine. benchmarks/device/kernel_bench.sh installs FlashInfer into .fi-site/ and builds (or places) the module;
# the canary scripts' WITH_FI=1 rows import it from there. A carried .fi-lite/fi-lite.tar.xz (built with no
# GPU by benchmarks/fi_module_cpu.sh: FlashInfer without its C++ sources, the module placed) is unpacked
# there instead, so those rows need no build and no earlier call.
FI_SITE=.fi-site
FI_AOT_DIR="$FI_SITE/flashinfer/data/aot/fused_moe_90"
FI_LITE=.fi-lite/fi-lite.tar.xz

place_fi_lite() {  # unpack the carried light site where no module is placed yet (once per machine)
  [ -f "$FI_AOT_DIR/fused_moe_90.so" ] && return 0
  [ -f "$FI_LITE" ] || return 0
  rm -rf "$FI_SITE" && mkdir -p "$FI_SITE" && tar -C "$FI_SITE" -xJf "$FI_LITE" \
    && echo "FlashInfer placed from $FI_LITE ($(grep -o 'fused_moe_90.so md5 [0-9a-f]*' .fi-lite/BUILD.txt 2> /dev/null))"
}

require_fi_site() {  # exit 2, saying what to run, where FlashInfer's module is not here
  place_fi_lite
  [ -f "$FI_AOT_DIR/fused_moe_90.so" ] && return 0
  echo "WITH_FI=1: no $FI_SITE/ with fused_moe_90.so here: carry .fi-lite/ (benchmarks/fi_module_cpu.sh)" \
    "or run benchmarks/device/kernel_bench.sh STAGES=fi-build first"
  exit 2
}
