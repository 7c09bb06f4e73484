"""The MoE timer's files (kernels/moe_timer.py) as the harness reads them: no torch, no vLLM.

Each process of a server writes <run dir>/moe-timing/<pid>.json: per call size M that was called, the calls,
nanoseconds, their squares, tokens, and the calls that were CUDA-graph replays with their nanoseconds (FIELDS)
since it started. `read_folder` reads them, `since(after, before)` keeps what a workload added between two
readings, and `summarize` gives per dispatch range its calls and mean call (the slowest rank's, where the
layout has several: a step waits for it) and, per size inside it, the slowest rank's calls, mean and spread:
what the speed gate compares, size for size.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from moe_eval.core.payload import described
from moe_eval.core.plugin_protocol import MOE_TIMING_DIR, layer_range_index, layer_range_names

# replayed, replayed_ns: the calls that were CUDA-graph replays (a call captured into a graph counts at each
# replay) and their time; the rest ran eagerly, launched by the host inside the timer's bracket.
# experts, experts_sq, experts_ns: the distinct experts each call's routing hit, summed, with their squares
# and their products with the call's ns (0 where the timer was not given the routing).
FIELDS = ("calls", "ns", "ns_sq", "tokens", "replayed", "replayed_ns", "experts", "experts_sq", "experts_ns")
CALLS, NS, NS_SQ, TOKENS, REPLAYED, REPLAYED_NS, EXPERTS, EXPERTS_SQ, EXPERTS_NS = range(len(FIELDS))
# The yardstick's calls, nanoseconds and their squares: a fixed chain of matmuls the timer runs in its own
# bracket right after each eager call of the size (kernels/yardstick.py), so that a server's own pace can be
# told from the kernel's (the speed gate's paired comparison). Zeros where it did not run (graph replays, the
# CPU, a file from before it).
YARD_FIELDS = ("yard_calls", "yard_ns", "yard_ns_sq")
YARD_CALLS, YARD_NS, YARD_NS_SQ = range(len(FIELDS), len(FIELDS) + len(YARD_FIELDS))
CELL_FIELDS = FIELDS + YARD_FIELDS  # a size's cell as the timer's file writes it

Cell = tuple[float, ...]  # CELL_FIELDS of one size (or of a range: the sum of its sizes)


@dataclass(frozen=True)
class ProcessTiming:
    pid: int
    backend: str
    scope: str
    timed_on: str  # "device" (every call, CUDA-graph replays included) or "host"
    rank: dict[str, Any]
    sizes: dict[int, Cell]  # call size M -> FIELDS
    device_problem: str | None = None
    max_tokens: int = 0  # the most tokens one call of the process can carry
    eager_bracket: str | None = None  # how its eager calls were bracketed (kernels/moe_timer); None: before
    gate_timeouts: int | None = None  # eager calls whose gated start gave up waiting; None: not counted
    yardstick: str | None = None  # how the yardstick ran (kernels/moe_timer); None: a file from before it
    yardstick_timeouts: int | None = None  # its gated starts that gave up; None: not counted
    snapshot_at: float | None = None  # when the process copied its table (wall clock); None: before the stamp

    def range_cells(self) -> dict[str, Cell]:
        """FIELDS per dispatch range: the sum of its sizes."""
        names = layer_range_names()
        out: dict[str, list[float]] = {}
        for size, cell in self.sizes.items():
            total = out.setdefault(names[layer_range_index(size)], [0.0] * len(CELL_FIELDS))
            for i, value in enumerate(cell):
                total[i] += value
        return {name: tuple(values) for name, values in out.items()}


@dataclass(frozen=True)
class SizeTiming:
    """The calls of one size M in a dispatch range, on the rank whose mean call of that size was slowest."""

    tokens: int = described("the call size M (the timer's last cell holds every larger call)")
    calls: int = described("that rank's calls of this size")
    mean_us: float = described("their mean, us")
    spread_us: float = described("one call's standard deviation, us")
    replayed: int = described("of them, CUDA-graph replays", newer=True)
    # At real shapes a decode call's time follows how many experts' weights it reads, so two rows compare at
    # one routing: the experts counted, and a line of time against them.
    experts: float | None = described(
        "the mean distinct experts the calls' routing hit (null: not counted)", None, newer=True
    )
    experts_spread: float | None = described("their standard deviation", None, newer=True)
    slope_us: float | None = described(
        "the calls' line of time against the experts hit: us per expert", None, newer=True
    )
    residual_us: float | None = described(
        "one call's standard deviation about that line (the speed gate's error where counted)",
        None,
        newer=True,
    )
    yard_calls: int = described(
        "the yardstick's calls timed beside them in the same server (0: it did not run)", 0, newer=True
    )
    yard_mean_us: float | None = described(
        "the yardstick's mean, us (null: it did not run)", None, newer=True
    )
    yard_spread_us: float | None = described("one yardstick call's standard deviation, us", None, newer=True)


@dataclass(frozen=True)
class RangeTiming:
    """One dispatch range's MoE calls in the timed workload."""

    range: str = described("the dispatch range, e.g. M=17-64 (tokens per call)")
    calls: int = described("calls, over every process")
    tokens: int = described("tokens, over every process")
    mean_us: float = described("per call: the slowest process's mean (one process: its own)")
    spread_us: float = described("that process's standard deviation of one call (the range mixes sizes)")
    us_per_token: float = described("every process's time / tokens")
    replayed: int | None = described(
        "calls that were CUDA-graph replays, over every process (null: a record before the count)",
        None,
        newer=True,
    )
    eager_share: float | None = described(
        "the share of the slowest process's time in calls that were not replays (null: before the count)",
        None,
        newer=True,
    )
    sizes: tuple[SizeTiming, ...] | None = described(
        "per call size, the slowest rank's calls: what the speed gate compares (null before schema 9)",
        None,
        newer=True,
    )
    rank_calls: int | None = described(
        "the fewest calls one rank made in the range (0: a rank made none)", None, newer=True
    )


