"""The bundled MoE on the CPU: torch_moe's contract and numerics on AMX tiles (csrc/cpu_moe.cpp).

torch_moe runs each expert as eager torch ops: x4-8 of vLLM's own CPU kernel on the embedded default's
shapes. This compiled kernel does the same arithmetic (bf16 operands, fp32 sums, the GEMM2 input rounded to
bf16, the top-k sum in fp32 in expert order, the output rounded once) in one pass over (expert, 64-row)
blocks on torch's thread pool, its GEMMs written as AMX tile instructions: x0.7-1.3 of vLLM's kernel per call
(benchmarks/bench_cpu_moe.py, docs/kernels.md).
Its outputs equal torch_moe's in 99.6-100 % of the elements; the rest differ in the last bit (the GEMMs'
internal order).

Built with torch's C++ extension tools (a C++17 compiler and ninja): by install.sh, else at the first layer's
weight loading (about 25 s, before the server serves). Where it cannot run, `torch_moe` does, and
`implementation()` says why: the plugin logs it into the row's record.

    out_TD = cpu_moe(hidden_TD, w13_eFD, w2_eDF, topk_weights_TK, topk_ids_TK)

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import functools
import os
import shutil
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from moe_eval.kernels.torch_moe import torch_moe

SOURCE = Path(__file__).with_name("csrc") / "cpu_moe.cpp"
BUILD_DIR_ENV = "MOE_EVAL_CPU_MOE_BUILD_DIR"
DISABLE_ENV = "MOE_EVAL_CPU_MOE"  # "0": torch_moe everywhere (to compare the two, or to rule this one out)
# The AVX-512 subsets ATen builds its AVX512 kernels with (any AMX CPU has them), not -march=native: the build
# must not depend on the machine that compiles it. The kernel is only called where AMX is (`implementation`).
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-fopenmp",
          "-ffp-contract=off", "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]  # fmt: skip
# -fopenmp: at::parallel_for is inlined here, and without it its `omp parallel` compiles to one thread.
# -ffp-contract=off: g++ would fuse the top-k sum's `a + y * w` into an FMA, a rounding fewer than torch_moe.
LDFLAGS = ["-fopenmp"]
# The calls each implementation served in this process: the call counter's stats file carries them into the
# row's record (`bundled_kernel_calls.implementations`), so a record says what ran, not what was expected to.
CALLS: collections.Counter[str] = collections.Counter()
# What `implementation` says where the compiled kernel runs.
COMPILED = "compiled AMX tile kernel (moe_eval/kernels/csrc/cpu_moe.cpp)"


def build_dir() -> Path:
    """Inside the environment that runs it (install.sh builds there); MOE_EVAL_CPU_MOE_BUILD_DIR overrides."""
    chosen = os.environ.get(BUILD_DIR_ENV)
    return Path(chosen) if chosen else Path(sys.prefix) / "moe-eval-build" / "cpu_moe"


@functools.cache
def _module() -> Any:
    """The compiled module: built the first time (torch rebuilds when the source or flags change)."""
    from torch.utils.cpp_extension import load

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    if shutil.which("ninja") is None:  # pip's ninja (the cpu extra) sits beside this Python, maybe off PATH
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    t0 = time.perf_counter()
    with _builder_lock(directory):
        module = load(
            "moe_eval_cpu_moe", [str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
            build_directory=str(directory), verbose=False,
        )  # fmt: skip
    seconds = time.perf_counter() - t0
    if seconds > 2:  # a build, not a load: say so, it delays the server's start
        print(f"moe-eval: built the CPU MoE kernel in {seconds:.0f} s into {directory}", file=sys.stderr)
    return module


# A build takes 20-40 s here: torch's lock file younger than this, with a process working in the build folder,
# may be a live build outside our lock.
LIVE_BUILD_SECONDS = 180


@contextlib.contextmanager
def _builder_lock(directory: Path) -> Iterator[None]:
    """One builder at a time (a TEP server's ranks load at once), under a lock the OS drops with its holder.

    torch's own lock is a file (`lock`) that a killed build leaves behind (SIGTERM from a cancelled CI job, or
    SIGKILL), and torch waits for it to vanish with no end: every later server would hang at weight loading.
    Holding this lock, no build of ours runs; a `lock` file is still waited on while some process works in the
    build folder (torch runs ninja there; a build outside our lock: an older checkout sharing the environment,
    or a ninja orphaned by a SIGKILL to its Python alone), for at most LIVE_BUILD_SECONDS of the file's age.
    Otherwise it is a leftover, and is removed."""
    with open(directory / "moe-eval-builder.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        leftover = directory / "lock"
        try:
            quiet = 0  # consecutive seconds with no process in the folder (torch's own steps around ninja)
            while quiet < 2 and time.time() - leftover.stat().st_mtime < LIVE_BUILD_SECONDS:
                quiet = 0 if _working_in(directory) else quiet + 1
                time.sleep(1.0)
            print(f"moe-eval: removed {leftover}, left by a build that did not finish", file=sys.stderr)
            leftover.unlink(missing_ok=True)
        except FileNotFoundError:
            pass  # no lock, or the live build ended
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _working_in(directory: Path) -> bool:
    """Whether any process (ninja, the compiler) has the folder as its working directory (Linux /proc)."""
    target = str(directory.resolve())
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            if os.readlink(cwd) == target:
                return True
        except OSError:  # gone, or not ours to read
            continue
    return False


@functools.cache
def implementation() -> tuple[bool, str]:
    """(whether cpu_moe runs the compiled kernel on this machine, why or why not). Builds it if needed."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False, f"torch_moe: {DISABLE_ENV}=0"
    if not torch.cpu._is_amx_tile_supported():
        return False, "torch_moe: this CPU has no AMX tiles (the compiled kernel's GEMMs are tile code)"
    try:
        module = _module()
    except Exception as exc:  # noqa: BLE001  a missing compiler or ninja: any build failure means torch_moe
        return False, f"torch_moe: the compiled kernel did not build ({type(exc).__name__}: {str(exc)[:300]})"
    if not module.amx_ready():
        return False, "torch_moe: the OS refused this process AMX tile data (arch_prctl XCOMP_PERM)"
    return True, COMPILED


