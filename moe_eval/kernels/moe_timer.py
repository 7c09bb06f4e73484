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
graphs. An eager call's start stamp waits until the host has launched the whole call (the end stamp
included), so that its bracket holds the GPU's work back to back and none of the host's launch gaps
(kernels/_timer_kernels.py says why); a captured call's replays need no wait. What it adds to the measured
time: the gap between two graph nodes and the stamp kernel's own launch, the same for every row (not measured
apart; docs/perf.md, "Served speed"). On the CPU (eager) the bracket is time.perf_counter_ns() around the
call, which returns when the work is done.

One cell per size (TIMER_MAX_SIZE; larger calls share the last): the speed gate compares two rows size for
size, since within a dispatch range a call's time grows with its size and the mix of sizes differs between
runs.

After its clock reading the end stamp also counts the distinct experts the call's routing hit
(core/moe_timing: the speed gate compares two rows' calls of one size at the same routing) and, under
`--mutate slow_range`, delays the call by a share of its own time (kernels/_timer_kernels.py says how,
and why there).

On a GPU each eager call is followed by the yardstick (kernels/yardstick.py), a fixed chain of small matmuls
on the call's input, in a bracket of its own gated the same way, into a table of its own: what the same
server's pace does to a fixed piece of work, at each call size, for the speed gate's paired comparison. It
runs outside the call's bracket and after it; graph replays have none (their pace is the GPU's alone).
MOE_EVAL_YARDSTICK=0 turns it off.

A flusher thread (kernels/stats_file.py) writes <run dir>/moe-timing/<pid>.json (core/moe_timing.py reads it):
per size that was called, FIELDS (calls, nanoseconds, their squares, tokens, the replayed calls and their
nanoseconds, the experts hit, their squares and their products with the nanoseconds), since the process
started. The harness reads the files before and after its
timed workload and takes the difference.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from moe_eval.core.moe_timing import CALLS, CELL_FIELDS, FIELDS, NS, NS_SQ
from moe_eval.core.plugin_protocol import TIMER_MAX_SIZE
from moe_eval.kernels.stats_file import StatsFile
from moe_eval.kernels.yardstick import STEPS, WIDTH, Yardstick

NUM_CELLS = TIMER_MAX_SIZE + 1  # the pinned table: row M holds the calls of M tokens (row 0 unused)
NUM_FIELDS = len(FIELDS)
# An eager call's start stamp gives up waiting for the host after this long (10 ms outlasts a GIL switch of
# 5 ms), and the timer stops waiting after this many give-ups in a row (a host that blocks on the GPU inside
# the bracket); a lone one, such as a kernel compiled inside a call, resets with the next call that waited.
GATE_TIMEOUT_NS = 10_000_000
GATE_MAX_TIMEOUTS = 8


