# shellcheck shell=bash
# Sourced by the H200 scripts (from the repo root): where FlashInfer and its BF16 module live on a warm
# machine. benchmarks/device/kernel_bench.sh installs FlashInfer into .fi-site/ and builds (or places) the module;
# the canary scripts' WITH_FI=1 rows import it from there. A carried .fi-lite/fi-lite.tar.xz (built with no
# GPU by benchmarks/fi_module_cpu.sh: FlashInfer without its C++ sources, its two modules placed) is unpacked
# there instead, so those rows need no build and no earlier call.
FI_SITE=.fi-site
FI_AOT_DIR="$FI_SITE/flashinfer/data/aot/fused_moe_90"
FI_LITE=.fi-lite/fi-lite.tar.xz
FI_LITE_STAMP="$FI_SITE/.from-fi-lite"  # the archive's md5: which light site this is

place_fi_lite() {
  # Unpack the carried archive where no module is placed yet, or over a light site unpacked from another
  # archive (an older one lacked the autotuner's module: FlashInfer then served untuned, 2026-12-05). A site
  # installed from the wheels (kernel_bench.sh; no stamp) is kept. Unpacked beside, then moved: a failed or
  # cut unpack leaves no half site that a later call would take for whole.
  [ -f "$FI_LITE" ] || return 0
  local md5
  md5="$(md5sum "$FI_LITE" | cut -d' ' -f1)"
  if [ -f "$FI_AOT_DIR/fused_moe_90.so" ]; then
    [ -f "$FI_LITE_STAMP" ] || return 0
    [ "$(cat "$FI_LITE_STAMP")" = "$md5" ] && return 0
  fi
  rm -rf "$FI_SITE.part" && mkdir -p "$FI_SITE.part" && tar -C "$FI_SITE.part" -xJf "$FI_LITE" \
    && echo "$md5" > "$FI_SITE.part/.from-fi-lite" && rm -rf "$FI_SITE" && mv "$FI_SITE.part" "$FI_SITE" \
    || { rm -rf "$FI_SITE.part"; echo "WITH_FI=1: $FI_LITE did not unpack (the error above)"; return 1; }
  echo "FlashInfer placed from $FI_LITE ($(grep -o 'fused_moe_90.so md5 [0-9a-f]*' .fi-lite/BUILD.txt 2> /dev/null))"
}

require_fi_site() {  # exit 2, saying what to run, where FlashInfer's module is not here
  place_fi_lite || exit 2
  [ -f "$FI_AOT_DIR/fused_moe_90.so" ] && return 0
  echo "WITH_FI=1: no $FI_SITE/ with fused_moe_90.so here: carry .fi-lite/ (benchmarks/fi_module_cpu.sh)" \
    "or run benchmarks/device/kernel_bench.sh STAGES=fi-build first"
  exit 2
}

check_fi_modules() {  # both modules load (with the carried kit) before any server starts: exit 2 if not
  # One built on another machine that did not load here would otherwise end the call only after the first
  # row (~110 s); what is loaded and why: benchmarks/fi_modules_load.py.
  EXTRA_PYTHONPATH="$PWD/$FI_SITE" bash .vgpu/device_env.sh python3 benchmarks/fi_modules_load.py \
    || { echo "WITH_FI=1: FlashInfer's modules do not load from $FI_SITE/ (the error above)"; exit 2; }
}
