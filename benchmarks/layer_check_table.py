"""The layer check's calibration and power table from run folders (docs/logprob-gate.md, "The layer check").

    python benchmarks/layer_check_table.py RUN_FOLDER... [--json OUT.json] [--power]

One row per bundled-kernel config of each run: the mutation, strict-match accuracy, the golden gate's ratio
and verdict, the layer check judged again now from the processes' tables (<config>/layer-check/*.npz) with
this checkout's moe_eval.gates.layer_gate and the record's limits (a change of the rule is seen on the same
measurements): the worst range (error / the incumbent arithmetic's), the (range, expert) cells that resolve
the power target (a 1 % one-expert error with 80 % probability) of those owed, and the same per layer, the
SiLU slope direction's largest reading, the experts it flags (range, layer: scale, the incumbent's, z), the
checks that failed when it ran and those that fail now. --json writes the same rows as data. --power adds
the power table: per run and dispatch range, the (range, expert) cells judged at 1 % of those owed (summed
over the ranks), the error 95 % of them resolve (the worst rank's), and the least-routed expert with its
routed slots.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_eval.core import layer_cells  # noqa: E402
from moe_eval.core.record import RunRecord, result_files  # noqa: E402
from moe_eval.gates.layer_gate import LayerCheckLimits, layer_checks, summarize  # noqa: E402


def rows(folder: Path) -> list[dict]:
    out = []
    for path in result_files(folder):
        record = RunRecord.read(path)
        check = record.judged.get("layer_check")
        if not isinstance(check, dict) or not (path.parent / "layer-check").is_dir():
            continue  # vLLM's own kernel: no layer check
        limits = LayerCheckLimits(**check["limits"])
        files, problems = layer_cells.read_folder(path.parent)
        summary = summarize(files, limits, int(check.get("world_size", len(files))), problems)
        judged_now = layer_checks(summary, limits)
        pooled = "all" if summary.processes > 1 else None
        ranges = [
            r
            for r in summary.ranges
            if r.layer is None and r.ratio is not None and (pooled is None or r.rank == pooled)
        ]
        worst = max(ranges, key=lambda r: r.ratio, default=None)
        power = [p for p in summary.power if pooled is None or p.rank != "all"]
        activation = [
            c for c in summary.activation if c.layer is None and (pooled is None or c.rank == pooled)
        ]
        steepest = max(activation, key=lambda c: abs(c.scale), default=None)
        flagged = [
            c for c in summary.experts if c.z is None or (c.threshold is not None and c.z >= c.threshold)
        ]
        flagged = [
            c for c in flagged if abs(c.scale) > limits.scale_bound and abs(c.scale) > abs(c.incumbent_scale)
        ]
        golden = record.judged.get("golden_gate") or {}
        out.append(
            {
                "run": folder.name,
                "config": f"{path.parent.parent.name}/{path.parent.name}",
                "mutation": record.mutation,
                "status": record.status,
                # A random-weight twin's answers mean nothing: n/a, never 0.000.
                "accuracy": None if "skipped" in (record.judged.get("gate") or {}) else record.accuracy,
                "golden_ratio": golden.get("ratio"),
                "golden_failed": (golden.get("rule") or {}).get("failed"),
                "layers": summary.layers,
                "worst_range": worst and {"range": worst.range, "ratio": worst.ratio, "rows": worst.rows},
                "cells": sum(p.cells for p in power),
                "cells_judged": sum(p.judged for p in power),
                "layer_cells": sum(p.layer_cells for p in power),
                "layer_cells_judged": sum(p.layer_judged for p in power),
                "power": [
                    {
                        "range": p.range,
                        "rank": p.rank,
                        "judged": p.judged,
                        "cells": p.cells,
                        "detectable_95": p.detectable_95,
                        "unjudged": p.unjudged,
                        "not_routed": p.not_routed,
                        "least_routed": p.least_routed,
                    }
                    for p in power
                ],
                "activation": steepest
                and {"range": steepest.range, "eps": steepest.scale, "incumbent": steepest.incumbent_scale},
                "flagged": [
                    {
                        "range": c.range,
                        "rank": c.rank,
                        "layer": c.layer,
                        "expert": c.expert,
                        "slots": c.slots,
                        "scale": c.scale,
                        "incumbent_scale": c.incumbent_scale,
                        "z": c.z,
                    }
                    for c in flagged
                ],
                "failed_checks": [c.name for c in record.verdict.checks if not c.passed],
                "layer_checks_failed_now": [c.name for c in judged_now if not c.passed],
            }
        )
    return out


def markdown(all_rows: list[dict]) -> str:
    lines = [
        "| run | config | mutation | strict-match | golden ratio | worst range (x incumbent) "
        "| cells judged at 1 % (per layer) | SiLU slope (incumbent) "
        "| experts flagged (range, layer: s, incumbent's, z) | failed checks "
        "| layer checks failed, judged now |",
        "|---|---|---|---:|---:|---|---|---|---|---|---|",
    ]
    for r in all_rows:
        worst = r["worst_range"]
        shown = sorted(r["flagged"], key=lambda c: -abs(c["scale"]))[:6]
        flagged = "; ".join(
            f"{c['expert']} {c['range']}{'' if c['layer'] is None else ' L' + str(c['layer'])}"
            f"{'' if c['rank'] in ('all', 'TP0/1') else ' ' + c['rank']}: {c['scale']:+.4f}, "
            f"{c['incumbent_scale']:+.4f}, {'inf' if c['z'] is None else format(c['z'], '.0f')}"
            for c in shown
        ) + (f" (+{len(r['flagged']) - 6})" if len(r["flagged"]) > 6 else "")
        judged = f"{r['cells_judged']}/{r['cells']} ({r['layer_cells_judged']}/{r['layer_cells']})"
        act = r["activation"]
        slope = "-" if act is None else f"{act['eps']:+.4f} ({act['incumbent']:+.4f}, {act['range']})"
        golden = (
            "-"
            if r["golden_ratio"] is None
            else f"{r['golden_ratio']:.3f}" + (" FAIL" if r["golden_failed"] else "")
        )
        accuracy = "n/a" if r["accuracy"] is None else f"{r['accuracy']:.3f}"
        lines.append(
            f"| {r['run']} | {r['config']} | {r['mutation'] or 'none'} | {accuracy} | {golden} | "
            f"{worst['ratio']:.3f} ({worst['range']}) | {judged} | {slope} | {flagged or 'none'} | "
            f"{', '.join(r['failed_checks']) or 'none'} | "
            f"{', '.join(r['layer_checks_failed_now']) or 'none'} |"
        )
    return "\n".join(lines)


def power_markdown(all_rows: list[dict]) -> str:
    from moe_eval.core.plugin_protocol import layer_range_names

    names = list(layer_range_names())
    lines = ["| run | config | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for r in all_rows:
        cells = []
        for name in names:
            rows = [p for p in r["power"] if p["range"] == name]
            if not rows:
                cells.append("-")
                continue
            d95 = [p["detectable_95"] for p in rows]
            worst = "none" if any(d is None for d in d95) else f"{max(d95):.2%}"
            rare = min(
                (p["least_routed"] for p in rows if p["least_routed"]), key=lambda x: x[1], default=None
            )
            rare_text = f"; rarest {rare[0]} ({rare[1]})" if rare else ""
            cells.append(
                f"{sum(p['judged'] for p in rows)}/{sum(p['cells'] for p in rows)} ({worst}{rare_text})"
            )
        lines.append(f"| {r['run']} | {r['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--power", action="store_true", help="also the per-range power table")
    args = parser.parse_args(argv)
    all_rows = [row for folder in args.runs for row in rows(folder)]
    print(markdown(all_rows))
    if args.power:
        print()
        print(power_markdown(all_rows))
    if args.json:
        args.json.write_text(json.dumps(all_rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
