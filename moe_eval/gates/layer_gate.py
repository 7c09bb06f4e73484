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
  layer_check_power one-expert error with 80 % probability; under layer_check_min_judged the row is not
  passed (incomplete), the unjudged cells named.

The degrees of freedom and the t threshold: moe_eval.gates.layer_estimates.

The power of a cell: the smallest true scale error d caught with 80 % probability by the rule above,
d80 = max((t + 0.84) se_diff, bound + 0.84 se, |s_incumbent| + 0.84 se_diff).

No torch: numpy on the tables.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moe_eval.core.check import Check
from moe_eval.core.layer_cells import CELL, ROW, LayerFile
from moe_eval.core.plugin_protocol import LAYER_RANGE_EDGES, layer_range_names
from moe_eval.gates.layer_estimates import Estimates

MIN_ROWS = (
    8  # rows a range (or a layer in it) needs before its error ratio is judged and it counts as covered
)
NAMED = 12  # cells or layers a check's line names at most
SHOWN_OFF = 64  # off cells a pool keeps for the record (per layer, and pooled over the layers)


@dataclass(frozen=True)
class LayerCheckLimits:
    margin: float  # error / incumbent's error may reach 1 + margin
    scale_bound: float  # |s| above this fails (with the z below)
    z: float  # ... when |s - s_incumbent| reaches the t quantile of this normal tail
    activation_bound: float = 0.002  # the SiLU slope error's bound
    power: float = 0.01  # a cell is judged when it resolves a one-expert error this large
    min_judged: float = 0.95  # share of each reachable range's cells judged on every rank


@dataclass
class RangeRow:
    """One dispatch range (layer None: pooled over the layers) on one rank ('all': pooled over ranks)."""

    range: str
    rank: str
    layer: int | None
    calls_seen: int
    calls_sampled: int
    rows: int
    error: float | None  # RMS |served - exact| / RMS |exact|
    incumbent_error: float | None  # the same for the incumbent's arithmetic
    ratio: float | None  # error / incumbent_error
    nonfinite: int = 0  # served output elements that were NaN or inf where the exact MoE was finite


@dataclass
class Cell:
    """A scale estimate: an expert's (ExpertCell) or the activation's (layer, range)."""

    range: str
    rank: str
    layer: int | None  # None: pooled over the layers
    slots: int
    scale: float
    stderr: float | None
    incumbent_scale: float
    diff_stderr: float | None
    dof: float | None
    z: float | None
    threshold: float | None
    detectable: float | None  # d80


@dataclass
class ExpertCell(Cell):
    expert: int = -1


@dataclass
class PowerRow:
    """How much of one range one rank's check could judge: (range, expert) cells pooled over the layers, and
    (layer, range, expert) cells."""

    range: str
    rank: str
    cells: int  # experts this rank holds that were routed in this range (the cells owed)
    judged: int  # ... resolving a `power` one-expert error
    detectable_95: (
        float | None
    )  # the error that 95 % of the cells resolve (None: fewer than 95 % resolve any)
    layer_cells: int
    layer_judged: int
    unjudged: list[int] = field(default_factory=list)  # the routed experts not judged
    not_routed: list[int] = field(default_factory=list)  # held, never routed in this range: nothing to judge
    least_routed: list[int] | None = None  # [expert, slots routed]: the rarest routed expert of the range


@dataclass
class LayerSummary:
    processes: int  # files read (a process keeps one per expert count it served)
    world_size: int  # the ranks the layout has
    counted_on: list[str]
    max_tokens: int  # the most tokens one call can carry (the server's batched-token limit)
    layers: int
    ranges: list[RangeRow] = field(default_factory=list)
    experts: list[ExpertCell] = field(default_factory=list)  # off cells, and each (range, rank)'s largest
    activation: list[Cell] = field(default_factory=list)  # per range (pooled and per layer) and rank
    power: list[PowerRow] = field(default_factory=list)
    off_experts: int = 0
    problems: list[str] = field(default_factory=list)  # files that could not be read, missing ranks
    ranks: int = 0  # distinct ranks among the files: what coverage counts (two files of one rank are one)


def rank_name(rank: dict[str, Any]) -> str:
    if rank.get("use_ep"):
        return f"EP{rank.get('ep_rank', 0)}/{rank.get('ep_size', 1)}"
    return f"TP{rank.get('tp_rank', 0)}/{rank.get('tp_size', 1)}" + (
        f" DP{rank.get('dp_rank', 0)}" if rank.get("dp_size", 1) > 1 else ""
    )


