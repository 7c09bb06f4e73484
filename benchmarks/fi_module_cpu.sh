#!/usr/bin/env bash
# FlashInfer's BF16 fused_moe_90 built on a machine with no GPU, packed to travel with the vLLM kit.
#
# Why: the H200 runs of the FlashInfer CUTLASS row need this module, and building it there costs ~430 s
# of a session's 1,800 s of device time (docs/flashinfer.md). nvcc needs no GPU: the same compiler
# (CUDA 13.0, cuda_13.0.r13.0/compiler.36424714_0, as on the H200 image) comes from PyPI's nvidia-*
# wheels, and the same BF16-only source filter (benchmarks/flashinfer_h200.py) picks the 32 files.
#
# Writes .fi-lite/fi-lite.tar.xz: FlashInfer and tvm-ffi as the H200's Python 3.12 installs them from
# .whl/, without the C++ sources the JIT would compile (data/csrc, cutlass, cccl, include, spdlog: ~170 MB,
# unused once the module is placed), and the module at flashinfer/data/aot/fused_moe_90/, where FlashInfer
# loads it with no build. Beside it BUILD.txt (compiler, sources, md5, the library's needs). It is small
# enough to share one call's 64 MiB with .vgpu/; benchmarks/device/fi_site.sh unpacks it on the device.
#
# Needs: .whl/ with the two wheels of docs/flashinfer.md "Setup", PyPI, gcc, ~2 GB in WORK. Time: the 33
# ninja steps took 30-36 min with 2 jobs on 2 cores; a rerun only links (docs/flashinfer.md "The same build
# with no GPU").
# Usage (repo root): bash benchmarks/fi_module_cpu.sh       # WORK=/tmp/fi-cpu-build JOBS=$(nproc)
set -euo pipefail
WORK="${WORK:-/tmp/fi-cpu-build}"
JOBS="${JOBS:-$(nproc)}"
ROOT="$PWD"
PY="${PYTHON:-$ROOT/.venv/bin/python}"  # needs torch: importing FlashInfer imports it
FI_WHEEL=.whl/flashinfer_python-0.7.0.post1-py3-none-any.whl
FFI_WHEEL_312=.whl/apache_tvm_ffi-0.1.15.post2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
for w in "$FI_WHEEL" "$FFI_WHEEL_312"; do
  [[ -f "$w" ]] || { echo "fi_module_cpu.sh: $w missing: download it as docs/flashinfer.md 'Setup' says" >&2; exit 2; }
done
# The CUDA 13.0 toolchain of the H200 image, and the headers and libraries the module's sources include
# and link (cublasLt.h, curand_kernel.h, nvrtc.h; -lcudart -lnvrtc). Versions of the 13.0 release.
TOOLCHAIN=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96
           nvidia-cuda-cccl==13.0.85 nvidia-cublas==13.0.2.14 nvidia-cuda-nvrtc==13.0.88 nvidia-curand==10.4.0.35)
# What importing FlashInfer on this machine needs beside torch (the H200 image has them).
IMPORT_DEPS=(apache-tvm-ffi==0.1.15.post2 ninja nvidia-ml-py einops tabulate click)

site="$WORK/site"; cuda="$WORK/cuda"; lite="$WORK/lite"
mkdir -p "$WORK"
if [[ ! -x "$site/nvidia/cu13/bin/nvcc" ]]; then
  "$PY" -m pip install -q --no-deps --target "$site" "${TOOLCHAIN[@]}" "${IMPORT_DEPS[@]}" "$FI_WHEEL"
fi

# A CUDA_HOME as FlashInfer's ninja file expects it: bin/ and nvvm/ of the nvcc wheel, one include/ with
# every wheel's headers, lib64/ with the link names, and a stub of the driver library as the toolkit has
# one (libcuda.so.1, every driver function of cuda.h defined and doing nothing): the linker then records
# libcuda.so.1 as a dependency of the module, as on the H200 (an empty stub would be dropped as unused,
# leaving the module's cu* calls to whatever the process happened to load).
rm -rf "$cuda"; mkdir -p "$cuda/include" "$cuda/lib64/stubs"
ln -s "$site/nvidia/cu13/bin" "$cuda/bin"; ln -s "$site/nvidia/cu13/nvvm" "$cuda/nvvm"
cp -a "$site"/nvidia/cu13/include/. "$cuda/include/"  # -a: the wheels' times, so a rerun rebuilds nothing
for lib in "$site"/nvidia/cu13/lib/*; do ln -s "$lib" "$cuda/lib64/"; done
for name in cudart nvrtc; do ln -s "$cuda/lib64/lib$name.so.13" "$cuda/lib64/lib$name.so"; done
gcc -E -P -I "$cuda/include" "$cuda/include/cuda.h" | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' \
  | tr -d '( ' | sort -u | sed 's/.*/void &(void) {}/' > "$WORK/libcuda_stub.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cuda/lib64/stubs/libcuda.so" "$WORK/libcuda_stub.c"
ln -s libcuda.so "$cuda/lib64/stubs/libcuda.so.1"

