"""Load FlashInfer's two modules as the served MoE path does, or raise: run before anything is served.

fused_moe_90 with JIT off: where the placed library failed to load, FlashInfer would rebuild it unfiltered
(247 files, beyond a lent machine). trtllm_utils, the delay kernel of the autotuner that vLLM runs while it
warms up, placed or built from the sources where a wheel install has them: without it every tactic's
profile failed silently and FlashInfer served untuned (2026-12-05, docs/flashinfer.md).
Used by benchmarks/fi_module_cpu.sh (no GPU: the libraries load, nothing runs) and
benchmarks/device/fi_site.sh.
"""

import os

from flashinfer.fused_moe import core
from flashinfer.jit import env as jit_env
from flashinfer.tllm_utils import get_trtllm_utils_module

jit_was = os.environ.get("FLASHINFER_DISABLE_JIT")
os.environ["FLASHINFER_DISABLE_JIT"] = "1"  # read when a module is built or loaded, not at import
try:
    runner = core.get_cutlass_fused_moe_module("90")
finally:
    if jit_was is None:
        os.environ.pop("FLASHINFER_DISABLE_JIT")
    else:
        os.environ["FLASHINFER_DISABLE_JIT"] = jit_was
print("loaded", jit_env.get_aot_path("fused_moe_90"), "entry points:", sorted(vars(runner)))
get_trtllm_utils_module().delay_kernel  # noqa: B018 -- the attribute lookup raises where it is absent
print("loaded trtllm_utils, entry point: delay_kernel")
