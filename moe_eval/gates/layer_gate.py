"""The layer check's verdict: the served MoE calls against the exact MoE, per layer, dispatch range, expert
and rank, with what it could not judge counted.

Reads the tables every bundled-kernel process wrote (core/layer_cells.py; moe_eval.kernels.layer_check makes
them) and judges them at three levels: each (layer, range, expert) cell of each rank, the same pooled over
the layers (where a bug confined to a range but in every layer reads at full size with all the evidence),
and pooled over the ranks too. Five checks:

- `layer_check_coverage`: every rank of the layout wrote its tables (a missing one is "not run", never a
  smaller pool), and every dispatch range the server can produce (up to its batched-token limit) was
  compared on at least MIN_ROWS rows.
- `layer_check_ranges`: per range (and per layer in it) and rank, the served output's RMS error against the
  exact MoE is no worse than the incumbent's arithmetic on the same rows by more than the margin; no
  served NaN where the exact MoE is finite. A whole layer off by a few % fails here.
- `layer_check_experts`: each cell's scale s (the joint least squares of layer_check_ref: a kernel whose
  expert e is off by 1 + s reads s in e's cells and nothing in another's). A cell fails when |s| is above
  layer_check_scale_bound, above the incumbent arithmetic's own estimate on the same slots, and their
  difference is at least t standard errors, t the Student quantile, at the cell's degrees of freedom, of the
  tail layer_check_z standard normal errors leave. Against the incumbent, not zero: an expert carrying a
  tiny share of its rows is estimated from rounding alone.
- `layer_check_activation`: the same rule for the SiLU slope direction per layer and range (a systematic
  error of every expert's activation, which no single expert's scale reads at its size).
- `layer_check_power`: per reachable range and rank, the share of (range, expert) cells that resolve a
  layer_check_power one-expert error with 80 % probability, pooled over the layers (layer_check_min_judged)
  and per layer (layer_check_min_judged_per_layer); the registry's floor asks for every such pool, so short
  of it the row is not passed (incomplete), the unjudged cells named.

The tables are summarized by gates/layer_summary.py; this module judges the summary.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from pydantic import Field
from typing_extensions import NotRequired, TypedDict  # pydantic reads typing's TypedDict from 3.12 only

from moe_eval.core.check import Check
from moe_eval.core.evidence import Evidence
from moe_eval.core.plugin_protocol import layer_range_names
from moe_eval.gates.gate import Column, Floor, Gate, GateConfig, RowView, Show, gate_keys
from moe_eval.gates.layer_summary import (
    ACTIVATION_RESOLVES,
    MIN_ROWS,
    NAMED,
    SHARED_SIDE,
    Cell,
    ExpertCell,
    LayerCheckLimits,
    LayerSummary,
    PowerRow,
    RangeRow,
    SharedShift,
    is_off,
    reachable_ranges,
    summarize,
    summary_record,
)

if TYPE_CHECKING:
    from moe_eval.gates.measurements import Judgement, Measurements


@gate_keys
class LayerCheckKeys:
    """The layer check's limits and floors (the sums it reads are the run's keys: layer_check,
    layer_check_slots)."""

    # 1.5: a legitimate kernel that rounds once more than the incumbent, as finely, adds up to sqrt(2) = 1.41
    # times its error (FlashInfer CUTLASS reads 1.17-1.26 per layer on the H200 canary); the bugs of
    # docs/logprob-gate.md read 1.8 and up here, and the expert and activation checks resolve smaller ones.
    layer_check_margin: float = Field(
        0.5,
        ge=0.0,
        le=10.0,
        description="layer check: fail a dispatch range whose error against the exact MoE / the "
        "incumbent's > 1 + this",
    )
    layer_check_scale_bound: float = Field(
        0.005,
        ge=0.0,
        le=1.0,
        description="layer check: fail an expert whose output scale in one range is off by more than this "
        "(z agreeing)",
    )
    layer_check_z: float = Field(
        5.0,
        gt=0,
        description="layer check: an error must be this many standard errors (the normal quantile; a cell "
        "whose variance estimate has few degrees of freedom needs the Student t quantile of the same tail)",
    )
    layer_check_activation_bound: float = Field(
        0.002,
        ge=0.0,
        le=1.0,
        description="layer check: fail a layer or range whose SiLU slope error (the served output along the "
        "direction a slope change of every expert's activation moves it) is beyond this (z agreeing)",
    )
    layer_check_power: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description="layer check: a (range, expert) cell is judged when it resolves a one-expert scale "
        "error of this size with 80% probability",
    )
    layer_check_min_judged: float = Field(
        0.95,
        gt=0.0,  # 0 would pass a check that judged nothing
        le=1.0,
        description="layer check: each reachable range needs this share of its (range, expert) cells "
        "judged on every rank; less ends the row not passed (incomplete, exit 6), the unjudged cells named",
    )
    layer_check_min_judged_per_layer: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="layer check: each reachable range also needs this share of its (layer, range, expert) "
        "cells judged on every rank, so that an error in one layer cannot hide in its unjudged cells",
    )


__all__ = ["GATE", "LayerCheckLimits", "LayerSummary", "layer_check_limits", "layer_checks", "summarize"]


def _where(layer: int | None) -> str:
    return "" if layer is None else f" layer {layer}"


def layer_checks(summary: LayerSummary, limits: LayerCheckLimits) -> list[Check]:
    if summary.processes == 0:
        why = "; ".join(summary.problems) or "(<run>/layer-check/ holds no file)"
        return [
            Check.not_run(
                "layer_check_coverage",
                f"not run: no process of the server wrote layer-check tables {why}: the MoE calls were "
                "compared with nothing",
            )
        ]
    return [
        _coverage(summary),
        _ranges(summary, limits),
        _experts(summary, limits),
        _activation(summary, limits),
        _power(summary, limits),
    ]


def _coverage(summary: LayerSummary) -> Check:
    pooled = {row.range: row for row in summary.ranges if row.rank == "all" and row.layer is None}
    if summary.processes == 1:
        pooled = {row.range: row for row in summary.ranges if row.layer is None}
    wanted = reachable_ranges(summary.max_tokens)
    missing = [name for name in wanted if pooled.get(name) is None or pooled[name].rows < MIN_ROWS]
    covered = ", ".join(f"{name} {pooled[name].rows} rows" for name in wanted if name not in missing)
    detail = (
        f"{summary.ranks} of {summary.world_size} rank(s), {summary.layers} MoE layer(s); dispatch "
        f"ranges up to the server's {summary.max_tokens} tokens per call: {covered or 'none'} compared"
        + (f"; NOT COMPARED (< {MIN_ROWS} rows): {', '.join(missing)}" if missing else "")
    )
    evidence = Evidence("rank", min(summary.ranks, summary.world_size), summary.world_size)
    if summary.ranks < summary.world_size or summary.problems:
        lost = "; ".join(summary.problems)
        return Check.not_run(
            "layer_check_coverage",
            f"not run: {summary.world_size - summary.ranks} rank(s) wrote no layer-check tables"
            + (f" ({lost})" if lost else "")
            + f": their calls were compared with nothing. {detail}",
            evidence,
        )
    if missing:  # ranges the server can reach that the check did not see: not measured, not a kernel fault
        return Check.not_run("layer_check_coverage", f"not run: {detail}", evidence)
    return Check.judged("layer_check_coverage", True, detail, evidence)


def _judged_ratio(row: RangeRow) -> float:
    """A judged row's ratio: _ranges judges the rows that have one."""
    assert row.ratio is not None
    return row.ratio


