"""The layer check's tables summarized: per dispatch range, layer, expert and rank, the served MoE calls'
error against the exact MoE, the per-expert and activation scale estimates with what each could resolve,
and how much of each range's cells could be judged (the layer gate, gates/layer_gate.py, judges this).

Reads the tables every bundled-kernel process wrote (core/layer_cells.py; moe_eval.kernels.layer_check makes
them) at three levels: each (layer, range, expert) cell of each rank, the same pooled over the layers (where
a bug confined to a range but in every layer reads at full size with all the evidence), and pooled over the
ranks too. The degrees of freedom and the t threshold: moe_eval.gates.layer_estimates. The power of a cell:
the smallest true scale error d caught with 80 % probability by the rule,
d80 = max((t + 0.84) se_diff, bound + 0.84 se, |s_incumbent| + 0.84 se_diff).

No torch: numpy on the tables.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moe_eval.core.layer_cells import CELL, ROW, LayerFile
from moe_eval.core.payload import described
from moe_eval.core.plugin_protocol import LAYER_RANGE_EDGES, layer_range_names
from moe_eval.gates.layer_estimates import Estimates

MIN_ROWS = (
    8  # rows a range (or a layer in it) needs before its error ratio is judged and it counts as covered
)
NAMED = 12  # cells or layers a check's line names at most
SHOWN_OFF = 64  # off cells a pool keeps for the record (per layer, and pooled over the layers)
# A range whose judged cells (at least SHIFT_CELLS of them) share a shift past half the bound, SHARED_SIDE of
# them on its side, reads as one error shared by every expert: named so, not as a few experts' bugs.
SHIFT_CELLS = 4
SHARED_SIDE = 0.8
# A pooled activation cell is judged where it resolves a SiLU slope error of this many times its bound.
ACTIVATION_RESOLVES = 2.0


@dataclass(frozen=True)
class LayerCheckLimits:
    """From the config's layer_check_* keys."""

    margin: float = described("error / the incumbent's error may reach 1 + margin")
    scale_bound: float = described("a per-expert |s| above this fails (with z)")
    z: float = described("... when |s - s_incumbent| reaches the t quantile of this normal tail")
    activation_bound: float = described("the SiLU slope error's bound", 0.002)
    power: float = described("a cell is judged when it resolves a one-expert error this large", 0.01)
    min_judged: float = described("share of each reachable range's cells judged on every rank", 0.95)
    min_judged_per_layer: float = described(
        "share of each reachable range's (layer, expert) cells judged on every rank", 0.5, newer=True
    )


@dataclass
class RangeRow:
    """One dispatch range (layer None: pooled over the layers) on one rank ('all': pooled over ranks)."""

    range: str = described("the dispatch range, e.g. M=17-64 (tokens per call)")
    rank: str = described("the rank, e.g. TP0/1, EP1/2 ('all': pooled over the ranks)")
    layer: int | None = described("the MoE layer (null: pooled over the layers)")
    calls_seen: int = described("MoE calls the process served in the range")
    calls_sampled: int = described("of them, calls whose rows were compared")
    rows: int = described("rows compared")
    error: float | None = described("RMS |served - exact| / RMS |exact| (null: nothing compared)")
    incumbent_error: float | None = described("the incumbent arithmetic's on the same rows")
    ratio: float | None = described("error / incumbent_error (null: an infinite ratio, or nothing compared)")
    nonfinite: int = described("served output elements NaN or inf where the exact MoE was finite", 0)


@dataclass
class Cell:
    """A scale estimate: an expert's (ExpertCell) or the activation's (layer, range)."""

    range: str = described("the dispatch range, e.g. M=17-64 (tokens per call)")
    rank: str = described("the rank, e.g. TP0/1, EP1/2 ('all': pooled over the ranks)")
    layer: int | None = described("the MoE layer (null: pooled over the layers)")
    slots: int = described("slots (routed token, expert pairs) the estimate pools")
    scale: float = described("the estimated scale error of the served output (0: exact)")
    stderr: float | None = described("its standard error")
    incumbent_scale: float = described("the incumbent arithmetic's")
    diff_stderr: float | None = described("the standard error of scale - incumbent_scale")
    dof: float | None = described("degrees of freedom")
    z: float | None = described("|scale - incumbent_scale| / diff_stderr")
    threshold: float | None = described("the t quantile z must reach")
    detectable: float | None = described("the scale error resolved with 80 % power (d80)")