@dataclass(frozen=True)
class TimingSummary:
    """The timed workload's MoE calls per dispatch range (captures.timing.moe)."""

    processes: int = described("server processes whose timer was read")
    timed_on: tuple[str, ...] = described("device (every call, CUDA-graph replays included) or host")
    scopes: tuple[str, ...] = described("what the timer bracketed, per process")
    backends: tuple[str, ...] = described("the MoE kernels timed")
    ranges: tuple[RangeTiming, ...] = described("the ranges the workload reached")
    problems: tuple[str, ...] = described("why a process could not time on the device", ())
    eager_brackets: tuple[str, ...] = described(
        "how the eager calls' bracket began, per process: gated (after the host's last launch of the "
        "call) or host-paced (the host's launch gaps inside)",
        (),
        newer=True,
    )
    gate_timeouts: int | None = described(
        "eager calls of the timed workload whose gated start stamp gave up waiting for the host (their "
        "bracket holds host gaps), summed over processes; null: not counted",
        None,
        newer=True,
    )
    yardsticks: tuple[str, ...] = described(
        "how the yardstick ran beside the eager calls, per process (kernels/yardstick.py)", (), newer=True
    )
    yardstick_timeouts: int | None = described(
        "the yardstick's gated starts of the timed workload that gave up waiting for the host, summed over "
        "processes (a row with any is not read against it); null: not counted",
        None,
        newer=True,
    )

    def by_range(self) -> dict[str, RangeTiming]:
        return {r.range: r for r in self.ranges}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TimingSummary:
        return cls(
            processes=int(data["processes"]),
            timed_on=tuple(data.get("timed_on", ())),
            scopes=tuple(data.get("scopes", ())),
            backends=tuple(data.get("backends", ())),
            ranges=tuple(_range_from_dict(r) for r in data.get("ranges", ())),
            problems=tuple(data.get("problems", ())),
            eager_brackets=tuple(data.get("eager_brackets", ())),
            gate_timeouts=data.get("gate_timeouts"),
            yardsticks=tuple(data.get("yardsticks", ())),
            yardstick_timeouts=data.get("yardstick_timeouts"),
        )


def _range_from_dict(data: dict[str, Any]) -> RangeTiming:
    sizes = data.get("sizes")
    timing = RangeTiming(**{k: v for k, v in data.items() if k != "sizes"})
    if sizes is None:
        return timing
    return replace(timing, sizes=tuple(SizeTiming(**s) for s in sizes))