def _ranges(summary: LayerSummary, limits: LayerCheckLimits) -> Check:
    judged = [row for row in summary.ranges if row.rows >= MIN_ROWS and row.ratio is not None]
    pooled = [r for r in summary.ranges if r.layer is None and (r.rank != "all" or summary.processes == 1)]
    evidence = Evidence(
        "(range, rank) pool",
        sum(1 for r in pooled if r.rows >= MIN_ROWS and r.ratio is not None),
        len(pooled),
        would_catch=f"an error x{1 + limits.margin:.2f} of the incumbent's",
    )
    worse = [row for row in judged if _judged_ratio(row) > 1 + limits.margin or row.nonfinite]
    worst = max((r for r in judged if r.layer is None), key=_judged_ratio, default=None)
    worse.sort(key=lambda r: -(r.ratio or 0))
    text = (
        "; ".join(_describe_range(row) for row in worse[:NAMED])
        + (f" (+{len(worse) - NAMED} more)" if len(worse) > NAMED else "")
        if worse
        else f"worst {_describe_range(worst)}"
        if worst
        else "no range judged"
    )
    head = (
        "error against the exact MoE / the incumbent's, per range and per layer, "
        f"limit {1 + limits.margin:.2f}: "
    )
    if not judged:
        return Check.not_run("layer_check_ranges", "not run: " + head + text, evidence)
    return Check.judged("layer_check_ranges", not worse, head + text, evidence)


