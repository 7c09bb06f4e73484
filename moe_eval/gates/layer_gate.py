"""The layer check's verdict: the served MoE calls against the exact MoE, per dispatch range and per expert.

Reads the sums every bundled-kernel process wrote (moe_eval.kernels.layer_check: <run>/layer-check/<pid>.json)
and judges them with three checks:

- `layer_check_coverage`: every dispatch range the server can produce (a call of up to its batched-token
  limit) was sampled, at least MIN_ROWS rows: a range nobody compared is not a pass.
- `layer_check_ranges`: per range and rank, the served output's RMS error against the exact MoE is no worse
  than the incumbent's arithmetic on the same rows (layer_check.py says what stands in for vLLM's kernel)
  by more than the margin: error / incumbent's error <= 1 + layer_check_margin.
- `layer_check_experts`: per range, rank and expert, the scale estimate s = sum a / sum b (a kernel whose
  expert e is off by a factor 1 + s gives s). It fails when |s| > layer_check_scale_bound, |s| is above the
  incumbent arithmetic's own estimate on the same slots, and their difference is at least layer_check_z
  standard errors (the variance the rows' own served - incumbent residuals imply). Against the incumbent,
  not against zero: an expert that carries a tiny share of its rows is estimated from rounding alone, and a
  kernel rounding like the incumbent then has the incumbent's estimate (seen on the H200: a correct
  kernel's s = -0.32 +- 0.07 over 4 slots, judged against zero, was 0.5 standard errors from failing).
  The same cells pooled over ranks are judged too.

No torch: plain arithmetic on the JSON sums.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moe_eval.core.check import Check
from moe_eval.core.plugin_protocol import LAYER_CHECK_DIR, LAYER_RANGE_EDGES, layer_range_names

MIN_ROWS = 8  # rows a range needs before its error ratio is judged (and before it counts as covered)
# Slots of one expert in one range before its scale estimate is judged. Each slot's variance comes from its
# own row's residuals, one draw per element; where an expert's output sits in a few outlier dimensions of a
# trained model that is a draw of few degrees of freedom, and with a handful of slots it can read several
# times too small. Measured on the CPU canary, correct kernel: an expert with 9 slots in M=1024-4095 read
# z = 4.5 (s = +0.16, a tiny share of its rows), another with 6 slots z = 4.1; no cell of 20 slots or more
# was off the bound and beyond the incumbent at all (CPU TP1 and TEP, H200 TP1). The 1% bugs' cells had 25 to
# 855 slots.
MIN_SLOTS = 20


@dataclass(frozen=True)
class LayerCheckLimits:
    margin: float  # error / incumbent's error may reach 1 + margin
    scale_bound: float  # |s| above this fails (with the z below)
    z: float  # ... when |s| / se is at least this


@dataclass
class RangeRow:
    """One dispatch range on one rank ('all' pooled over ranks)."""

    range: str
    rank: str
    calls_seen: int
    calls_sampled: int
    rows: int
    error: float | None  # RMS |served - exact| / RMS |exact|
    incumbent_error: float | None  # the same for the incumbent's arithmetic
    ratio: float | None  # error / incumbent_error
    nonfinite: int = 0  # served output elements that were NaN or inf where the exact MoE was finite


@dataclass
class ExpertCell:
    range: str
    rank: str
    expert: int
    slots: int
    scale: float  # s: the expert's output is (1 + s) times the exact one
    stderr: float  # of s, from the served residuals
    incumbent_scale: float  # the incumbent arithmetic's s on the same slots
    diff_stderr: float  # of scale - incumbent_scale

    @property
    def z(self) -> float:
        """|s - s_incumbent| in standard errors of the difference (0 when they agree exactly)."""
        diff = abs(self.scale - self.incumbent_scale)
        if diff == 0:
            return 0.0
        return diff / self.diff_stderr if self.diff_stderr > 0 else math.inf

    def off(self, limits: LayerCheckLimits) -> bool:
        return (
            abs(self.scale) > limits.scale_bound
            and abs(self.scale) > abs(self.incumbent_scale)
            and self.z >= limits.z
        )


@dataclass
class LayerSummary:
    processes: int
    counted_on: list[str]
    max_tokens: int  # the most tokens one call can carry (the server's batched-token limit)
    ranges: list[RangeRow] = field(default_factory=list)
    experts: list[ExpertCell] = field(default_factory=list)


def read_layer_files(run_dir: Path) -> list[dict[str, Any]]:
    folder = Path(run_dir) / LAYER_CHECK_DIR
    records = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # a flusher caught mid-rename cannot happen (atomic), but a foreign file is no record
    return records


def _rank_name(record: dict[str, Any]) -> str:
    rank = record.get("rank") or {}
    if rank.get("use_ep"):
        return f"EP{rank.get('ep_rank', 0)}/{rank.get('ep_size', 1)}"
    return f"TP{rank.get('tp_rank', 0)}/{rank.get('tp_size', 1)}" + (
        f" DP{rank.get('dp_rank', 0)}" if rank.get("dp_size", 1) > 1 else ""
    )


def _cell(name: str, rank: str, expert: int, sums: list[float]) -> ExpertCell:
    """s = sum a / sum b with its standard error sqrt(sum vb) / sum b, the incumbent's s, and the standard
    error of the difference, sqrt(sum vd) / sum b: each slot's variance implied by its own row's residual
    (layer_check.py). Not the spread of a / b over slots: where one slot carries most of sum b, that spread
    is near zero while the estimate is one slot's noise (a correct kernel's -0.021 +- 0.002 over 10 slots on
    the CPU canary, when it was used)."""
    n, a, b, vb, a_inc, vd = sums
    if b <= 0:
        return ExpertCell(name, rank, expert, int(n), 0.0, math.inf, 0.0, math.inf)
    return ExpertCell(
        name, rank, expert, int(n), a / b, math.sqrt(max(vb, 0.0)) / b, a_inc / b, math.sqrt(max(vd, 0.0)) / b
    )


def _range_row(name: str, rank: str, seen: int, sums: list[float]) -> RangeRow:
    calls, rows, sq_res, sq_exact, sq_ref, nonfinite = sums
    error = math.sqrt(sq_res / sq_exact) if sq_exact > 0 else None
    incumbent = math.sqrt(sq_ref / sq_exact) if sq_exact > 0 else None
    if error is None or incumbent is None:
        ratio = None
    elif incumbent > 0:
        ratio = error / incumbent
    else:
        ratio = 1.0 if error == 0 else math.inf
    return RangeRow(name, rank, seen, int(calls), int(rows), error, incumbent, ratio, int(nonfinite))


def summarize(records: list[dict[str, Any]]) -> LayerSummary:
    names = layer_range_names()
    summary = LayerSummary(
        processes=len(records),
        counted_on=sorted({r.get("counted_on", "?") for r in records}),
        max_tokens=max((int(r.get("max_tokens", 0)) for r in records), default=0),
    )
    pooled_range = [[0.0] * 6 for _ in names]
    pooled_seen = [0] * len(names)
    pooled_expert: dict[tuple[int, int], list[float]] = {}
    for record in sorted(records, key=_rank_name):
        rank = _rank_name(record)
        for i, name in enumerate(names):
            sums = record["range_sums"][i]
            seen = int(record["seen"][i])
            pooled_seen[i] += seen
            pooled_range[i] = [x + y for x, y in zip(pooled_range[i], sums, strict=True)]
            if len(records) > 1 and sums[0] > 0:
                summary.ranges.append(_range_row(name, rank, seen, sums))
            for expert, cell in record["expert_sums"][i].items():
                key = (i, int(expert))
                pooled_expert[key] = [
                    x + y for x, y in zip(pooled_expert.get(key, [0.0] * 6), cell, strict=True)
                ]
                if len(records) > 1:
                    summary.experts.append(_cell(name, rank, int(expert), cell))
    for i, name in enumerate(names):
        if pooled_range[i][0] > 0 or pooled_seen[i] > 0:
            summary.ranges.append(_range_row(name, "all", pooled_seen[i], pooled_range[i]))
    for (i, expert), cell in sorted(pooled_expert.items()):
        summary.experts.append(_cell(names[i], "all", expert, cell))
    return summary


def reachable_ranges(max_tokens: int) -> list[str]:
    """The ranges a server whose calls carry up to max_tokens tokens can produce."""
    return [
        name for name, low in zip(layer_range_names(), LAYER_RANGE_EDGES, strict=True) if low <= max_tokens
    ]


def layer_checks(summary: LayerSummary, limits: LayerCheckLimits) -> list[Check]:
    if summary.processes == 0:
        return [
            Check(
                "layer_check_coverage",
                False,
                "no process of the server wrote layer-check sums (<run>/layer-check/): the MoE calls were "
                "compared with nothing",
            )
        ]
    pooled = {row.range: row for row in summary.ranges if row.rank == "all"}
    wanted = reachable_ranges(summary.max_tokens)
    missing = [name for name in wanted if pooled.get(name) is None or pooled[name].rows < MIN_ROWS]
    covered = ", ".join(f"{name} {pooled[name].rows} rows" for name in wanted if name not in missing)
    coverage = Check(
        "layer_check_coverage",
        not missing,
        f"dispatch ranges up to the server's {summary.max_tokens} tokens per call: "
        f"{covered or 'none'} sampled"
        + (f"; NOT SAMPLED (< {MIN_ROWS} rows): {', '.join(missing)}" if missing else ""),
    )
    judged = [row for row in summary.ranges if row.rows >= MIN_ROWS and row.ratio is not None]
    worse = [row for row in judged if row.ratio > 1 + limits.margin or row.nonfinite]
    worst = max(judged, key=lambda row: row.ratio, default=None)
    ranges = Check(
        "layer_check_ranges",
        not worse,
        (
            f"error against the exact MoE / the incumbent's, limit {1 + limits.margin:.2f}: "
            + (
                "; ".join(_describe_range(row) for row in worse)
                if worse
                else f"worst {_describe_range(worst)}"
                if worst
                else "no range judged"
            )
        ),
    )
    cells = [cell for cell in summary.experts if cell.slots >= MIN_SLOTS]
    off = [c for c in cells if c.off(limits)]
    biggest = max(cells, key=lambda c: abs(c.scale), default=None)
    experts = Check(
        "layer_check_experts",
        not off,
        (
            f"per-expert scale of the served output against the exact MoE, limit +-{limits.scale_bound:g} "
            f"and beyond the incumbent's by z >= {limits.z:g}, over {len(cells)} cells: "
            + (
                "; ".join(_describe_cell(c) for c in sorted(off, key=lambda c: -abs(c.scale))[:6])
                + (f" (+{len(off) - 6} more)" if len(off) > 6 else "")
                if off
                else f"largest {_describe_cell(biggest)}"
                if biggest
                else "no cell judged"
            )
        ),
    )
    return [coverage, ranges, experts]


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _describe_range(row: RangeRow) -> str:
    errors = f"{row.error:.2e} vs {row.incumbent_error:.2e}"
    bad = f"; {row.nonfinite} served values NaN/inf where the exact MoE is finite" if row.nonfinite else ""
    return f"{row.range} ({row.rank}) {row.ratio:.3f} ({errors}, {row.rows} rows{bad})"


def _describe_cell(cell: ExpertCell) -> str:
    return (
        f"expert {cell.expert} {cell.range} ({cell.rank}) s = {cell.scale:+.4f} +- {cell.stderr:.4f} "
        f"(incumbent {cell.incumbent_scale:+.4f}, z = {cell.z:.1f}, {cell.slots} slots)"
    )


def summary_record(summary: LayerSummary, limits: LayerCheckLimits) -> dict[str, Any]:
    """results.json's "layer_check": every range row, and the expert cells worth reading (the judged ones
    off by more than half the bound, and each range's largest)."""
    cells = [c for c in summary.experts if c.slots >= MIN_SLOTS]
    largest: dict[tuple[str, str], ExpertCell] = {}
    for cell in cells:
        key = (cell.range, cell.rank)
        if key not in largest or abs(cell.scale) > abs(largest[key].scale):
            largest[key] = cell
    shown = {id(c): c for c in cells if abs(c.scale) > limits.scale_bound / 2} | {
        id(c): c for c in largest.values()
    }
    return {
        "processes": summary.processes,
        "counted_on": summary.counted_on,
        "max_tokens_per_call": summary.max_tokens,
        "limits": asdict(limits),
        "min_rows": MIN_ROWS,
        "min_slots": MIN_SLOTS,
        "ranges": [asdict(row) for row in summary.ranges],
        "expert_cells_judged": len(cells),
        "expert_cells": [
            asdict(c)
            | {
                "stderr": c.stderr if math.isfinite(c.stderr) else None,
                "z": c.z if math.isfinite(c.z) else None,
            }
            for c in shown.values()
        ],
    }
