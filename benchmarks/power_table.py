"""The speed gate's power and false alarms from stored served runs (docs/perf.md, "The speed gate with the
eager calls gated"), re-judged by the rule as it is now.

    python benchmarks/power_table.py docs/data/speed_h100/power-gated-twin.json [...]

Each file holds the slimmed rows (benchmarks/speed_table.py --slim) of benchmarks/device/served_speed.sh
STAGE=power runs: pairs (vLLM's row and the bundled row of one run id), then bundled rows judged against that
pair (repeats: no mutation; `slow_range` mutations). Every later row is judged against the pair's bundled row
(its own earlier run, as `--baseline`) and against the pair's vLLM row (the incumbent); correct bundled rows
also against every earlier correct bundled row. Prints per range: the ratio, and "fails above" (the gate's
threshold at that range's errors), with FAIL where the range failed.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

from moe_eval.core.moe_timing import TimingSummary
from moe_eval.core.plugin_protocol import layer_range_names
from moe_eval.gates.speed import Margins, compare, speed_check

MARGINS = Margins(replayed=0.01, eager=0.03)  # the config defaults


def timing(row: dict[str, Any]) -> TimingSummary:
    return TimingSummary.from_dict(row["timing"]["moe"])


def verdicts(row: dict[str, Any], reference: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """(the gate's verdict, per range 'x1.052 / x1.039 FAIL')."""
    check, _ = speed_check(timing(row), timing(reference), MARGINS, reference["run"])
    cells = {}
    for judged in compare(timing(row), timing(reference), MARGINS):
        if judged.passed is None:
            cells[judged.range] = "not judged"
        else:
            mark = " **FAIL**" if judged.passed is False else ""
            cells[judged.range] = f"x{judged.ratio:.3f} / x{judged.fails_above:.3f}{mark}"
    verdict = "not run" if check is None else ("pass" if check.passed else "**FAIL**")
    if check is not None and check.passed and check.evidence and check.evidence.required:
        verdict = "not run (a graph-replayed range not judged)"
    return verdict, cells


def label(row: dict[str, Any]) -> str:
    kind = "vLLM" if "vllm" in row["config"] else "bundled"
    return f"{row['run']} {kind}" + (f" `{row['mutation']}`" if row["mutation"] else "")


def comparisons(rows: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    pairs: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        if row["mutation"] is None:
            pairs.setdefault(row["run"], {})["vllm" if "vllm" in row["config"] else "bundled"] = row
    pair_ids = sorted(run for run, both in pairs.items() if len(both) == 2)
    out = []
    for run in pair_ids:
        out.append(("correct vs vLLM", pairs[run]["bundled"], pairs[run]["vllm"]))
    correct = sorted(
        (r for r in rows if r["mutation"] is None and "vllm" not in r["config"]), key=lambda r: r["run"]
    )
    for earlier, later in itertools.combinations(correct, 2):
        out.append(("correct vs own earlier", later, earlier))
    for row in sorted((r for r in rows if r["mutation"]), key=lambda r: r["run"]):
        pair = max(p for p in pair_ids if p < row["run"])
        out.append(("mutated vs own earlier", row, pairs[pair]["bundled"]))
        out.append(("mutated vs vLLM", row, pairs[pair]["vllm"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    names = list(layer_range_names())
    for path in args.files:
        rows = json.loads(path.read_text())
        machines = sorted({m for r in rows for m in r["machine"]})
        print(f"\n### {path.name} ({', '.join(machines)})\n")
        print("| comparison | row | reference | verdict | " + " | ".join(names) + " |")
        print("|---|---|---|---|" + "---:|" * len(names))
        for kind, row, reference in comparisons(rows):
            verdict, cells = verdicts(row, reference)
            print(
                f"| {kind} | {label(row)} | {label(reference)} | {verdict} | "
                + " | ".join(cells.get(n, "-") for n in names)
                + " |"
            )


if __name__ == "__main__":
    main()
