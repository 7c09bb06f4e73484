"""The served MoE calls' own time, per call size, measured inside a vLLM server (the speed gate's input).

A timer brackets the routed-expert computation of every MoE call the server makes: the bundled kernel's call
in BundledExperts.apply (after the routing a mutation may change, before the layer check), and vLLM's own
`UnquantizedFusedMoEMethod.apply` for the incumbent row (plugin.TimedUnquantizedFusedMoEMethod).

On a CUDA device the bracket is two one-thread kernels on the call's stream: the first stores the device's
%globaltimer (nanoseconds) in device memory, the second reads it again after the MoE kernels ended (one stream
runs them in order) and adds the difference, the call, its tokens and whether it was a graph replay to the
cell of the call's size M in pinned host memory. Both are launched in apply(), so under CUDA graphs they are
captured beside the MoE kernels and every replay is timed with no host work (a call launched while the stream
is capturing bakes replayed = 1 into its end stamp, so each replay counts as a replayed call and its time as
replayed time; an eager call adds 0): device-side timestamps, not a profiler, because vLLM's torch profiler
(0.26) and its profiler config (0.32) trace a window of steps into a trace file per rank that would need
parsing and does not exist on the CPU build, while this needs only the sums, on both releases and under
graphs. What it adds to the measured time: the gap between two graph nodes and the stamp kernel's own launch,
the same for every row (not measured apart; docs/perf.md, "Served speed"). On the CPU (eager) the bracket is
time.perf_counter_ns() around the call, which returns when the work is done.

One cell per size (TIMER_MAX_SIZE; larger calls share the last): the speed gate compares two rows size for
size, since within a dispatch range a call's time grows with its size and the mix of sizes differs between
runs.

A flusher thread (kernels/stats_file.py) writes <run dir>/moe-timing/<pid>.json (core/moe_timing.py reads it):
per size that was called, FIELDS (calls, nanoseconds, their squares, tokens, the replayed calls and their
nanoseconds), since the process started. The harness reads the files before and after its
timed workload and takes the difference.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from moe_eval.core.moe_timing import FIELDS
from moe_eval.core.plugin_protocol import TIMER_MAX_SIZE
from moe_eval.kernels.stats_file import StatsFile

NUM_CELLS = TIMER_MAX_SIZE + 1  # the pinned table: row M holds the calls of M tokens (row 0 unused)
NUM_FIELDS = len(FIELDS)


def size_cell(tokens: int) -> int:
    """The table's row of a call of `tokens` tokens: its size, or the last row for larger calls."""
    return min(tokens, TIMER_MAX_SIZE)


def _stamp_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _globaltimer():
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )

    @triton.jit
    def _stamp_start_kernel(start_ptr):
        tl.store(start_ptr, _globaltimer())

    # do_not_specialize: a value of 1 (M = 1, a captured call's replayed) must not compile a second variant
    # while serving.
    @triton.jit(do_not_specialize=["cell_index", "tokens", "replayed"])
    def _stamp_end_kernel(
        start_ptr,  # (1,) int64: the start stamp, ns
        table_ptr,  # (NUM_CELLS, NUM_FIELDS) float64, pinned host memory
        cell_index,
        tokens,
        replayed,  # 1 where the call was captured into a CUDA graph (then counted at every replay), else 0
        FIELDS_PER_CELL: tl.constexpr,  # len(FIELDS): the table's row stride
    ):
        elapsed = (_globaltimer() - tl.load(start_ptr)).to(tl.float64)
        # One stream runs a process's MoE layers in order: a plain read-modify-write needs no atomic.
        cell = table_ptr + cell_index * FIELDS_PER_CELL
        tl.store(cell, tl.load(cell, volatile=True) + 1.0)
        tl.store(cell + 1, tl.load(cell + 1, volatile=True) + elapsed)
        tl.store(cell + 2, tl.load(cell + 2, volatile=True) + elapsed * elapsed)
        tl.store(cell + 3, tl.load(cell + 3, volatile=True) + tokens.to(tl.float64))
        tl.store(cell + 4, tl.load(cell + 4, volatile=True) + replayed.to(tl.float64))
        tl.store(cell + 5, tl.load(cell + 5, volatile=True) + replayed.to(tl.float64) * elapsed)

    return _stamp_start_kernel, _stamp_end_kernel


