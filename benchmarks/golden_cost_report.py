"""The golden gate's cost from benchmarks/golden_cost_ab.sh's folders: each run's seconds, the medians with
and without the gate (per folder and over all given), and the gate's own part of each run with it (the
decode continuations and the golden look-up, from each config's results.json timings).

    python benchmarks/golden_cost_report.py WORK [WORK ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from moe_eval.core.record import records

GATE_TIMINGS = ("decode_seconds", "golden_seconds")  # what the gate adds to a config's run


def read_times(work: Path) -> dict[str, float]:
    """golden_cost_ab.sh's times.txt: "<run> exit <rc> seconds <s>" a line; a run that did not pass is an
    error (its time measures something else)."""
    times = {}
    for line in (work / "times.txt").read_text().splitlines():
        name, _, rc, _, seconds = line.split()
        if rc != "0":
            raise SystemExit(f"{work}: {name} exited {rc}; no ratio")
        times[name] = float(seconds)
    return times


def gate_seconds(run: Path, keys: tuple[str, ...] = GATE_TIMINGS) -> float:
    return sum(r.bookkeeping.timings.get(k, 0.0) for r in records(run) for k in keys)


def ratio_line(label: str, times: dict[str, float]) -> str:
    with_gate = [s for n, s in times.items() if n.startswith("with-")]
    without = [s for n, s in times.items() if n.startswith("without-")]
    a, b = statistics.median(with_gate), statistics.median(without)
    return (
        f"{label}: median with the gate {a:.1f} s, without {b:.1f} s: x{a / b:.3f} ({len(with_gate)} pairs)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("works", type=Path, nargs="+")
    parser.add_argument(
        "--gate-timings",
        nargs="+",
        default=list(GATE_TIMINGS),
        help="the results.json timings keys that are the gate's own part (another gate: layer_sweep_seconds)",
    )
    args = parser.parse_args(argv)
    keys = tuple(args.gate_timings)
    every: dict[str, float] = {}
    for work in args.works:
        times = read_times(work)
        for name, seconds in times.items():
            part = (
                f", the gate's own {gate_seconds(work / name, keys):.1f} s"
                if name.startswith("with-")
                else ""
            )
            print(f"{work.name}/{name}: {seconds:.1f} s{part}")
        print(ratio_line(str(work), times))
        every.update({f"{name}@{work}": seconds for name, seconds in times.items()})  # names kept apart
    if len(args.works) > 1:
        print(ratio_line("all", every))
    return 0


if __name__ == "__main__":
    sys.exit(main())