def _experts(summary: LayerSummary, limits: LayerCheckLimits) -> Check:
    off = [c for c in summary.experts if is_off(c, limits.scale_bound)]
    off.sort(key=lambda c: -abs(c.scale))
    biggest = max((c for c in summary.experts if c not in off), key=lambda c: abs(c.scale), default=None)
    head = (
        f"per-expert scale of the served output against the exact MoE (joint over each row's slots), limit "
        f"+-{limits.scale_bound:g} and beyond the incumbent's by t(dof) at z = {limits.z:g}, per layer and "
        f"pooled over layers: "
    )
    rows = _power_rows(summary)
    evidence = Evidence(
        "(range, expert) cell", sum(p.judged for p in rows), sum(p.cells for p in rows),
        would_catch=f"a {limits.power:.1%} one-expert error",
    )  # fmt: skip
    if off:
        shared = _shared(summary, limits, {(c.range, c.rank) for c in off})
        text = (shared + "; largest cells: " if shared else "") + "; ".join(
            _describe_cell(c) for c in off[:NAMED]
        )
        text += f" (+{summary.off_experts - NAMED} more)" if summary.off_experts > NAMED else ""
    elif biggest is None:
        return Check.not_run("layer_check_experts", f"not run: {head}no cell judged", evidence)
    else:
        text = f"none off; largest judged {_describe_cell(biggest)}"
    return Check.judged("layer_check_experts", not off, head + text, evidence)


def _shared(summary: LayerSummary, limits: LayerCheckLimits, where: set[tuple[str, str]]) -> str:
    """The diagnosis where the off cells' ranges show one shift in every expert: 'a shift shared by every
    expert (a global scale, not an expert's bug): M=1 (TP0/1) median s = +0.0050, 97% of 128 judged cells
    on its side'; '' where none does."""
    shared = [
        f"{sh.range} ({sh.rank}) median s = {sh.median:+.4f}, {sh.same_side:.0%} of {sh.cells} judged "
        "cells on its side"
        for sh in summary.shifts
        if (sh.range, sh.rank) in where
        and abs(sh.median) > limits.scale_bound / 2
        and sh.same_side >= SHARED_SIDE
    ]
    if not shared:
        return ""
    return "a shift shared by every expert (a global scale, not an expert's bug): " + "; ".join(
        shared[:NAMED]
    )


def _activation(summary: LayerSummary, limits: LayerCheckLimits) -> Check:
    cells = summary.activation
    off = sorted((c for c in cells if is_off(c, limits.activation_bound)), key=lambda c: -abs(c.scale))
    pooled = [c for c in cells if c.layer is None and (c.rank != "all" or summary.processes == 1)]
    if summary.processes == 1:
        pooled = [c for c in cells if c.layer is None]
    largest = max(pooled, key=lambda c: abs(c.scale), default=None)
    # Judged: a range's pooled cell that resolves ACTIVATION_RESOLVES x the bound (its `detectable`); the
    # registry's floor asks for every reachable (range, rank) pool.
    wanted = reachable_ranges(summary.max_tokens)
    resolved = ACTIVATION_RESOLVES * limits.activation_bound
    judged = [
        c for c in pooled if c.range in wanted and c.detectable is not None and c.detectable <= resolved
    ]
    ranks = max(summary.ranks, 1)
    evidence = Evidence(
        "(range, rank) pool", len(judged), len(wanted) * ranks,
        would_catch=f"a SiLU slope error of {resolved:g}" if judged else None,
    )  # fmt: skip
    text = (
        "; ".join(_describe_activation(c) for c in off[:NAMED])
        if off
        else f"largest {_describe_activation(largest)}"
        if largest
        else "nothing measured"
    )
    head = (
        f"SiLU slope error of the served output (every expert's activation), "
        f"limit +-{limits.activation_bound:g} and beyond the incumbent's by t(dof) at z = {limits.z:g}: "
    )
    if not off and largest is None:
        return Check.not_run("layer_check_activation", "not run: " + head + text, evidence)
    return Check.judged("layer_check_activation", not off, head + text, evidence)


