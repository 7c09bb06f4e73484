"""The MoE timer's files (kernels/moe_timer.py) as the harness reads them: no torch, no vLLM.

Each process of a server writes <run dir>/moe-timing/<pid>.json: per dispatch range the calls, nanoseconds,
their squares, tokens, and the calls that were CUDA-graph replays with their nanoseconds (FIELDS) since it
started. `read_folder` reads them, `since(after, before)` keeps what a workload added between two readings,
and `summarize` gives per range the mean time of one call (the slowest rank's, where the layout has several:
a step waits for it), how many calls were replays and what share of the time was not: what the speed gate
compares.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from moe_eval.core.plugin_protocol import MOE_TIMING_DIR, layer_range_names

# replayed, replayed_ns: the calls that were CUDA-graph replays (a call captured into a graph counts at each
# replay) and their time; the rest ran eagerly, launched by the host inside the timer's bracket.
FIELDS = ("calls", "ns", "ns_sq", "tokens", "replayed", "replayed_ns")
CALLS, NS, NS_SQ, TOKENS, REPLAYED, REPLAYED_NS = range(len(FIELDS))


@dataclass(frozen=True)
class ProcessTiming:
    pid: int
    backend: str
    scope: str
    timed_on: str  # "device" (every call, CUDA-graph replays included) or "host"
    rank: dict[str, Any]
    table: tuple[tuple[float, ...], ...]  # per range: FIELDS
    device_problem: str | None = None
    max_tokens: int = 0  # the most tokens one call of the process can carry


@dataclass(frozen=True)
class RangeTiming:
    """One dispatch range's MoE calls in the timed workload."""

    range: str
    calls: int  # over every process
    tokens: int
    mean_us: float  # per call: the slowest process's mean (one process: its own)
    spread_us: float  # that process's standard deviation of one call (calls differ in M within a range)
    us_per_token: float
    # Calls that were CUDA-graph replays, over every process; None in records written before it was counted.
    replayed: int | None = None
    # The share of the mean's process's time in calls that were not replays (eager calls, whose time moves
    # between servers: gates/speed.py); None in records written before it was counted.
    eager_share: float | None = None


@dataclass(frozen=True)
class TimingSummary:
    processes: int
    timed_on: tuple[str, ...]
    scopes: tuple[str, ...]
    backends: tuple[str, ...]
    ranges: tuple[RangeTiming, ...]
    problems: tuple[str, ...] = ()

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
            ranges=tuple(RangeTiming(**r) for r in data.get("ranges", ())),
            problems=tuple(data.get("problems", ())),
        )


def read_folder(run_dir: Path) -> list[ProcessTiming]:
    """Every process's last flushed table (a file being replaced or unreadable is left out)."""
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
                    table=tuple(tuple(float(v) for v in row) for row in data["table"]),
                    device_problem=data.get("device_problem"),
                    max_tokens=int(data.get("max_tokens") or 0),
                )
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def since(after: list[ProcessTiming], before: list[ProcessTiming]) -> list[ProcessTiming]:
    """What each process added between two readings (a process new since `before` counts whole)."""
    earlier = {p.pid: p for p in before}
    out = []
    for process in after:
        prior = earlier.get(process.pid)
        if prior is not None:
            table = tuple(
                tuple(a - b for a, b in zip(row, old, strict=True))
                for row, old in zip(process.table, prior.table, strict=True)
            )
            process = ProcessTiming(**{**asdict(process), "table": table})
        out.append(process)
    return out


def summarize(processes: list[ProcessTiming]) -> TimingSummary:
    names = layer_range_names()
    ranges = []
    for i, name in enumerate(names):
        rows = [p.table[i] for p in processes if i < len(p.table) and p.table[i][0] > 0]
        if not rows:
            continue
        # The slowest process's mean call: under TP and EP every rank's call of a step ends before the next
        # layer, so the step waits for it.
        slowest = max(rows, key=lambda row: row[NS] / row[CALLS])
        calls, ns, ns_sq = slowest[CALLS], slowest[NS], slowest[NS_SQ]
        mean = ns / calls
        variance = max(ns_sq / calls - mean * mean, 0.0)
        total_calls = int(sum(row[CALLS] for row in rows))
        tokens = int(sum(row[TOKENS] for row in rows))
        ranges.append(
            RangeTiming(
                range=name,
                calls=total_calls,
                tokens=tokens,
                mean_us=round(mean / 1e3, 3),
                spread_us=round(math.sqrt(variance) / 1e3, 3),
                us_per_token=round(sum(row[NS] for row in rows) / 1e3 / max(tokens, 1), 4),
                replayed=int(sum(row[REPLAYED] for row in rows)),
                eager_share=round(min(max(1 - slowest[REPLAYED_NS] / ns, 0.0), 1.0), 4) if ns > 0 else None,
            )
        )
    return TimingSummary(
        processes=len(processes),
        timed_on=tuple(sorted({p.timed_on for p in processes})),
        scopes=tuple(sorted({p.scope for p in processes})),
        backends=tuple(sorted({p.backend for p in processes})),
        ranges=tuple(ranges),
        problems=tuple(p.device_problem for p in processes if p.device_problem),
    )