def read_folder(run_dir: Path) -> list[ProcessTiming]:
    """Every process's last flushed table (a file being replaced, unreadable, or written by a timer from
    before per-size cells is left out)."""
    found = []
    for path in sorted((run_dir / MOE_TIMING_DIR).glob("*.json")):
        try:
            data = json.loads(path.read_text())
            found.append(
                ProcessTiming(
                    pid=int(data["pid"]),
                    backend=str(data["backend"]),
                    scope=str(data["scope"]),
                    timed_on=str(data["timed_on"]),
                    rank=dict(data.get("rank") or {}),
                    sizes={int(row[0]): _cell(row[1:]) for row in data["sizes"]},
                    device_problem=data.get("device_problem"),
                    max_tokens=int(data.get("max_tokens") or 0),
                    eager_bracket=data.get("eager_bracket"),
                    gate_timeouts=data.get("gate_timeouts"),
                    yardstick=data.get("yardstick"),
                    yardstick_timeouts=data.get("yardstick_timeouts"),
                    snapshot_at=data.get("snapshot_at"),
                )
            )
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            continue
    return found


def _cell(values: list[Any]) -> Cell:
    """A file's cell as CELL_FIELDS (a file from before the routing was counted, or the yardstick, has fewer:
    zeros for those)."""
    cell = [float(v) for v in values][: len(CELL_FIELDS)]
    return tuple(cell + [0.0] * (len(CELL_FIELDS) - len(cell)))


def since(after: list[ProcessTiming], before: list[ProcessTiming]) -> list[ProcessTiming]:
    """What each process added between two readings (a process new since `before` counts whole); a size it
    did not call meanwhile is left out."""
    earlier = {p.pid: p for p in before}
    out = []
    for process in after:
        prior = earlier.get(process.pid)
        if prior is not None:
            sizes = {}
            for size, cell in process.sizes.items():
                earlier_cell = prior.sizes.get(size, (0.0,) * len(cell))
                added = tuple(a - b for a, b in zip(cell, earlier_cell, strict=True))
                if added[CALLS] > 0:
                    sizes[size] = added
            timeouts = process.gate_timeouts
            if timeouts is not None and prior.gate_timeouts is not None:
                timeouts -= prior.gate_timeouts
            yard_timeouts = process.yardstick_timeouts
            if yard_timeouts is not None and prior.yardstick_timeouts is not None:
                yard_timeouts -= prior.yardstick_timeouts
            process = replace(process, sizes=sizes, gate_timeouts=timeouts, yardstick_timeouts=yard_timeouts)
        out.append(process)
    return out


def _mean_and_spread(cell: Cell, calls: int = CALLS, ns: int = NS, ns_sq: int = NS_SQ) -> tuple[float, float]:
    """One call's mean and standard deviation, ns (of the yardstick's calls with its fields' indices)."""
    mean = cell[ns] / cell[calls]
    return mean, math.sqrt(max(cell[ns_sq] / cell[calls] - mean * mean, 0.0))


def _yardstick(cell: Cell) -> dict[str, Any]:
    """The yardstick's calls, mean and spread in a size's cell (us; none where it did not run)."""
    if len(cell) <= YARD_CALLS or cell[YARD_CALLS] <= 0:  # a cell made before the yardstick has no fields
        return {}
    mean, spread = _mean_and_spread(cell, YARD_CALLS, YARD_NS, YARD_NS_SQ)
    return {
        "yard_calls": int(cell[YARD_CALLS]),
        "yard_mean_us": round(mean / 1e3, 3),
        "yard_spread_us": round(spread / 1e3, 3),
    }