def _power_rows(summary: LayerSummary) -> list[PowerRow]:
    """Each reachable range's power row per rank (pooled over the ranks only with one process)."""
    wanted = set(reachable_ranges(summary.max_tokens))
    if summary.processes == 1:
        return [p for p in summary.power if p.range in wanted]
    return [p for p in summary.power if p.range in wanted and p.rank != "all"]


def _power(summary: LayerSummary, limits: LayerCheckLimits) -> Check:
    """Per reachable range and rank, the share of its (range, expert) cells that resolve a `power`
    one-expert error, pooled over the layers (at least min_judged) and per layer (at least
    min_judged_per_layer). A pool short of either is not judged; the registry's floor asks for every pool,
    so the row is then "not run", the short pools named."""
    wanted = set(reachable_ranges(summary.max_tokens))
    rows = _power_rows(summary)
    short = [
        p for p in rows
        if not p.cells or p.judged < limits.min_judged * p.cells
        or p.layer_judged < limits.min_judged_per_layer * p.layer_cells
    ]  # fmt: skip
    never = sorted(wanted - {p.range for p in rows}, key=list(layer_range_names()).index)
    ranks = max(summary.ranks, 1)
    evidence = Evidence(
        "(range, rank) pool", len(rows) - len(short), len(rows) + len(never) * ranks,
        would_catch=f"a {limits.power:.1%} one-expert error in {limits.min_judged:.0%} of a range's experts",
    )  # fmt: skip
    total = sum(p.cells for p in rows)
    judged = sum(p.judged for p in rows)
    detail = (
        f"one-expert error of {limits.power:.1%} resolved (80 % power) in {judged} of {total} "
        f"(range, expert) cells; per range: " + ", ".join(_describe_power(p) for p in rows)
    )
    if short or never:
        named = "; ".join(
            f"{p.range} ({p.rank}) {p.judged}/{p.cells}, per layer {p.layer_judged}/{p.layer_cells}, "
            "unjudged experts "
            + ", ".join(map(str, p.unjudged[:NAMED]))
            + (f" (+{len(p.unjudged) - NAMED})" if len(p.unjudged) > NAMED else "")
            for p in short
        )
        if never:
            named = (named + "; " if named else "") + f"no cell at all in {', '.join(never)}"
        detail = (
            f"under {limits.min_judged:.0%} of the cells (or {limits.min_judged_per_layer:.0%} per layer) "
            f"judged: {named}. {detail}"
        )
    return Check.judged("layer_check_power", True, detail, evidence)


def _describe_power(p: PowerRow) -> str:
    d95 = f"95% resolve {p.detectable_95:.2%}" if p.detectable_95 is not None else "95% resolve none"
    quiet = f"; not routed: {', '.join(map(str, p.not_routed[:NAMED]))}" if p.not_routed else ""
    layers = f"per layer {p.layer_judged}/{p.layer_cells}"
    return f"{p.range} ({p.rank}) {p.judged}/{p.cells} ({d95}; {layers}{quiet})"


def _describe_range(row: RangeRow) -> str:
    errors = f"{row.error:.2e} vs {row.incumbent_error:.2e}"
    bad = f"; {row.nonfinite} served values NaN/inf where the exact MoE is finite" if row.nonfinite else ""
    return f"{row.range}{_where(row.layer)} ({row.rank}) {row.ratio:.3f} ({errors}, {row.rows} rows{bad})"


def _stat(c: Cell) -> str:
    z = "inf" if c.z is None else f"{c.z:.1f}"
    t = "inf" if c.threshold is None else f"{c.threshold:.1f}"
    return f"z = {z} vs t {t}"


def _describe_cell(c: ExpertCell) -> str:
    se = "inf" if c.stderr is None else f"{c.stderr:.4f}"
    return (
        f"expert {c.expert} {c.range}{_where(c.layer)} ({c.rank}) s = {c.scale:+.4f} +- {se} "
        f"(incumbent {c.incumbent_scale:+.4f}, {_stat(c)}, {c.slots} slots)"
    )


