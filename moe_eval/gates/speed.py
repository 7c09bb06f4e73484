"""The speed gate: per dispatch range, the served MoE calls' time against the reference's on matched work
(no I/O).

The reference is the row's incumbent: vLLM's own kernel at the same layout (baseline_config), or with
`run --baseline RUN` the same config's row of an earlier run (the regression case, "before my change"). Both
were timed on the same workload (evaluate/moe_speed.py) on the same machine, the timer keeping one cell
per call size (kernels/moe_timer.py). Within a range a call's time grows with its size and the mix of sizes
differs between runs (at the Qwen3-30B-A3B shape M=65-256's mean moved 12 % between rows running
identical code), so a range is judged size for size:

- matched sizes: those both rows called at least MIN_SIZE_CALLS times on the slowest rank and whose mean is
  steady (standard error at most MAX_RELATIVE_ERROR of it in both rows);
- the range's ratio: the geometric mean of the sizes' ratios weighted by the reference's time at each size
  (what the reference's own calls of the range would take at this row's pace);
- its error: the sizes' within-run errors, and what a mean moves between two servers of one kernel
  (`between_servers`: a log standard deviation per server, by how each size ran: CUDA-graph replays or eager
  launches, whose pace follows the host's);
- it fails where the ratio is above (1 + margin) beyond SPEED_Z standard errors: the margin is the config's
  `speed_margin` where graphs replay (a decode slowdown of 5 % must fail) and `speed_margin_eager` for eager
  ranges (10 % at real shapes). Each judged range says what it fails above, and what it would catch with 80 %
  probability (`would_catch`).

Evidence: a range is judged only with MIN_CALLS matched calls per rank and matched sizes holding at least
MIN_MATCHED_SHARE of both rows' time there; the gate passes only where every graph-replayed range either row
reached was judged and none failed. What it could not judge is named, and a row whose own time there is zero
(a timer that summed nothing) is never judged, so never passed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from moe_eval.core.check import Check
from moe_eval.core.evidence import Evidence
from moe_eval.core.moe_timing import RangeTiming, SizeTiming, TimingSummary

# A size's mean from fewer calls (per rank) is one or two calls' luck.
MIN_SIZE_CALLS = 3
# A range's matched calls (per rank, the smaller row's at each size, summed) below this are too few to judge.
MIN_CALLS = 12
# The matched sizes must hold at least this share of each row's time in the range: a ratio over a sliver of
# the work says nothing of the rest.
MIN_MATCHED_SHARE = 0.5
# A range fails only where its ratio is beyond this many standard errors above 1 + margin.
SPEED_Z = 3.0
# z of 80 % power: a range's `would_catch` is the slowdown it fails with that probability.
POWER_Z = 0.8416
# A size whose mean's standard error is over this share of it is a few calls' time (a compile while serving,
# seen in vLLM's row on the H200: one ~1 s call among 20): left out of the ratio and named.
MAX_RELATIVE_ERROR = 0.25
# What a size's mean moves between two servers of one kernel on one machine, a standard deviation of its log
# per server. CUDA-graph replays: the GPU alone sets their pace (the canary's decode ranges repeated within
# 1 % between servers on the H200 and the H100, docs/perf.md). Eager calls: the host launches inside the
# bracket, so their pace follows the host's as well; at least BETWEEN_SERVERS_EAGER, and at least
# EAGER_SPREAD_FACTOR x the size's own spread of one call (a launch-bound call, such as the canary's tiny
# layer, spreads 8-25 % within a run and moved 20-40 % between servers: tests/speed/test_h200_records.py holds
# the factor to the stored runs; a GPU-bound one at real shapes spreads a few %).
BETWEEN_SERVERS_REPLAYED = 0.006
BETWEEN_SERVERS_EAGER = 0.01
EAGER_SPREAD_FACTOR = 1.7
# A range whose time is mostly in calls replayed from CUDA graphs is a graph-replayed range: every one either
# row reached must be judged for a pass.
REPLAYED_RANGE = 0.5


def times_differ_by(
    machine: str | None, workload: str | None, reference_machine: str | None, reference_workload: str | None
) -> str | None:
    """Why two rows' MoE times cannot be read against each other: "machine" (timed on other GPUs or another
    CPU; an unknown machine is no objection) or "requests" (other timed requests, checks.workload_identity);
    None where they compare. The speed gate and `moe-eval compare` ask the same question here."""
    if machine and reference_machine and machine != reference_machine:
        return "machine"
    if workload != reference_workload:
        return "requests"
    return None


@dataclass(frozen=True)
class Margins:
    replayed: float  # speed_margin: graph-replayed ranges
    eager: float  # speed_margin_eager


@dataclass(frozen=True)
class RangeSpeed:
    range: str
    us: float | None  # this row's mean call in the range (None: it made no call there)
    reference_us: float | None
    ratio: float | None  # matched sizes' ratio (this row / the reference); None: not judged
    calls: int  # matched calls per rank, this row
    reference_calls: int
    passed: bool | None  # None: not judged
    why_not: str | None = None
    z: float | None = None  # the excess over the margin in standard errors (fails beyond SPEED_Z)
    fails_above: float | None = None  # the ratio above which this range fails, at its errors
    would_catch: float | None = None  # the slowdown it fails with 80 % probability
    replayed: bool = False  # a graph-replayed range: must be judged for a pass
    margin: float | None = None
    sizes_matched: int = 0  # sizes compared, of the sizes either row called in the range
    sizes: int = 0
    matched_share: float | None = None  # the smaller of the two rows' time shares in the matched sizes
    unsteady: tuple[int, ...] = ()  # sizes left out: their mean was a few calls' time
    between_servers: float | None = None  # the floor's log standard deviation per server, time-weighted


def _eager(size: SizeTiming) -> float:
    return 1.0 - size.replayed / size.calls if size.calls else 1.0


def _spread(size: SizeTiming) -> float:
    """One call's standard deviation, us: about the size's line of time against the experts its routing hit
    where the timer counted them (the variance routing explains is the same in both rows: they sent the same
    requests), else its plain spread."""
    return size.spread_us if size.residual_us is None else size.residual_us


def _relative_error(size: SizeTiming) -> float:
    return _spread(size) / math.sqrt(size.calls) / size.mean_us if size.mean_us > 0 else math.inf


def compare_size(mine: SizeTiming, other: SizeTiming) -> tuple[float, float]:
    """(log ratio, its within-run variance) of one size: this row's mean at the reference's routing (its line
    moved to the reference's mean experts, where both counted them) over the reference's mean."""
    mean = mine.mean_us
    extra = 0.0  # the slope's own error, times how far the line is moved
    if None not in (mine.slope_us, other.experts, mine.experts):
        shift = other.experts - mine.experts
        mean += mine.slope_us * shift
        if mine.experts_spread:
            extra = (shift * _spread(mine)) ** 2 / (mine.calls * mine.experts_spread**2)
    if mean <= 0:
        return math.inf, math.inf
    variance = (_spread(mine) ** 2 / mine.calls + extra) / mean**2 + _relative_error(other) ** 2
    return math.log(mean / other.mean_us), variance


def between_servers(mine: SizeTiming, other: SizeTiming) -> float:
    """The log standard deviation one server adds to a size's mean: by its replayed and eager shares."""
    eager = max(_eager(mine), _eager(other))
    spread = max(_spread(s) / s.mean_us for s in (mine, other) if s.mean_us > 0)
    eager_floor = max(BETWEEN_SERVERS_EAGER, EAGER_SPREAD_FACTOR * spread)
    return eager * eager_floor + (1 - eager) * BETWEEN_SERVERS_REPLAYED


def _replayed_range(*timings: RangeTiming | None) -> bool:
    """A range whose time, in either row, was mostly graph replays."""
    return any(
        t is not None and t.eager_share is not None and t.eager_share < REPLAYED_RANGE for t in timings
    )


def judge_range(mine: RangeTiming | None, other: RangeTiming | None, margins: Margins) -> RangeSpeed:
    name = (mine or other).range
    replayed = _replayed_range(mine, other)
    margin = margins.replayed if replayed else margins.eager
    base = {
        "range": name,
        "us": mine.mean_us if mine else None,
        "reference_us": other.mean_us if other else None,
        "replayed": replayed,
        "margin": margin,
    }

    def not_judged(why: str, **more: Any) -> RangeSpeed:
        return RangeSpeed(**base, ratio=None, calls=0, reference_calls=0, passed=None, why_not=why, **more)

    if mine is None or mine.mean_us <= 0:
        return not_judged("this row made no call there" if mine is None else "this row's mean call is 0 us")
    if other is None or other.mean_us <= 0:
        return not_judged(
            "the reference made no call there" if other is None else "the reference's mean call is 0 us"
        )
    if mine.sizes is None or other.sizes is None:
        return not_judged("timed per range only (a record from before moe-eval timed each call size)")
    if mine.rank_calls == 0:
        return not_judged("a rank of this row made no call there")
    theirs = {s.tokens: s for s in other.sizes}
    sizes = {s.tokens for s in mine.sizes} | set(theirs)
    pairs, unsteady = [], []
    for size in mine.sizes:
        ref = theirs.get(size.tokens)
        if (
            ref is None
            or min(size.calls, ref.calls) < MIN_SIZE_CALLS
            or size.mean_us <= 0
            or ref.mean_us <= 0
        ):
            continue
        if max(_relative_error(size), _relative_error(ref)) > MAX_RELATIVE_ERROR:
            unsteady.append(size.tokens)
            continue
        pairs.append((size, ref))
    counts = {"sizes": len(sizes), "sizes_matched": len(pairs), "unsteady": tuple(unsteady)}
    time_mine = sum(s.calls * s.mean_us for s in mine.sizes)
    time_ref = sum(s.calls * s.mean_us for s in other.sizes)
    share = min(
        sum(s.calls * s.mean_us for s, _ in pairs) / time_mine if time_mine else 0.0,
        sum(r.calls * r.mean_us for _, r in pairs) / time_ref if time_ref else 0.0,
    )
    matched_calls = sum(min(s.calls, r.calls) for s, r in pairs)
    if matched_calls < MIN_CALLS:
        return not_judged(
            f"fewer than {MIN_CALLS} calls per rank at sizes both rows called at least {MIN_SIZE_CALLS} "
            "times "
            f"({matched_calls}; {len(pairs)} of {len(sizes)} sizes)",
            matched_share=round(share, 3),
            **counts,
        )
    if share < MIN_MATCHED_SHARE:
        return not_judged(
            f"the sizes both rows called enough hold {share:.0%} of a row's time there (at least "
            f"{MIN_MATCHED_SHARE:.0%} needed)",
            matched_share=round(share, 3),
            **counts,
        )
    weights = [r.calls * r.mean_us for _, r in pairs]
    total = sum(weights)
    weights = [w / total for w in weights]
    sized = [compare_size(s, r) for s, r in pairs]
    log_ratio = sum(w * lr for w, (lr, _) in zip(weights, sized, strict=True))
    within = sum(w * w * var for w, (_, var) in zip(weights, sized, strict=True))
    # A server's drift moves every size of a row alike: weighted sum, then the two rows' drifts apart.
    floor = sum(w * between_servers(s, r) for w, (s, r) in zip(weights, pairs, strict=True))
    sd = math.sqrt(within + 2 * floor * floor)
    excess = log_ratio - math.log1p(margin)
    z = excess / sd if sd > 0 else (math.inf if excess > 0 else -math.inf)
    return RangeSpeed(
        **base,
        ratio=round(math.exp(log_ratio), 4),
        calls=sum(s.calls for s, _ in pairs),
        reference_calls=sum(r.calls for _, r in pairs),
        passed=not z > SPEED_Z,
        z=round(z, 2) if math.isfinite(z) else None,
        fails_above=round((1 + margin) * math.exp(SPEED_Z * sd), 4),
        would_catch=round((1 + margin) * math.exp((SPEED_Z + POWER_Z) * sd), 4),
        matched_share=round(share, 3),
        between_servers=round(floor, 4),
        **counts,
    )


def compare(row: TimingSummary, reference: TimingSummary, margins: Margins) -> list[RangeSpeed]:
    """Every range either row called, in the ranges' order."""
    mine, theirs = row.by_range(), reference.by_range()
    names = [r.range for r in row.ranges] + [r.range for r in reference.ranges if r.range not in mine]
    order = {name: i for i, name in enumerate(_range_order(row, reference))}
    return [judge_range(mine.get(n), theirs.get(n), margins) for n in sorted(names, key=order.__getitem__)]


def _range_order(*summaries: TimingSummary) -> list[str]:
    from moe_eval.core.plugin_protocol import layer_range_names

    names = list(layer_range_names())
    return names + [r.range for s in summaries for r in s.ranges if r.range not in names]


def speed_check(
    row: TimingSummary, reference: TimingSummary, margins: Margins, reference_name: str
) -> tuple[Check | None, dict[str, Any]]:
    """The check (None when no range could be judged) and results.json's `speed` section."""
    ranges = compare(row, reference, margins)
    judged = [r for r in ranges if r.passed is not None]
    unjudged = [r for r in ranges if r.passed is None]
    # Graph-replayed ranges either row reached that were not judged: a pass cannot stand on the others.
    missing = [r for r in unjudged if r.replayed]
    slow = [r for r in judged if not r.passed]
    evidence = Evidence(
        unit="dispatch range",
        judged=len(judged),
        total=len(ranges),
        required=len(judged) + len(missing) if missing else None,
        would_catch=(
            f"x{max(r.would_catch for r in judged):.3f} in its least sensitive range" if judged else None
        ),
    )
    section = {
        "reference": reference_name,
        "rule": "matched call sizes",
        "margin": margins.replayed,
        "margin_eager": margins.eager,
        "min_calls": MIN_CALLS,
        "min_size_calls": MIN_SIZE_CALLS,
        "min_matched_share": MIN_MATCHED_SHARE,
        "z": SPEED_Z,
        "max_relative_error": MAX_RELATIVE_ERROR,
        "between_servers": {"replayed": BETWEEN_SERVERS_REPLAYED, "eager": BETWEEN_SERVERS_EAGER},
        "timed_on": list(row.timed_on),
        "ranges": [asdict(r) for r in ranges],
        "judged": len(judged),
        "required_not_judged": [r.range for r in missing],
        "evidence": asdict(evidence),
    }
    if not judged:
        return None, section
    # A failed gate's worst is its worst failing range: a wider ratio that passed by noise must not stand for
    # the failure in results.json, JUnit or the table.
    worst = max(slow or judged, key=lambda r: r.ratio)
    section["worst_ratio"] = worst.ratio
    section["worst_range"] = worst.range
    counted = f"judged {len(judged)}/{len(ranges)} ranges"
    if unjudged:
        counted += " (not judged: " + "; ".join(f"{r.range}: {r.why_not}" for r in unjudged) + ")"
    if slow:
        listed = "; ".join(_named(r) for r in slow)
        detail = f"slower than {reference_name} in {len(slow)} of {len(judged)} dispatch ranges: {listed}"
        return Check.judged("speed_gate", False, f"{detail}; {counted}", evidence=evidence), section
    sensitivity = "; ".join(f"{r.range} x{r.would_catch:.3f}" for r in judged)
    if missing:
        detail = (
            f"not run: {len(missing)} graph-replayed range(s) either row reached could not be judged "
            f"({', '.join(r.range for r in missing)}), so no pass stands on the other {len(judged)}; "
            f"none judged was slower; {counted}"
        )
        return Check.not_run("speed_gate", detail, evidence=evidence), section
    detail = (
        f"no range slower than {reference_name} beyond x(1 + margin) and noise in {len(judged)} of "
        f"{len(judged)} judged ranges; worst {_named(worst)}; would catch (80 %): {sensitivity}; {counted}"
    )
    return Check.judged("speed_gate", True, detail, evidence=evidence), section


def _named(r: RangeSpeed) -> str:
    """A judged range as a message names it, with the sizes it compared and where it would fail."""
    kind = "graph-replayed" if r.replayed else "eager"
    return (
        f"{r.range} x{r.ratio:.3f} ({kind}, {r.sizes_matched}/{r.sizes} sizes, "
        f"fails above x{r.fails_above:.3f}, "
        f"z = {r.z if r.z is not None else 'inf'})"
    )
