"""Helpers for the tests that re-judge stored served runs (docs/data/speed_h100/power-*.json, slimmed rows of
benchmarks/device/served_speed.sh STAGE=power) by the speed gate's rule as it is now."""

from __future__ import annotations

import json
from pathlib import Path

from moe_eval.core.moe_timing import TimingSummary
from moe_eval.gates.speed import Margins, RangeSpeed, compare

MARGINS = Margins(replayed=0.01, eager=0.03)  # the config defaults
DECODE = ("M=1", "M=2-16", "M=17-64", "M=65-256")
EAGER = ("M=257-1023", "M=1024-4095", "M>=4096")
SLOWED = "slow_range:range=all,pct=5,eager_pct=10"


def stored_rows(repo_root: Path, stem: str) -> list[dict]:
    """The rows of docs/data/speed_h100/<stem>.json."""
    return json.loads((repo_root / "docs/data/speed_h100" / f"{stem}.json").read_text())


def timing(row: dict) -> TimingSummary:
    return TimingSummary.from_dict(row["timing"]["moe"])


def ranges_judged(row: dict, reference: dict) -> dict[str, RangeSpeed]:
    return {r.range: r for r in compare(timing(row), timing(reference), MARGINS)}


def correct(rows: list[dict], vllm: bool = False) -> list[dict]:
    """The unmutated rows of the bundled kernel (or of vLLM's), oldest first."""
    chosen = [r for r in rows if r["mutation"] is None and ("vllm" in r["config"]) == vllm]
    return sorted(chosen, key=lambda r: r["run"])


def baseline(rows: list[dict], row: dict) -> dict:
    """The bundled row of the pair run (vLLM's row and the bundled one) just before `row`: its --baseline."""
    pairs = {r["run"] for r in correct(rows, vllm=True)}
    earlier = (r for r in correct(rows) if r["run"] in pairs and r["run"] < row["run"])
    return max(earlier, key=lambda r: r["run"])


def slowed(row: dict) -> bool:
    """A row served with the slow_range mutation (a spin added to the bundled kernel's calls)."""
    return row["mutation"] is not None and row["mutation"].startswith("slow_range")


def judged_rows(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(bundled row, its --baseline: the pair's bundled row just before it) for every bundled row outside a
    pair run (the repeats and the mutated rows), oldest first: the comparisons the served run made."""
    pair_runs = {r["run"] for r in correct(rows, vllm=True)}
    later = [r for r in rows if "vllm" not in r["config"] and r["run"] not in pair_runs]
    return [(r, baseline(rows, r)) for r in sorted(later, key=lambda r: r["run"])]