def _describe_activation(c: Cell) -> str:
    return (
        f"{c.range}{_where(c.layer)} ({c.rank}) {c.scale:+.4f} (incumbent {c.incumbent_scale:+.4f}, "
        f"{_stat(c)}, {c.slots} rows)"
    )


# --- the gate -------------------------------------------------------------------------------------------

SECTION = "layer_check"


class LayerCheckSection(TypedDict):
    """results.json `layer_check`: summary_record, the served MoE calls against the exact MoE."""

    processes: int
    """table files read (a process writes one per expert count it served)"""
    ranks: NotRequired[int]
    """distinct ranks among them: what coverage counts (absent before schema 9)"""
    shifts: NotRequired[list[SharedShift]]
    """per range and rank, what its judged experts share (a global scale reads as one shift; schema 9)"""
    world_size: int
    """the ranks the layout has"""
    layers: int
    """MoE layers in the tables"""
    counted_on: list[str]
    """device or host, per process"""
    max_tokens_per_call: int
    """the server's batched-token limit: which ranges it can reach"""
    limits: LayerCheckLimits
    """the limits judged"""
    min_rows: int
    """rows a range needs to be compared"""
    problems: list[str]
    """files that could not be read, missing ranks"""
    ranges: list[RangeRow]
    """each range pooled over the layers (per rank, and pooled over ranks), and layers judged off"""
    power: list[PowerRow]
    """per range and rank, how many cells it could judge"""
    activation: list[Cell]
    """the SiLU slope error per range (pooled), and per layer where off"""
    expert_cells_off: int
    """cells judged off, every layer and pool"""
    expert_cells: list[ExpertCell]
    """the off cells, and each (range, rank)'s largest"""


def layer_check_limits(config: GateConfig) -> LayerCheckLimits:
    keys = config.keys(LayerCheckKeys)
    return LayerCheckLimits(
        margin=keys.layer_check_margin,
        scale_bound=keys.layer_check_scale_bound,
        z=keys.layer_check_z,
        activation_bound=keys.layer_check_activation_bound,
        power=keys.layer_check_power,
        min_judged=keys.layer_check_min_judged,
        min_judged_per_layer=keys.layer_check_min_judged_per_layer,
    )


def judge_layer_check(config: GateConfig, m: Measurements, out: Judgement) -> str | None:
    if m.layer is None:
        return "the processes' layer-check sums were not read"
    limits = layer_check_limits(config)
    out.checks += layer_checks(m.layer, limits)
    out.sections[SECTION] = summary_record(m.layer, limits)
    return None


def ratio_text(ratio: float | None) -> str:
    """'x1.02'; 'xinf' for an error against an exact incumbent (results.json writes it null); 'no ratio'."""
    if ratio is None:
        return "no ratio"
    return "xinf" if math.isinf(ratio) else f"x{ratio:.2f}"


def layer_ratio(row: dict[str, Any]) -> float | None:
    """A range's error ratio as results.json holds it; null with an error against an exact incumbent is
    infinite (JSON has no inf), the worst there is, not a range left out."""
    if row.get("ratio") is not None:
        return float(row["ratio"])
    return math.inf if (row.get("error") or 0) > 0 and row.get("incumbent_error") == 0 else None


def power_counts(check: dict[str, Any]) -> tuple[int, int]:
    """(judged, total) (range, expert) cells over the ranges and the ranks (not their pool)."""
    rows = [p for p in check.get("power", []) if p.get("rank") != "all" or check.get("processes") == 1]
    return sum(p["judged"] for p in rows), sum(p["cells"] for p in rows)


def layer_cell(check: Any, row: RowView | None = None) -> str:
    """'x0.85 worst (M=1); 890/896 cells at 1%; |s| <= 0.0005': the served MoE calls against the exact MoE:
    the worst range's error ratio to the incumbent's arithmetic, the (range, expert) cells that resolve the
    power target of the total, and the largest per-expert scale error."""
    if not check:
        return "-"
    ranges = [
        r | {"ratio": layer_ratio(r)} for r in check.get("ranges", []) if layer_ratio(r) is not None
        and r.get("layer") is None and (r.get("rank") == "all" or check.get("processes") == 1)
    ]  # fmt: skip
    worst = max(ranges, key=lambda r: r["ratio"], default=None)
    parts = [f"{ratio_text(worst['ratio'])} worst ({worst['range']})" if worst else "no range"]
    judged, total = power_counts(check)
    if total:
        parts.append(f"{judged}/{total} cells at {check['limits']['power']:.0%}")
    largest = max((abs(c["scale"]) for c in check.get("expert_cells", [])), default=None)
    if largest is not None:
        parts.append(f"|s| <= {largest:.4f}")
    return "; ".join(parts)