def size_cell(tokens: int) -> int:
    """The table's row of a call of `tokens` tokens: its size, or the last row for larger calls."""
    return min(tokens, TIMER_MAX_SIZE)


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
        # The yardstick's own sums per size (device only: its table is made where the timer attaches one).
        self.yardstick = Yardstick() if os.environ.get("MOE_EVAL_YARDSTICK", "1") != "0" else None
        self.yard_table: torch.Tensor | None = None
        self.yardstick_problem: str | None = None  # why it stopped while serving
        self.device_problem: str | None = None
        self._start: torch.Tensor | None = None  # the start stamp (device memory)
        self._clock: torch.Tensor | None = None  # a test's clock (see _timer_kernels)
        self._flags: torch.Tensor | None = None  # one per global expert id, zero between calls
        self._device_clock = True
        self._on_device = False
        # The eager calls' gate (stamp_gated_start_kernel): the host's release and the waits that gave up,
        # both in pinned host memory, and the ticket of the call in flight.
        self._release: torch.Tensor | None = None
        self._timeouts: torch.Tensor | None = None
        self._yard_timeouts: torch.Tensor | None = None  # the yardstick's give-ups: apart from the call's
        self._ticket = 0
        self._released = 0  # the newest ticket written to _release (the host's own copy: no read of it)
        self.gate_eager = (
            False  # on where attach_device found a CUDA device (tests turn it on in the interpreter)
        )
        self.gate_timeout_ns = GATE_TIMEOUT_NS
        self.gate_off: str | None = None  # why the gate was turned off while serving
        self._timeouts_seen = 0
        self._timeout_streak = 0
        self.rank: dict[str, Any] = {}
        self.max_tokens = 0  # the most tokens one call can carry (the sweep sizes its batched prefill by it)
        self.file = StatsFile(path, self.snapshot, "moe-eval-moe-timer")

    def attach_device(self, device: torch.device, device_clock: bool = True) -> None:
        """Compile and check the stamp kernels now (before vLLM's warm-up and graph capture ends).
        device_clock False: a test's clock (Triton's interpreter on the CPU; kernels/_timer_kernels.py)."""
        if self._on_device or self.device_problem is not None:
            return
        try:
            from moe_eval.kernels import _timer_kernels as k

            self._clock = torch.zeros(1, dtype=torch.int64, device=device)
            self._start = torch.zeros(1, dtype=torch.int64, device=device)
            self._flags = torch.zeros(k.EXPERT_FLAGS, dtype=torch.int32, device=device)
            self._device_clock = device_clock
            self._release = self._host_word(device)
            self._timeouts = self._host_word(device)
            self._yard_timeouts = self._host_word(device)
            probe = torch.zeros(4, NUM_FIELDS, dtype=torch.float64)
            probe = probe.pin_memory() if device.type == "cuda" else probe
            routing = torch.tensor([[0, 3], [3, 5]], dtype=torch.int32, device=device)
            # An eager call into cell 2 (replayed 0) routed to experts 0, 3, 5, and a replayed one into cell 3
            # (replayed 1, as a captured call's stamp carries) with no routing: each field lands in its cell.
            # The arguments are not specialized; the kernels compiled here are all a server runs (routing ids
            # of either integer width, cell 1 holding the int64 one's probe), none while serving.
            calls = ((1, 0, routing.long()), (2, 0, routing), (3, 1, None))
            for cell_index, replayed, ids in calls:
                self._launch_start()
                if device.type == "cuda":
                    torch.cuda._sleep(100_000)  # a few tens of microseconds: the stamp must see time pass
                self._launch_end(probe, cell_index, 7, replayed, ids, 0.0)
            # The gate's kernel, compiled now: a call the host released before it ran waits for nothing.
            self._ticket = self._released = 1
            self._release[0] = 1
            self._launch_gated_start(1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            eager, replay = dict(zip(FIELDS, probe[2].tolist())), dict(zip(FIELDS, probe[3].tolist()))
            wide = dict(zip(FIELDS, probe[1].tolist()))
            expected = {"calls": 1.0, "tokens": 7.0, "replayed": 0.0, "replayed_ns": 0.0, "experts": 3.0}
            if (
                any(eager[name] != value for name, value in expected.items())
                or (replay["replayed"], replay["experts"]) != (1.0, 0.0)
                or not 0 < eager["ns"] < 1e9
                or replay["replayed_ns"] != replay["ns"]
                or eager["experts_ns"] != 3.0 * eager["ns"]
                or (wide["calls"], wide["experts"]) != (1.0, 3.0)
                or self._flags.any()
                or int(self._timeouts[0]) != 0
            ):
                raise RuntimeError(
                    f"stamp kernels wrote {probe[2:4].tolist()}, expected 1 eager call of 7 tokens routed to "
                    "3 experts in cell 2 and 1 replayed call in cell 3 (and the expert flags cleared)"
                )
            self.table = torch.zeros(NUM_CELLS, NUM_FIELDS, dtype=torch.float64)
            self.table = self.table.pin_memory() if device.type == "cuda" else self.table
            if self.yardstick is not None:
                self.yard_table = torch.zeros_like(self.table)
                self.yard_table = self.yard_table.pin_memory() if device.type == "cuda" else self.yard_table
            self._on_device = True
            self.gate_eager = device.type == "cuda"
        except Exception as exc:  # noqa: BLE001  timed on the host instead, and the record says why
            self.device_problem = f"{type(exc).__name__}: {exc}"

    @staticmethod
    def _host_word(device: torch.device) -> torch.Tensor:
        """One int64 the host writes and the device reads (or the reverse) while kernels run: pinned."""
        word = torch.zeros(1, dtype=torch.int64)
        return word.pin_memory() if device.type == "cuda" else word

    def _launch_gated_start(self, ticket: int, timeouts: torch.Tensor | None = None) -> None:
        """timeouts: where a give-up is counted (the call's own word unless given)."""
        from moe_eval.kernels._timer_kernels import stamp_gated_start_kernel

        stamp_gated_start_kernel[(1,)](
            self._start, self._clock, self._release, ticket, self.gate_timeout_ns,
            self._timeouts if timeouts is None else timeouts,
            DEVICE_CLOCK=self._device_clock, num_warps=1,
        )  # fmt: skip

    def _launch_start(self) -> None:
        from moe_eval.kernels._timer_kernels import stamp_start_kernel

        stamp_start_kernel[(1,)](self._start, self._clock, DEVICE_CLOCK=self._device_clock, num_warps=1)

    def _launch_end(
        self, table: torch.Tensor, cell: int, tokens: int, replayed: int, topk_ids: Any, slow: float
    ) -> None:
        from moe_eval.kernels import _timer_kernels as k

        ids = topk_ids if topk_ids is not None else self._flags  # never read without COUNT_EXPERTS
        k.stamp_end_kernel[(1,)](
            self._start, self._clock, table, cell, tokens, replayed, ids,
            ids.numel() if topk_ids is not None else 0, self._flags, float(slow),
            FIELDS_PER_CELL=NUM_FIELDS, COUNT_EXPERTS=topk_ids is not None, FLAGS=k.EXPERT_FLAGS,
            BLOCK=k.COUNT_BLOCK, DEVICE_CLOCK=self._device_clock, num_warps=4,
        )  # fmt: skip

    # --- the bracket (hot path) ---

    def start(self, hidden_TD: torch.Tensor) -> int:
        """The token stop() takes: on the device, 1 where the call is being captured into a CUDA graph (then
        counted as replayed at every replay), else 0, asked before the start stamp so that an eager call's
        bracket holds no host work of the timer's; on the host, the start time in ns."""
        if hidden_TD.device.type == "cuda" and not self._on_device and self.device_problem is None:
            self.attach_device(hidden_TD.device)
        if self._on_device and hidden_TD.device.type == self._start.device.type:
            replayed = int(hidden_TD.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
            if replayed or not self._gate_on():
                self._launch_start()
            else:
                self._ticket += 1
                self._launch_gated_start(self._ticket)
            return replayed
        return time.perf_counter_ns()

    def _gate_on(self) -> bool:
        if not self.gate_eager:
            return False
        timeouts = int(self._timeouts.numpy()[0])  # numpy's view: no torch indexing on the hot path
        self._timeout_streak = (
            self._timeout_streak + timeouts - self._timeouts_seen if timeouts > self._timeouts_seen else 0
        )
        self._timeouts_seen = timeouts
        if self._timeout_streak >= GATE_MAX_TIMEOUTS:
            # gate_off first: the flusher thread's snapshot never sees the gate off without its reason
            self.gate_off = (
                f"{GATE_MAX_TIMEOUTS} eager calls in a row gave up waiting for the host "
                f"({self.gate_timeout_ns / 1e6:g} ms each): later eager calls are timed at the host's pace"
            )
            self.gate_eager = False
        return self.gate_eager

    def abandon(self) -> None:
        """The call between start() and stop() raised: release its start stamp now (it would wait its timeout
        out and count a give-up that was no fault of the host's pace)."""
        self._release_call()

    def _release_call(self) -> None:
        """The host has launched the whole call: its start stamp may read the clock. One ticket counter and
        one start stamp per timer: brackets on one timer never overlap (one thread runs a process's MoE
        layers in order; two overlapping would release each other early and share the start stamp)."""
        if self._release is not None and self._ticket > self._released:
            self._release.numpy()[0] = self._released = self._ticket

    def stop(self, started: int, hidden_TD: torch.Tensor, topk_ids: Any = None, slow: float = 0.0) -> None:
        """topk_ids: the call's routing (its distinct experts are counted, outside the bracket); slow:
        `--mutate slow_range` for this call, the fraction of its own time to add (0: none)."""
        tokens = hidden_TD.shape[0]
        if tokens == 0:
            self._release_call()
            return
        cell = size_cell(tokens)
        if self._on_device and hidden_TD.device.type == self._start.device.type:
            # started: whether the call is being captured (start())
            self._launch_end(self.table, cell, tokens, started, topk_ids, slow)
            self._release_call()  # after the end stamp's launch: the bracket holds no launch of the host's
            if not started and self.gate_eager and self.yard_table is not None:
                self._time_yardstick(hidden_TD, cell, tokens)
        else:
            if hidden_TD.device.type == "cuda":
                if torch.cuda.is_current_stream_capturing():
                    return  # no host timing inside a graph capture (the record says timed_on host and why)
                torch.cuda.synchronize(hidden_TD.device)  # host timing on a device: the work must be done
            now = time.perf_counter_ns()
            if slow > 0:
                until = started + (now - started) * (1.0 + slow)
                while now < until:
                    now = time.perf_counter_ns()
            elapsed = float(now - started)
            experts = float(torch.unique(topk_ids).numel()) if topk_ids is not None else 0.0
            # replayed 0: a host-timed call is never a graph replay (inside a capture it returned above)
            self.table[cell] += torch.tensor(
                [1.0, elapsed, elapsed * elapsed, float(tokens), 0.0, 0.0, experts, experts * experts,
                 experts * elapsed],
                dtype=torch.float64,
            )  # fmt: skip
        self.file.start()

    def _time_yardstick(self, hidden_TD: torch.Tensor, cell: int, tokens: int) -> None:
        """The yardstick on this eager call's hidden states, in a gated bracket of its own after the call's.
        Its give-ups are counted apart (they neither turn the call's gate off nor make the row's eager calls
        host-paced). Where it raises (out of memory at a large call), the request goes on and the yardstick
        stops, the record saying why."""
        assert self.yardstick is not None and self.yard_table is not None
        try:
            self.yardstick.prepare(hidden_TD)  # weights made, and a new size run once, outside the bracket
            self._ticket += 1
            self._launch_gated_start(self._ticket, self._yard_timeouts)
            self.yardstick.run(hidden_TD)
            self._launch_end(self.yard_table, cell, tokens, 0, None, 0.0)
        except Exception as exc:  # noqa: BLE001  the served request must not fail for the timer's sake
            self.yardstick_problem = f"{type(exc).__name__}: {str(exc)[:200]}"
            self.yard_table = None
        finally:
            self._release_call()

    # --- reading ---

    def snapshot(self) -> dict[str, Any]:
        # The stamp before the copy: a copy stamped after the harness's mark holds every call made before it
        # (stamped after the copy, a flusher held up between the two would pass a copy older than its stamp).
        copied_at = time.time()
        # One copy of each table first: the serving thread (or the GPU) adds to them while this runs, and
        # nonzero() over a table that changes between its two passes fails torch's internal assert (seen once
        # on the CPU: it killed the flusher, and the row's timed window read no call).
        table = self.table.clone()
        called = table[:, 0].nonzero().flatten().tolist()
        yard_table = self.yard_table  # the hot path may drop it (a yardstick that raised)
        yard = yard_table[called][:, [CALLS, NS, NS_SQ]].tolist() if yard_table is not None else None
        record = {
            "backend": self.backend,
            "pid": os.getpid(),
            "rank": self.rank,
            "scope": self.scope,
            "max_tokens": self.max_tokens,
            "timed_on": "device" if self._on_device else "host",
            "eager_bracket": self._eager_bracket(),
            # counted since the process started: the harness takes the timed window's (core/moe_timing.since)
            "gate_timeouts": int(self._timeouts[0]) if self._timeouts is not None else 0,
            "fields": list(CELL_FIELDS),
            # Only the sizes called: [M, *CELL_FIELDS] each (the table has a row for every size up to the
            # limit).
            "sizes": [
                [int(m), *table[m].tolist(), *(yard[i] if yard is not None else [0.0, 0.0, 0.0])]
                for i, m in enumerate(called)
            ],
            "yardstick": self._yardstick_text(),
            "yardstick_timeouts": int(self._yard_timeouts[0]) if self._yard_timeouts is not None else 0,
            # When this copy was taken (wall clock, seconds; at most this early): the harness reads the tables
            # once every process has copied them after its last request returned, instead of waiting two
            # intervals blind. It makes every tick's record new, so the file is rewritten at every tick.
            "snapshot_at": copied_at,
        }
        if self.device_problem is not None:
            record["device_problem"] = self.device_problem
        return record

    def _yardstick_text(self) -> str:
        if self.yardstick_problem is not None:
            return f"stopped: {self.yardstick_problem}"
        if self.yard_table is None:
            return "off (MOE_EVAL_YARDSTICK=0)" if self.yardstick is None else "not run: host timing"
        return f"after each gated eager call: {2 * STEPS} matmuls, M x D through D x {WIDTH} and back"

    def _eager_bracket(self) -> str:
        if not self._on_device:
            return "host clock"
        if not self.gate_eager and self.gate_off is None:
            return "host-paced: the start stamp runs as soon as the GPU reaches it"
        text = "gated: the start stamp waits for the host's last launch of the call"
        timeouts = int(self._timeouts[0]) if self._timeouts is not None else 0
        if timeouts:
            text += f"; {timeouts} waits gave up"
        return text + (f"; then turned off: {self.gate_off}" if self.gate_off else "")

    def flush(self) -> None:
        self.file.flush()