# FlashInfer runs `ninja` by name: a machine with none gets the wheel's binary, placed after the system's
# so that a machine with one keeps building with it (a change of ninja rebuilds every step).
export PATH="$PATH:$site/bin"
export CUDA_HOME="$cuda" FLASHINFER_WORKSPACE_BASE="$WORK/ws" MAX_JOBS="$JOBS" PYTHONPATH="$site:$ROOT/benchmarks:$ROOT"
T0=$(date +%s)
# Two modules: the MoE itself, and trtllm_utils, the delay kernel of FlashInfer's autotuner. vLLM autotunes
# FlashInfer's MoE while it warms up; on 2026-12-05 (H100) a site without trtllm_utils could not build it
# there (no C++ sources), every tactic's profile failed without a word, and the untuned MoE served its
# decode ranges at x1.22-1.67 of vLLM's Triton; with it, tuned, 46.1 / 450.3 us against Triton's 38.6 /
# 445.1 at Qwen3-30B-A3B TP1 M = 1 / 256 (docs/flashinfer.md).
MODULES=(fused_moe_90 trtllm_utils)
for name in "${MODULES[@]}"; do find "$WORK/ws" -name "$name.so" -delete 2> /dev/null || true; done  # linked again (seconds)
"$PY" - <<'PY'
import os
from flashinfer_h200 import BUILD_ENV, install_bf16_source_filter
for key, value in BUILD_ENV.items():
    os.environ.setdefault(key, value)  # MAX_JOBS is set above: this machine's cores, not the H200's 16
os.environ["FLASHINFER_CUDA_ARCH_LIST"] = "9.0a"  # the H200's, whatever the caller exported (BUILD.txt says so)
stats = install_bf16_source_filter()
from flashinfer.fused_moe import core
from flashinfer.jit.tllm_utils import gen_trtllm_utils_module
spec = core.gen_cutlass_fused_moe_sm90_module()
print(f"fused_moe_90: {stats['kept_sources']} of {stats['total_sources']} sources, {os.environ['MAX_JOBS']} jobs", flush=True)
spec.build(verbose=False)
gen_trtllm_utils_module().build(verbose=False)
PY
declare -A SO
for name in "${MODULES[@]}"; do
  SO[$name]="$(find "$WORK/ws" -name "$name.so" | head -1)"
  [[ -f "${SO[$name]}" ]] || { echo "fi_module_cpu.sh: the build left no $name.so under $WORK/ws" >&2; exit 1; }
done
BUILD_S=$(( $(date +%s) - T0 ))

# The load check, through FlashInfer's own loaders as the server calls them: a site made like the
# travelling one (sources removed, modules placed) but with this machine's tvm-ffi, an empty JIT cache, and
# JIT disabled, so each module is loaded as placed or the call raises. The arch is named as the H200's (no
# GPU to ask); the libcuda stub stands in for the driver: nothing runs, the libraries only have to load
# and hold their entry points.
make_site() {  # DEST FFI: FlashInfer's wheel unpacked into DEST (a wheel is a zip), tvm-ffi from FFI, modules placed
  rm -rf "$1"; mkdir -p "$1"
  "$PY" -m zipfile -e "$FI_WHEEL" "$1"
  if [[ -f "$2" ]]; then "$PY" -m zipfile -e "$2" "$1"; else cp -r "$2" "$1/"; fi
  rm -rf "$1"/flashinfer/data/{csrc,cutlass,cccl,include,spdlog}
  for name in "${MODULES[@]}"; do
    mkdir -p "$1/flashinfer/data/aot/$name" && cp "${SO[$name]}" "$1/flashinfer/data/aot/$name/$name.so"
  done
}
make_site "$WORK/check" "$site/tvm_ffi"
rm -rf "$WORK/check-ws"
FLASHINFER_DISABLE_JIT=1 FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE="$WORK/check-ws" \
  PYTHONPATH="$WORK/check:$site" LD_LIBRARY_PATH="$cuda/lib64:$cuda/lib64/stubs" "$PY" "$ROOT/benchmarks/fi_modules_load.py"

# The travelling site: the same, with the H200's cp312 tvm-ffi wheel (--no-deps, as the kit installs).
make_site "$lite" "$FFI_WHEEL_312"
mkdir -p .fi-lite
# Written under temporary names, then renamed (set -e stops at a failed step): the archive and its
# BUILD.txt always describe each other.
tar -C "$lite" -cJf .fi-lite/fi-lite.tar.xz.part .
{
  echo "built $(date -u +%FT%TZ) on $(uname -m), $JOBS jobs; this invocation's build step ${BUILD_S} s (a rerun only links)"
  "$cuda/bin/nvcc" --version | tail -1
  echo "flashinfer 0.7.0.post1, apache-tvm-ffi 0.1.15.post2 (cp312), FLASHINFER_CUDA_ARCH_LIST=9.0a"
  for name in "${MODULES[@]}"; do
    so="${SO[$name]}"
    echo "$name.so md5 $(md5sum "$so" | cut -d' ' -f1), $(stat -c %s "$so") bytes;" \
      "needs: $(readelf -d "$so" | grep -o 'NEEDED.*' | grep -o '\[.*\]' | tr -d '[]' | tr '\n' ' ')"
  done
  so="${SO[fused_moe_90]}"
  echo "fused_moe_90's driver functions: $(nm -D --undefined-only "$so" | grep -cE ' cu[A-Z]');" \
    "newest symbol versions: $(objdump -T "$so" | grep -oE '(GLIBC|GLIBCXX|CXXABI)_[0-9.]+' | sort -u -V \
    | awk -F_ '{v[$1]=$0} END {for (k in v) printf "%s ", v[k]}')"
  echo "fi-lite.tar.xz $(stat -c %s .fi-lite/fi-lite.tar.xz.part) bytes"
} > .fi-lite/BUILD.txt.part
mv -f .fi-lite/fi-lite.tar.xz.part .fi-lite/fi-lite.tar.xz
mv -f .fi-lite/BUILD.txt.part .fi-lite/BUILD.txt
cat .fi-lite/BUILD.txt