def compare_rows(checked: list[Any], ref: int) -> list[list[str]]:
    """`moe-eval compare`'s rows, runs as columns: per dispatch range each run's RMS error of the served MoE
    output against the exact MoE (and x its incumbent arithmetic's on the same rows); each run's largest
    per-expert scale error; how many (range, expert) cells it judged; its largest SiLU slope error. Kernels
    whose GSM8K numbers agree differ here (vLLM's kernel runs no check)."""
    if not any(checked):
        return []
    by_range: dict[str, dict[int, dict[str, Any]]] = {}
    for i, check in enumerate(checked):
        pooled = "all" if (check or {}).get("processes", 1) > 1 else None
        for row in (check or {}).get("ranges", []):
            if row.get("layer") is not None or row.get("error") is None:
                continue
            if pooled is None or row.get("rank") == pooled:
                by_range.setdefault(row["range"], {})[i] = row
    rows = []
    for name in layer_range_names():
        if name not in by_range:
            continue
        cells = []
        for i in range(len(checked)):
            row = by_range[name].get(i)
            cells.append("-" if row is None else f"{row['error']:.2e} ({ratio_text(layer_ratio(row))})")
        rows.append([f"layer error {name}", "", "RMS vs exact (x incumbent)", *cells])
    largest, judged, activation = [], [], []
    for check in checked:
        cells = (check or {}).get("expert_cells", [])
        worst = max(cells, key=lambda c: abs(c["scale"]), default=None)
        largest.append(
            "-" if worst is None else f"{worst['scale']:+.4f} (expert {worst['expert']}, {worst['range']})"
        )
        judged.append(_judged_cell(check))
        slopes = [c for c in (check or {}).get("activation", []) if c.get("layer") is None]
        steepest = max(slopes, key=lambda c: abs(c["scale"]), default=None)
        activation.append("-" if steepest is None else f"{steepest['scale']:+.4f} ({steepest['range']})")
    rows.append(["layer expert scale", "", "largest |s|", *largest])
    rows.append(["layer cells judged", "", "(range, expert) at the power target", *judged])
    rows.append(["layer SiLU slope", "", "largest error", *activation])
    return rows


def _judged_cell(check: dict[str, Any] | None) -> str:
    """'890/896 at 1% (95%: 0.62%)': how much of the (range, expert) cells the check could judge."""
    if not check or not check.get("power"):
        return "-"
    judged, total = power_counts(check)
    per_rank = [p for p in check["power"] if p.get("rank") != "all" or check.get("processes") == 1]
    d95 = [p["detectable_95"] for p in per_rank]
    worst = "none" if any(d is None for d in d95) else f"{max(d95):.2%}"
    return f"{judged}/{total} at {check['limits']['power']:.0%} (95% of cells resolve {worst})"


GATE = Gate(
    "layer_check",
    (
        "layer_check_coverage",
        "layer_check_ranges",
        "layer_check_experts",
        "layer_check_activation",
        "layer_check_power",
    ),
    lambda c, _: c.layer_checked,
    False,
    judge_layer_check,
    "the served MoE calls of every layer, dispatch range, expert and rank against the exact MoE, "
    "with the cells it could not judge counted",
    keys=LayerCheckKeys,
    section=SECTION,
    payload=LayerCheckSection,
    # Every reachable (range, rank) pool judged, in the activation check and in the cells (min_judged and
    # min_judged_per_layer decide a pool's), and min_judged of the (range, expert) cells overall.
    floors={
        "layer_check_power": Floor(share=1.0),
        "layer_check_activation": Floor(share=1.0),
        "layer_check_experts": Floor(share_key="layer_check_min_judged"),
    },
    show=Show(columns=(Column("Layer check vs exact", layer_cell),), compare=compare_rows),
)
