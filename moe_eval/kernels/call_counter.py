"""Counting the MoE calls that really ran inside a vLLM server, CUDA-graph replays included.

Under CUDA graphs vLLM replays the captured MoE kernels without entering Python, so a counter in
`apply()` sees only the eager calls and the captures. On a CUDA device each call therefore also
launches `_count_call_kernel`, which adds 1 and the call's token count to two int64 cells in
pinned host memory; a captured launch is replayed with the MoE kernels it sits beside, so the
cells count every execution. A flusher thread copies the cells (plain host memory reads, no CUDA
call) to `<run dir>/kernel-stats/<pid>.json` at most every STATS_INTERVAL_SECONDS. Usage:

    counter = CallCounter("triton", stats_path)
    counter.count(hidden_TD)   # in apply(), on the stream the MoE kernels run on

The record says how it counted: `counted_on` is "device" (every execution, replays included) or
"host" (apply() calls only: the CPU, where nothing is replayed, or a device where the counting
kernel could not be launched, with the reason in `device_problem`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from moe_eval.kernels.stats_file import StatsFile


def _count_call_kernel_factory():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["tokens"])  # T == 1 must not compile a second variant while serving
    def _count_call_kernel(
        cells_ptr,  # (2,) int64 in pinned host memory: executions, tokens
        tokens,
    ):
        # One stream runs a layer's kernels in order, so a plain read-modify-write needs no atomic
        # (atomics on host memory over PCIe are not supported everywhere).
        calls = tl.load(cells_ptr, volatile=True)
        tl.store(cells_ptr, calls + 1)
        seen = tl.load(cells_ptr + 1, volatile=True)
        tl.store(cells_ptr + 1, seen + tokens)

    return _count_call_kernel


class CallCounter:
    """One per process and backend (vLLM runs one process per rank)."""

    def __init__(self, backend: str, path: Path | None) -> None:
        self.backend = backend
        self.path = path
        self.python_calls = 0
        self.python_tokens = 0
        self.cells: torch.Tensor | None = None  # pinned int64 [2], written by the device
        self.device_problem: str | None = None
        self._kernel = None
        self.file = StatsFile(path, self.snapshot, "moe-eval-call-counter")

    # --- counting (hot path) ---

    def count(self, hidden_TD: torch.Tensor) -> None:
        self.python_calls += 1
        self.python_tokens += hidden_TD.shape[0]
        if hidden_TD.device.type == "cuda":
            if self.cells is None and self.device_problem is None:
                self._attach_device()
            if self.cells is not None:
                self._kernel[(1,)](self.cells, hidden_TD.shape[0], num_warps=1)
        self.file.start()

    def attach_device(self) -> None:
        """Compile and check the counting kernel now (before vLLM's warm-up ends), not on first use."""
        if self.cells is None and self.device_problem is None:
            self._attach_device()

    def _attach_device(self) -> None:
        try:
            kernel = _count_call_kernel_factory()
            probe = torch.zeros(2, dtype=torch.int64).pin_memory()
            kernel[(1,)](probe, 3, num_warps=1)
            torch.cuda.synchronize()
            if probe.tolist() != [1, 3]:
                raise RuntimeError(f"counting kernel wrote {probe.tolist()}, expected [1, 3]")
            self._kernel, self.cells = kernel, torch.zeros(2, dtype=torch.int64).pin_memory()
        except Exception as exc:  # noqa: BLE001  counted on the host instead, and the record says why
            self.device_problem = f"{type(exc).__name__}: {exc}"

    # --- reading ---

    def snapshot(self) -> dict[str, Any]:
        on_device = self.cells is not None
        calls, tokens = self.cells.tolist() if on_device else (self.python_calls, self.python_tokens)
        record = {
            "backend": self.backend,
            "pid": os.getpid(),
            "calls": int(calls),
            "tokens": int(tokens),
            "python_calls": self.python_calls,
            "counted_on": "device" if on_device else "host",
        }
        if self.device_problem is not None:
            record["device_problem"] = self.device_problem
        cpu_moe = sys.modules.get("moe_eval.kernels.cpu_moe")  # loaded by the torch backend's first call only
        if cpu_moe is not None and cpu_moe.CALLS:
            record["implementations"] = dict(cpu_moe.CALLS)  # what served: the compiled kernel or torch_moe
        return record

    def flush(self) -> None:
        self.file.flush()