@dataclass
class ExpertCell(Cell):
    expert: int = described("the global expert", -1)


@dataclass
class PowerRow:
    """How much of one range one rank's check could judge: (range, expert) cells pooled over the layers, and
    (layer, range, expert) cells."""

    range: str = described("the dispatch range, e.g. M=17-64 (tokens per call)")
    rank: str = described("the rank, e.g. TP0/1, EP1/2 ('all': pooled over the ranks)")
    cells: int = described("experts this rank holds that were routed in this range (the cells owed)")
    judged: int = described("of them, cells resolving a `power` one-expert error")
    detectable_95: float | None = described(
        "the error that 95 % of the cells resolve (null: fewer than 95 % resolve any)"
    )
    layer_cells: int = described("(layer, expert) cells owed")
    layer_judged: int = described("of them judged")
    unjudged: list[int] = described("the routed experts not judged", factory=list)
    not_routed: list[int] = described("held, never routed in this range: nothing to judge", factory=list)
    least_routed: list[int] | None = described(
        "[expert, slots routed]: the rarest routed expert of the range", None
    )


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
    shifts: list[SharedShift] = field(default_factory=list)  # per range and rank: what its experts share


@dataclass
class SharedShift:
    """What the judged (range, expert) cells of one range and rank share: their median scale, and the share
    of them on its side. One error in every expert (a global scale: a routing-weight or activation bug) moves
    them all alike; an expert's bug moves one cell."""

    range: str = described("the dispatch range, e.g. M=17-64 (tokens per call)")
    rank: str = described("the rank, e.g. TP0/1, EP1/2 ('all': pooled over the ranks)")
    cells: int = described("judged (range, expert) cells")
    median: float = described("the judged cells' median scale")
    same_side: float = described("the share of them on the median's side")


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


def _cell(
    est: Estimates, index: tuple[int, ...], name: str, rank: str, layer: int | None, slots: int
) -> Cell:
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
    pools: list[tuple[Any, ...]] = []
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
    layer: int | None  # None: pooled over the layers
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
        scales = pooled.scale[i][judged_pooled[i]]
        if len(scales) >= SHIFT_CELLS:
            median = float(np.median(scales))
            same = float(np.mean(np.sign(scales) == np.sign(median))) if median else 0.0
            summary.shifts.append(SharedShift(name, rank, len(scales), median, same))
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


def _largest(mask: np.ndarray, scale: np.ndarray) -> list[tuple[int, ...]]:
    """The indices where `mask` holds, largest |scale| first, at most SHOWN_OFF of them."""
    where = np.nonzero(mask)
    order = np.argsort(-np.abs(scale[where]), kind="stable")[:SHOWN_OFF]
    return [tuple(int(axis[j]) for axis in where) for j in order]


def _expert(
    est: Estimates, index: tuple[int, ...], name: str, rank: str, layer: int | None, slots: int, e: Any
) -> ExpertCell:
    cell = _cell(est, index, name, rank, layer, slots)
    return ExpertCell(**asdict(cell), expert=int(e))


def is_off(c: Cell, bound: float) -> bool:
    """The rule on a stored cell (None: infinite, as results.json writes it)."""
    z = math.inf if c.z is None else c.z
    threshold = math.inf if c.threshold is None else c.threshold
    return c.slots > 0 and abs(c.scale) > bound and z >= threshold


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
        "shifts": [asdict(sh) for sh in summary.shifts],
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
            if c.layer is not None and is_off(c, limits.activation_bound)
        ],
        "expert_cells_off": summary.off_experts,
        "expert_cells": [asdict(c) for c in summary.experts],
    }