def fits(device_type: str, dtype: torch.dtype, D: int, F2: int, K: int) -> bool:
    """The calls the compiled kernel takes: bf16 on the CPU, D and 2F in blocks of 64, K <= 64."""
    return device_type == "cpu" and dtype == torch.bfloat16 and D % 64 == 0 and F2 % 64 == 0 and K <= 64


class _PackedWeights:
    """Each weight tensor's packed copy, made at its first call and again only if the tensor changed in place
    (its version counter) or was replaced (held weakly: a per-call copy, as a mutation makes, is freed)."""

    def __init__(self) -> None:
        # by id(): a tensor's == is elementwise, so it cannot key a WeakKeyDictionary
        self._packed: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}

    def __call__(self, w_eND: torch.Tensor) -> torch.Tensor:
        if w_eND.is_inference():
            # Made under inference_mode (vLLM's forward: the per-call copies of extra_weight_copy and
            # bf16_down_accumulation): no version counter to tell an in-place change, and used once.
            return _module().pack_weights(w_eND.contiguous())
        key = id(w_eND)
        held = self._packed.get(key)
        if held is None or held[0]() is not w_eND or held[1] != w_eND._version:
            if held is None or held[0]() is not w_eND:
                weakref.finalize(w_eND, self._packed.pop, key, None)
            held = (weakref.ref(w_eND), w_eND._version, _module().pack_weights(w_eND.contiguous()))
            self._packed[key] = held
        return held[2]


_packed = _PackedWeights()


def cpu_moe(
    hidden_TD: torch.Tensor,
    w13_eFD: torch.Tensor,
    w2_eDF: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    *,
    expert_map_E: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    silu_slope: float = 1.0,
) -> torch.Tensor:
    """torch_moe's contract; the compiled kernel where `implementation()` and `fits` allow, else torch_moe."""
    e, F2, D = w13_eFD.shape
    K = topk_ids_TK.shape[1]
    fitting = hidden_TD.dtype == w13_eFD.dtype and fits(hidden_TD.device.type, hidden_TD.dtype, D, F2, K)
    if not (fitting and implementation()[0]):
        CALLS["torch_moe"] += 1
        return torch_moe(
            hidden_TD, w13_eFD, w2_eDF, topk_weights_TK, topk_ids_TK, expert_map_E=expert_map_E,
            apply_router_weight_on_input=apply_router_weight_on_input, silu_slope=silu_slope,
        )  # fmt: skip
    T = hidden_TD.shape[0]
    assert hidden_TD.shape == (T, D), "hidden (T, D)"
    assert w2_eDF.shape == (e, D, F2 // 2), "w13 (e, 2F, D), w2 (e, D, F)"
    assert topk_ids_TK.shape == (T, K) and topk_weights_TK.shape == (T, K), "topk shapes must be (T, K)"
    local_TK = topk_ids_TK  # int32 or int64 taken as it is (one torch op fewer a call)
    if local_TK.dtype not in (torch.int32, torch.int64):
        local_TK = local_TK.long()
    if expert_map_E is not None:  # global -> local ids; -1: a slot of another rank, dropped
        local_TK = expert_map_E.long()[local_TK.long()]
    CALLS["compiled"] += 1
    return _module().moe(
        hidden_TD.contiguous(), _packed(w13_eFD), _packed(w2_eDF), topk_weights_TK.float().contiguous(),
        local_TK.contiguous(),
        float(silu_slope), bool(apply_router_weight_on_input),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """`python -m moe_eval.kernels.cpu_moe`: build (or load) the kernel now and say whether it will run."""
    t0 = time.perf_counter()
    _, why = implementation()
    print(f"moe-eval CPU MoE kernel: {why} ({time.perf_counter() - t0:.0f} s; build dir {build_dir()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
