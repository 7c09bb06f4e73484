"""The speed gate: per dispatch range, the served MoE call's time against the reference's (no I/O).

The reference is the row's incumbent: vLLM's own kernel at the same layout (baseline_config), or with
`run --baseline RUN` the same config's row of an earlier run (the regression case, "before my change"). Both
were timed on the same workload (evaluate/moe_speed.py), so per range the mean call compares directly:
time <= reference x (1 + speed_margin), a range failing only where the excess is beyond SPEED_Z standard
errors too: the two means' within-run errors and, for the time a range spent in eager device-timed calls, what
such time moves between two servers of one kernel (EAGER_BETWEEN_SERVERS). A range is judged where both rows
timed at least MIN_CALLS calls and the reference's mean call is above 0; the reference must have run on the
same machine (GPU names, or CPU model) and sent the same timed requests (times_differ_by), or nothing is
judged.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from moe_eval.core.check import Check
from moe_eval.core.moe_timing import RangeTiming, TimingSummary

# A range's mean call from fewer calls is mostly one or two calls' luck (the first prefill of a size, a
# scheduler hiccup); the timed workload makes >= 3 calls per layer in every range it reaches.
MIN_CALLS = 12
# A range fails only where its excess over the margin is also beyond this many standard errors of the two
# means (each: the calls' spread / sqrt(calls), the spread including the M mix of the range, the same in both
# rows). On the H200 canary the CUDA-graph decode ranges read 0.2-0.5 % standard error and two runs of one
# kernel agreed within 1 %; the eager prefill ranges (12-16 calls, host-launch bound) read 3-13 % and moved
# 445-772 us between runs of the same kernel, and vLLM's row once held a 1.1 s JIT compile in one of them.
SPEED_Z = 3.0
# A mean whose standard error is over half of it is a few calls' time, not the kernel's: one call holding
# most of a range's time reads ~100 % (vLLM's row held a ~1 s compile in one of 20 prefill calls on the H200,
# runs 2 and 3: a 48 ms mean), where the H200's eager ranges read 3-23 % and its graph-replayed ones under
# 3 %. Such a range passes by drowning the excess in the error, so a pass there is named as not judged; a
# range slower beyond SPEED_Z standard errors even so still fails.
MAX_RELATIVE_ERROR = 0.5
# A row's standard deviation of the log of a range's mean call between two servers of one kernel, for eager
# device-timed calls (not CUDA-graph replays: the GPU waits inside the timer's bracket for the host's
# launches, whose pace differs between server processes far beyond the within-run errors). Measured on the
# H200 (docs/data/speed_h200/*.json): the same kernel's rows in two files (the canary's bundled and vLLM rows
# over runs 1-3, the Qwen3 twin's over runs 1-2), ranges M >= 257 neither holding a compile: the log ratio's
# rms was 0.294 over 15 pairs, 0.208 per server (tests/speed/test_h200_records.py recomputes it; the 6 pairs
# of ranges the gate would judge, >= MIN_CALLS calls in both, read 0.154). The graph-replayed ranges agreed
# within 1-5 % between servers and get no floor. A wholly eager range then fails above (1 + margin) x
# exp(3 x 0.21 x sqrt 2), x2.80 at the default margin: only gross slowdowns show there.
EAGER_BETWEEN_SERVERS = 0.21


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
class RangeSpeed:
    range: str
    us: float | None  # None: this row made no call there
    reference_us: float | None
    ratio: float | None  # us / reference_us; None: not judged
    calls: int
    reference_calls: int
    passed: bool | None  # None: not judged
    why_not: str | None = None
    z: float | None = None  # the excess over the margin in standard errors (fails beyond SPEED_Z)
    # The ratio above which this range would have failed, at its measured standard errors: what the gate
    # could see here (near 1 + margin where graphs replay; ~x2.2 in the H200's eager prefill ranges).
    fails_above: float | None = None
    # The larger of the two rows' shares of this range's time in calls not replayed from a CUDA graph (the
    # error holds each row's own, eager_shares); None where neither row counted it (records before the
    # count) or it was not judged; 0 where neither row was timed on the device.
    eager_share: float | None = None


def eager_shares(
    row: TimingSummary, reference: TimingSummary, mine: RangeTiming, other: RangeTiming
) -> tuple[float, float] | None:
    """Each row's share of the range's time in eager calls on a device, whose pace moves between servers
    beyond the within-run error; a row that did not count it (a record before the count) is taken to have
    the other's (the same timed requests). None where neither counted; (0, 0) where neither row was timed
    on the device (the CPU), whose rule is as it was. A row timed on the host beside one timed on the
    device (a GPU whose stamp kernels failed) reads wholly eager, as its calls' host time is. By time, not
    calls: in a range of graph-replayed decode calls and a few eager prefill ones, the eager calls can hold
    most of the time."""
    if mine.eager_share is None and other.eager_share is None:
        return None
    if "device" not in row.timed_on and "device" not in reference.timed_on:
        return 0.0, 0.0
    mine_share = other.eager_share if mine.eager_share is None else mine.eager_share
    reference_share = mine.eager_share if other.eager_share is None else other.eager_share
    return mine_share, reference_share


def between_servers_error(reference_us: float, margin: float, shares: tuple[float, float]) -> float:
    """The floor a range's eager time adds to its error, in us. Between servers a mean moves by a factor
    (log-normal: EAGER_BETWEEN_SERVERS is a standard deviation of its log), so two rows' ratio by
    exp(EAGER_BETWEEN_SERVERS x hypot of their eager shares); the floor is that factor's Z-standard-error
    width at the rule's threshold ((1 + margin) x the reference), so that a range with no within-run error
    fails above exactly (1 + margin) x exp(SPEED_Z x that log spread), and a slower row does not widen its
    own error (taken at its measured mean, a x3 row would pass)."""
    log_spread = EAGER_BETWEEN_SERVERS * math.hypot(*shares)
    return (1 + margin) * reference_us * math.expm1(SPEED_Z * log_spread) / SPEED_Z


def compare(
    row: TimingSummary, reference: TimingSummary, margin: float, min_calls: int = MIN_CALLS
) -> list[RangeSpeed]:
    ref = reference.by_range()
    out = []
    mine = {timing.range for timing in row.ranges}
    for timing in row.ranges:
        other = ref.get(timing.range)
        if other is None or other.calls < min_calls or timing.calls < min_calls or other.mean_us <= 0:
            if other is None:
                why = "the reference made no call there"
            elif other.calls < min_calls or timing.calls < min_calls:
                why = f"fewer than {min_calls} calls timed ({timing.calls} here, {other.calls} there)"
            else:  # no ratio to judge (a timer that summed nothing): never a pass by an infinite ratio
                why = f"the reference's mean call is {other.mean_us:g} us"
            out.append(
                RangeSpeed(timing.range, timing.mean_us, other and other.mean_us, None, timing.calls,
                           other.calls if other else 0, None, why)
            )  # fmt: skip
            continue
        mine_error, ref_error = (t.spread_us / math.sqrt(t.calls) for t in (timing, other))
        ratio = timing.mean_us / other.mean_us
        shares = eager_shares(row, reference, timing, other)
        error = math.hypot(mine_error, ref_error)
        if shares:
            error = math.hypot(error, between_servers_error(other.mean_us, margin, shares))
        excess = timing.mean_us - (1 + margin) * other.mean_us
        z = excess / error if error > 0 else (math.inf if excess > 0 else -math.inf)
        wide = [
            f"{who}'s calls spread too wide (standard error {err / t.mean_us:.0%} of its mean "
            f"{t.mean_us:.1f} us: a few calls hold most of the time, such as a compile while serving)"
            for who, t, err in (("this row", timing, mine_error), ("the reference", other, ref_error))
            if t.mean_us > 0 and err > MAX_RELATIVE_ERROR * t.mean_us
        ]
        if wide and not (excess > 0 and z > SPEED_Z):
            out.append(
                RangeSpeed(timing.range, timing.mean_us, other.mean_us, None, timing.calls, other.calls,
                           None, "; ".join(wide))
            )  # fmt: skip
            continue
        fails_above = (1 + margin) + SPEED_Z * error / other.mean_us
        out.append(
            RangeSpeed(
                timing.range, timing.mean_us, other.mean_us, round(ratio, 4), timing.calls, other.calls,
                not (excess > 0 and z > SPEED_Z), z=round(z, 2) if math.isfinite(z) else None,
                fails_above=round(fails_above, 3),
                eager_share=None if shares is None else round(max(shares), 3),
            )
        )  # fmt: skip
    # A range only the reference reached is one this row was not judged in, never silently left out.
    for other in reference.ranges:
        if other.range not in mine:
            out.append(
                RangeSpeed(other.range, None, other.mean_us, None, 0, other.calls, None,
                           "this row made no call there")
            )  # fmt: skip
    return out


def speed_check(
    row: TimingSummary, reference: TimingSummary, margin: float, reference_name: str
) -> tuple[Check | None, dict[str, Any]]:
    """The check (None when no range could be judged) and results.json's `speed` section."""
    ranges = compare(row, reference, margin)
    judged = [r for r in ranges if r.passed is not None]
    unjudged = [r for r in ranges if r.passed is None]
    section = {
        "reference": reference_name,
        "margin": margin,
        "min_calls": MIN_CALLS,
        "z": SPEED_Z,
        "max_relative_error": MAX_RELATIVE_ERROR,
        "eager_between_servers": EAGER_BETWEEN_SERVERS,
        "timed_on": list(row.timed_on),
        "ranges": [asdict(r) for r in ranges],
        "judged": len(judged),
    }
    if not judged:
        return None, section
    slow = [r for r in judged if not r.passed]
    # A failed gate's worst is its worst failing range: a wider ratio that passed by noise must not stand for
    # the failure in results.json, JUnit or the table.
    worst = max(slow or judged, key=lambda r: r.ratio)
    # A pass over the margin is not "within" it: such a range is named with the ratio it would fail above,
    # so a reader sees that the gate let a slowdown through as noise, and how large one it would have caught.
    over = [r for r in judged if r.passed and r.ratio > 1 + margin]
    if slow:
        listed = "; ".join(_named(r) for r in slow)
        detail = (
            f"slower than x{1 + margin:.2f} of {reference_name} in {len(slow)} of {len(judged)} dispatch "
            f"ranges; slower: {listed}"
        )
    elif over:
        listed = "; ".join(
            f"{_named(r)} (fails above x{r.fails_above:.2f}, z = {r.z:.1f} of {SPEED_Z:g})"
            for r in sorted(over, key=lambda r: -r.ratio)
        )
        detail = (
            f"no range beyond noise: within x{1 + margin:.2f} of {reference_name} in "
            f"{len(judged) - len(over)} of {len(judged)} dispatch ranges, over it but within noise in "
            f"{len(over)}: {listed}"
        )
    else:
        detail = (
            f"within x{1 + margin:.2f} of {reference_name} in {len(judged)} of {len(judged)} dispatch "
            f"ranges; worst: {_named(worst)}"
        )
    if any(_eager_named(r) for r in judged):
        detail += (
            "; a range's eager time (calls not replayed from a CUDA graph) widens its error by what such "
            "time moves between two servers of one kernel (a factor of "
            f"exp({EAGER_BETWEEN_SERVERS:g}) per row, one standard deviation)"
        )
    detail += f"; judged {len(judged)}/{len(ranges)} ranges"
    if unjudged:
        detail += " (not judged: " + "; ".join(f"{r.range}: {r.why_not}" for r in unjudged) + ")"
    section["worst_ratio"] = worst.ratio
    section["worst_range"] = worst.range
    return Check("speed_gate", not slow, detail), section


def _named(r: RangeSpeed) -> str:
    """A judged range as a message names it; "(97% eager)" says why its fails_above is ~x2."""
    eager = f" ({r.eager_share:.0%} eager)" if _eager_named(r) else ""
    return f"{r.range}{eager} {r.us:.1f} us x{r.ratio:.2f}"


def _eager_named(r: RangeSpeed) -> bool:
    """A range whose eager time is large enough to name (5 %): below it the floor barely widens the error."""
    return r.eager_share is not None and r.eager_share >= 0.05