class MoeTimer:
    """One per process (vLLM runs one per rank). Usage, around the routed-expert computation:

    token = timer.start(hidden_TD)
    out = kernel(...)
    timer.stop(token, hidden_TD)
    """

    def __init__(self, backend: str, path: Path | None, scope: str) -> None:
        self.backend = backend
        self.scope = scope  # what the bracket holds, for the record
        self.table = torch.zeros(NUM_CELLS, NUM_FIELDS, dtype=torch.float64)  # host sums (CPU timing)
        self.device_problem: str | None = None
        self._kernels: tuple[Any, Any] | None = None
        self._start: torch.Tensor | None = None
        self._on_device = False
        self.rank: dict[str, Any] = {}
        self.max_tokens = 0  # the most tokens one call can carry (the sweep sizes its batched prefill by it)
        self.file = StatsFile(path, self.snapshot, "moe-eval-moe-timer")

    def attach_device(self, device: torch.device) -> None:
        """Compile and check the stamp kernels now (before vLLM's warm-up and graph capture ends)."""
        if self._on_device or self.device_problem is not None:
            return
        try:
            start_kernel, end_kernel = _stamp_kernels()
            start = torch.zeros(1, dtype=torch.int64, device=device)
            probe = torch.zeros(4, NUM_FIELDS, dtype=torch.float64).pin_memory()
            # An eager call into cell 2 (replayed 0) and a replayed one into cell 3 (replayed 1, as a captured
            # call's stamp carries): each field lands in its cell (the arguments are not specialized, so the
            # second launch compiles nothing).
            for cell_index, replayed in ((2, 0), (3, 1)):
                start_kernel[(1,)](start, num_warps=1)
                torch.cuda._sleep(100_000)  # a few tens of microseconds: the stamp must see time pass
                end_kernel[(1,)](start, probe, cell_index, 7, replayed, NUM_FIELDS, num_warps=1)
            torch.cuda.synchronize(device)
            (calls, ns, _, tokens, eager, eager_ns), (_, replay_ns, _, _, replays, replayed_ns) = (
                probe[2].tolist(),
                probe[3].tolist(),
            )
            if (
                (calls, tokens, eager, eager_ns, replays) != (1.0, 7.0, 0.0, 0.0, 1.0)
                or not 0 < ns < 1e9
                or replayed_ns != replay_ns
            ):
                raise RuntimeError(
                    f"stamp kernels wrote {probe[2:4].tolist()}, expected 1 eager call of 7 tokens in cell "
                    "2 and 1 replayed call in cell 3"
                )
            self.table = torch.zeros(NUM_CELLS, NUM_FIELDS, dtype=torch.float64).pin_memory()
            self._kernels, self._start, self._on_device = (start_kernel, end_kernel), start, True
        except Exception as exc:  # noqa: BLE001  timed on the host instead, and the record says why
            self.device_problem = f"{type(exc).__name__}: {exc}"

    # --- the bracket (hot path) ---

    def start(self, hidden_TD: torch.Tensor) -> int:
        """The token stop() takes: on the device, 1 where the call is being captured into a CUDA graph (then
        counted as replayed at every replay), else 0, asked before the start stamp so that an eager call's
        bracket holds no host work of the timer's; on the host, the start time in ns."""
        if hidden_TD.device.type == "cuda":
            if not self._on_device and self.device_problem is None:
                self.attach_device(hidden_TD.device)
            if self._on_device:
                replayed = int(torch.cuda.is_current_stream_capturing())
                self._kernels[0][(1,)](self._start, num_warps=1)
                return replayed
        return time.perf_counter_ns()

    def stop(self, started: int, hidden_TD: torch.Tensor) -> None:
        tokens = hidden_TD.shape[0]
        if tokens == 0:
            return
        cell = size_cell(tokens)
        if self._on_device and hidden_TD.device.type == "cuda":
            self._kernels[1][(1,)](
                self._start, self.table, cell, tokens, started, NUM_FIELDS, num_warps=1
            )  # started: whether the call is being captured (start())
        else:
            if hidden_TD.device.type == "cuda":
                if torch.cuda.is_current_stream_capturing():
                    return  # no host timing inside a graph capture (the record says timed_on host and why)
                torch.cuda.synchronize(hidden_TD.device)  # host timing on a device: the work must be done
            elapsed = float(time.perf_counter_ns() - started)
            # replayed 0: a host-timed call is never a graph replay (inside a capture it returned above)
            self.table[cell] += torch.tensor(
                [1.0, elapsed, elapsed * elapsed, float(tokens), 0.0, 0.0], dtype=torch.float64
            )
        self.file.start()

    # --- reading ---

    def snapshot(self) -> dict[str, Any]:
        record = {
            "backend": self.backend,
            "pid": os.getpid(),
            "rank": self.rank,
            "scope": self.scope,
            "max_tokens": self.max_tokens,
            "timed_on": "device" if self._on_device else "host",
            "fields": list(FIELDS),
            # Only the sizes called: [M, *FIELDS] each (the table has a row for every size up to the limit).
            "sizes": [
                [int(m), *self.table[m].tolist()] for m in self.table[:, 0].nonzero().flatten().tolist()
            ],
        }
        if self.device_problem is not None:
            record["device_problem"] = self.device_problem
        return record

    def flush(self) -> None:
        self.file.flush()