def _routing_line(cell: Cell) -> dict[str, float | None]:
    """The cell's experts (mean, spread) and its least-squares line of time on them: slope (us per expert) and
    the residual standard deviation of one call (n - 2 degrees of freedom; where the experts never varied,
    the calls' own standard deviation, n - 1). Nones where no routing was counted."""
    n = cell[CALLS]
    if cell[EXPERTS] <= 0:
        return {"experts": None, "experts_spread": None, "slope_us": None, "residual_us": None}
    mean_t, mean_d = cell[NS] / n, cell[EXPERTS] / n
    s_tt = max(cell[NS_SQ] - n * mean_t * mean_t, 0.0)
    s_dd = max(cell[EXPERTS_SQ] - n * mean_d * mean_d, 0.0)
    s_td = cell[EXPERTS_NS] - n * mean_t * mean_d
    if s_dd > 1e-9 and n > 2:
        slope = s_td / s_dd
        residual = math.sqrt(max(s_tt - slope * s_td, 0.0) / (n - 2))
    else:
        slope, residual = 0.0, math.sqrt(s_tt / (n - 1)) if n > 1 else 0.0
    return {
        "experts": round(mean_d, 3),
        "experts_spread": round(math.sqrt(s_dd / n), 3),
        "slope_us": round(slope / 1e3, 4),
        "residual_us": round(residual / 1e3, 4),
    }


def _slowest_sizes(processes: list[ProcessTiming], sizes: list[int]) -> tuple[SizeTiming, ...]:
    out = []
    for size in sorted(sizes):
        cells = [p.sizes[size] for p in processes if p.sizes.get(size, (0.0,))[CALLS] > 0]
        slowest = max(cells, key=lambda cell: cell[NS] / cell[CALLS])
        mean, spread = _mean_and_spread(slowest)
        calls, replayed = int(slowest[CALLS]), int(slowest[REPLAYED])
        more: dict[str, Any] = {**_routing_line(slowest), **_yardstick(slowest)}
        out.append(SizeTiming(size, calls, round(mean / 1e3, 3), round(spread / 1e3, 3), replayed, **more))
    return tuple(out)


def summarize(processes: list[ProcessTiming]) -> TimingSummary:
    names = layer_range_names()
    per_process = [p.range_cells() for p in processes]
    ranges = []
    for name in names:
        rows = [cells[name] for cells in per_process if cells.get(name, (0.0,))[CALLS] > 0]
        if not rows:
            continue
        # The slowest process's mean call: under TP and EP every rank's call of a step ends before the next
        # layer, so the step waits for it.
        slowest = max(rows, key=lambda row: row[NS] / row[CALLS])
        mean, spread = _mean_and_spread(slowest)
        ns = slowest[NS]
        tokens = int(sum(row[TOKENS] for row in rows))
        sizes = sorted(
            {size for p in processes for size in p.sizes if names[layer_range_index(size)] == name}
        )
        ranges.append(
            RangeTiming(
                range=name,
                calls=int(sum(row[CALLS] for row in rows)),
                tokens=tokens,
                mean_us=round(mean / 1e3, 3),
                spread_us=round(spread / 1e3, 3),
                us_per_token=round(sum(row[NS] for row in rows) / 1e3 / max(tokens, 1), 4),
                replayed=int(sum(row[REPLAYED] for row in rows)),
                eager_share=round(min(max(1 - slowest[REPLAYED_NS] / ns, 0.0), 1.0), 4) if ns > 0 else None,
                sizes=_slowest_sizes(processes, sizes),
                # A rank that made no call here has no row: under TP every rank makes every call.
                rank_calls=int(min(row[CALLS] for row in rows)) if len(rows) == len(processes) else 0,
            )
        )
    return TimingSummary(
        processes=len(processes),
        timed_on=tuple(sorted({p.timed_on for p in processes})),
        scopes=tuple(sorted({p.scope for p in processes})),
        backends=tuple(sorted({p.backend for p in processes})),
        ranges=tuple(ranges),
        problems=tuple(p.device_problem for p in processes if p.device_problem),
        # A process whose timer did not say (a file from before the gate) is never counted as gated.
        eager_brackets=tuple(sorted({p.eager_bracket or "not recorded" for p in processes})),
        gate_timeouts=(
            sum(p.gate_timeouts or 0 for p in processes)
            if all(p.gate_timeouts is not None for p in processes)
            else None
        ),
        yardsticks=tuple(sorted({p.yardstick for p in processes if p.yardstick})),
        yardstick_timeouts=(
            sum(p.yardstick_timeouts or 0 for p in processes)
            if all(p.yardstick_timeouts is not None for p in processes)
            else None
        ),
    )