def _finite(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _range_row(name: str, rank: str, layer: int | None, seen: int, sums: np.ndarray) -> RangeRow:
    sq_res, sq_exact, sq_ref = sums[ROW["sq_res"]], sums[ROW["sq_exact"]], sums[ROW["sq_ref"]]
    error = math.sqrt(sq_res / sq_exact) if sq_exact > 0 else None
    incumbent = math.sqrt(sq_ref / sq_exact) if sq_exact > 0 else None
    if error is None or incumbent is None:
        ratio = None
    elif incumbent > 0:
        ratio = error / incumbent
    else:
        ratio = 1.0 if error == 0 else math.inf
    return RangeRow(
        name, rank, layer, seen, int(sums[ROW["calls"]]), int(sums[ROW["rows"]]), error, incumbent, ratio,
        int(sums[ROW["nonfinite"]]),
    )  # fmt: skip


def _cell(est: Estimates, index: tuple, name: str, rank: str, layer: int | None, slots: int) -> Cell:
    return Cell(
        name, rank, layer, slots, float(est.scale[index]), _finite(est.stderr[index]),
        float(est.incumbent[index]), _finite(est.diff_stderr[index]), _finite(est.dof[index]),
        _finite(est.z[index]), _finite(est.threshold[index]), _finite(est.detectable[index]),
    )  # fmt: skip


def _routed(f: LayerFile) -> np.ndarray:
    """Slots routed per (layer, range, expert); a table without the count (synthetic) counts every compared
    slot as routed."""
    return f.routed if f.routed is not None else f.cells[..., CELL["n"]].astype(np.int64)


def reachable_ranges(max_tokens: int) -> list[str]:
    """The ranges a server whose calls carry up to max_tokens tokens can produce."""
    return [
        name for name, low in zip(layer_range_names(), LAYER_RANGE_EDGES, strict=True) if low <= max_tokens
    ]


def summarize(
    files: list[LayerFile], limits: LayerCheckLimits, world_size: int = 1, problems: list[str] | None = None
) -> LayerSummary:
    names = layer_range_names()
    summary = LayerSummary(
        processes=len(files),
        world_size=world_size,
        counted_on=sorted({str(f.meta.get("counted_on", "?")) for f in files}),
        max_tokens=max((int(f.meta.get("max_tokens", 0)) for f in files), default=0),
        layers=max((f.cells.shape[0] for f in files), default=0),
        problems=list(problems or []),
        ranks=len({rank_name(f.rank) for f in files}),
    )
    if not files:
        return summary
    files = sorted(files, key=lambda f: rank_name(f.rank))
    ranks = [rank_name(f.rank) for f in files]
    pools: list[tuple] = []
    for f, rank in zip(files, ranks, strict=True):
        held = f.meta.get("experts_held")
        held = list(range(f.cells.shape[2])) if held is None else [int(e) for e in held]
        pools.append((rank, f.cells, f.rows, f.seen, _routed(f), held))
    if len(files) > 1 and len({f.cells.shape for f in files}) == 1:
        held_all = sorted({e for p in pools for e in p[5]})
        total = [sum(p[i] for p in pools) for i in range(1, 5)]
        pools.append(("all", *total, held_all))
    for rank, cells, rows, seen, routed, held in pools:
        _judge_pool(summary, limits, names, rank, cells, rows, seen, routed, held)
    return summary


def _judge_pool(
    summary: LayerSummary,
    limits: LayerCheckLimits,
    names: tuple[str, ...],
    rank: str,
    cells: np.ndarray,  # (L, NR, E, NF)
    rows: np.ndarray,  # (L, NR, NRF)
    seen: np.ndarray,  # (L, NR)
    routed: np.ndarray,  # (L, NR, E)
    held: list[int],
) -> None:
    L = cells.shape[0]
    # Ranges, pooled over layers and per layer.
    for i, name in enumerate(names):
        pooled = rows[:, i].sum(0)
        if pooled[ROW["calls"]] > 0 or seen[:, i].sum() > 0:
            summary.ranges.append(_range_row(name, rank, None, int(seen[:, i].sum()), pooled))
        if L > 1:
            for layer in range(L):
                if rows[layer, i, ROW["calls"]] > 0:
                    summary.ranges.append(_range_row(name, rank, layer, int(seen[layer, i]), rows[layer, i]))
    # The activation direction, pooled and per layer.
    act_sums = rows[..., ROW["sa"] : ROW["svd2"] + 1]
    for layer, sums in [(None, act_sums.sum(0))] + ([(j, act_sums[j]) for j in range(L)] if L > 1 else []):
        est = Estimates.of(sums, limits.activation_bound, limits.z)
        source = rows[:, :, ROW["rows"]].sum(0) if layer is None else rows[layer, :, ROW["rows"]]
        for i, name in enumerate(names):
            if sums[i, 1] > 0:
                summary.activation.append(_cell(est, (i,), name, rank, layer, int(source[i])))
    # Expert cells: per layer (judged, counted) and pooled over the layers.
    expert_sums = cells[..., CELL["a"] :]
    per_layer = Estimates.of(expert_sums, limits.scale_bound, limits.z)
    pooled_sums = expert_sums.sum(0)
    pooled = Estimates.of(pooled_sums, limits.scale_bound, limits.z)
    slots_layer, slots_pooled = cells[..., CELL["n"]], cells[..., CELL["n"]].sum(0)
    off_layer = per_layer.off(limits.scale_bound) & (slots_layer > 0)
    off_pooled = pooled.off(limits.scale_bound) & (slots_pooled > 0)
    summary.off_experts += int(off_layer.sum()) + int(off_pooled.sum())
    shown: list[ExpertCell] = []
    # The largest off cells only: a gross bug puts every cell of a 48-layer model off (43,000 of them); the
    # count says how many there are.
    for layer, i, e in _largest(off_layer, per_layer.scale):
        shown.append(
            _expert(per_layer, (layer, i, e), names[i], rank, int(layer), int(slots_layer[layer, i, e]), e)
        )
    for i, e in _largest(off_pooled, pooled.scale):
        shown.append(_expert(pooled, (i, e), names[i], rank, None, int(slots_pooled[i, e]), e))
    judged_pooled = (pooled.detectable <= limits.power) & (slots_pooled > 0)
    for i, name in enumerate(names):
        candidates = np.nonzero((slots_pooled[i] > 0) & judged_pooled[i])[0]
        if len(candidates):  # the range's largest judged estimate, when nothing is off: what "passed" means
            e = candidates[np.argmax(np.abs(pooled.scale[i, candidates]))]
            if not off_pooled[i, e]:
                shown.append(_expert(pooled, (i, e), name, rank, None, int(slots_pooled[i, e]), e))
        routed_here = routed[:, i].sum(0)
        if slots_pooled[i].sum() == 0 and routed_here.sum() == 0:
            continue
        owed = [e for e in held if routed_here[e] > 0]
        d = np.sort(pooled.detectable[i, owed])
        k = max(int(math.ceil(0.95 * len(d))) - 1, 0)
        layer_owed = routed[:, i][:, owed] > 0
        layer_detect = per_layer.detectable[:, i][:, owed][layer_owed]
        rarest = min(owed, key=lambda e: routed_here[e], default=None)
        summary.power.append(
            PowerRow(
                name,
                rank,
                len(owed),
                int(judged_pooled[i, owed].sum()),
                _finite(d[k]) if len(d) else None,
                int(layer_detect.size),
                int((layer_detect <= limits.power).sum()),
                [int(e) for e in owed if not judged_pooled[i, e]],
                [int(e) for e in held if routed_here[e] == 0],
                None if rarest is None else [int(rarest), int(routed_here[rarest])],
            )
        )
    summary.experts += shown


def _largest(mask: np.ndarray, scale: np.ndarray) -> list[tuple]:
    """The indices where `mask` holds, largest |scale| first, at most SHOWN_OFF of them."""
    where = np.nonzero(mask)
    order = np.argsort(-np.abs(scale[where]), kind="stable")[:SHOWN_OFF]
    return [tuple(int(axis[j]) for axis in where) for j in order]


def _expert(
    est: Estimates, index: tuple, name: str, rank: str, layer: int | None, slots: int, e: Any
) -> ExpertCell:
    cell = _cell(est, index, name, rank, layer, slots)
    return ExpertCell(**asdict(cell), expert=int(e))


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
    if summary.ranks < summary.world_size or summary.problems:
        lost = "; ".join(summary.problems)
        return Check.not_run(
            "layer_check_coverage",
            f"not run: {summary.world_size - summary.ranks} rank(s) wrote no layer-check tables"
            + (f" ({lost})" if lost else "")
            + f": their calls were compared with nothing. {detail}",
        )
    if missing:  # ranges the server can reach that the check did not see: not measured, not a kernel fault
        return Check.not_run("layer_check_coverage", f"not run: {detail}")
    return Check.judged("layer_check_coverage", True, detail)


def _ranges(summary: LayerSummary, limits: LayerCheckLimits) -> Check:
    judged = [row for row in summary.ranges if row.rows >= MIN_ROWS and row.ratio is not None]
    worse = [row for row in judged if row.ratio > 1 + limits.margin or row.nonfinite]
    worst = max((r for r in judged if r.layer is None), key=lambda row: row.ratio, default=None)
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
        return Check.not_run("layer_check_ranges", "not run: " + head + text)
    return Check.judged("layer_check_ranges", not worse, head + text)


def _experts(summary: LayerSummary, limits: LayerCheckLimits) -> Check:
    off = [c for c in summary.experts if _is_off(c, limits.scale_bound)]
    off.sort(key=lambda c: -abs(c.scale))
    biggest = max((c for c in summary.experts if c not in off), key=lambda c: abs(c.scale), default=None)
    head = (
        f"per-expert scale of the served output against the exact MoE (joint over each row's slots), limit "
        f"+-{limits.scale_bound:g} and beyond the incumbent's by t(dof) at z = {limits.z:g}, per layer and "
        f"pooled over layers: "
    )
    if off:
        text = "; ".join(_describe_cell(c) for c in off[:NAMED])
        text += f" (+{summary.off_experts - NAMED} more)" if summary.off_experts > NAMED else ""
    elif biggest is None:
        return Check.not_run("layer_check_experts", f"not run: {head}no cell judged")
    else:
        text = f"none off; largest judged {_describe_cell(biggest)}"
    return Check.judged("layer_check_experts", not off, head + text)


def _is_off(c: Cell, bound: float) -> bool:
    """The rule on a stored cell (None: infinite, as results.json writes it)."""
    z = math.inf if c.z is None else c.z
    threshold = math.inf if c.threshold is None else c.threshold
    return c.slots > 0 and abs(c.scale) > bound and z >= threshold


def _activation(summary: LayerSummary, limits: LayerCheckLimits) -> Check:
    cells = summary.activation
    off = sorted((c for c in cells if _is_off(c, limits.activation_bound)), key=lambda c: -abs(c.scale))
    pooled = [c for c in cells if c.layer is None]
    largest = max(pooled, key=lambda c: abs(c.scale), default=None)
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
        return Check.not_run("layer_check_activation", "not run: " + head + text)
    return Check.judged("layer_check_activation", not off, head + text)


def _power(summary: LayerSummary, limits: LayerCheckLimits) -> Check:
    wanted = set(reachable_ranges(summary.max_tokens))
    rows = [p for p in summary.power if p.range in wanted and (p.rank != "all" or summary.processes == 1)]
    if summary.processes == 1:
        rows = [p for p in summary.power if p.range in wanted]
    short = [p for p in rows if p.judged < limits.min_judged * p.cells or not p.cells]
    seen_ranges = {p.range for p in rows}
    never = sorted(wanted - seen_ranges, key=list(layer_range_names()).index)
    total = sum(p.cells for p in rows)
    judged = sum(p.judged for p in rows)
    detail = (
        f"one-expert error of {limits.power:.1%} resolved (80 % power) in {judged} of {total} "
        f"(range, expert) cells; per range: " + ", ".join(_describe_power(p) for p in rows)
    )
    if short or never:
        named = "; ".join(
            f"{p.range} ({p.rank}) {p.judged}/{p.cells}, unjudged experts "
            + ", ".join(map(str, p.unjudged[:NAMED]))
            + (f" (+{len(p.unjudged) - NAMED})" if len(p.unjudged) > NAMED else "")
            for p in short
        )
        if never:
            named = (named + "; " if named else "") + f"no cell at all in {', '.join(never)}"
        return Check.not_run(
            "layer_check_power",
            f"not run: under {limits.min_judged:.0%} of the cells judged: {named}. {detail}",
        )
    return Check.judged("layer_check_power", True, detail)


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


def summary_record(summary: LayerSummary, limits: LayerCheckLimits) -> dict[str, Any]:
    """results.json's "layer_check": the ranges (pooled over layers; per layer only where judged off), the
    power per range and rank, the activation per range, and the expert cells worth reading (the off ones,
    and each range's largest judged)."""
    layer_rows = [
        r for r in summary.ranges if r.layer is not None and r.ratio is not None and r.rows >= MIN_ROWS
        and (r.ratio > 1 + limits.margin or r.nonfinite)
    ]  # fmt: skip
    return {
        "processes": summary.processes,
        "ranks": summary.ranks,
        "world_size": summary.world_size,
        "layers": summary.layers,
        "counted_on": summary.counted_on,
        "max_tokens_per_call": summary.max_tokens,
        "limits": asdict(limits),
        "min_rows": MIN_ROWS,
        "problems": summary.problems,
        "ranges": [asdict(r) for r in summary.ranges if r.layer is None] + [asdict(r) for r in layer_rows],
        "power": [asdict(p) for p in summary.power],
        "activation": [asdict(c) for c in summary.activation if c.layer is None]
        + [
            asdict(c)
            for c in summary.activation
            if c.layer is not None and _is_off(c, limits.activation_bound)
        ],
        "expert_cells_off": summary.off_experts,
        "expert_cells": [asdict(c) for c in summary.experts],
    }
