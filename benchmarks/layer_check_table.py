"""The layer check's calibration table from run folders (docs/logprob-gate.md, "The layer check").

    python benchmarks/layer_check_table.py RUN_FOLDER... [--json OUT.json]

One row per bundled-kernel config of each run: the mutation, strict-match accuracy, the golden gate's ratio
and verdict, the layer check's worst range (error / the incumbent arithmetic's), the experts it flags (range:
scale, the incumbent's, z), the checks that failed when it ran, and the layer check judged again now from the
processes' sums (<config>/layer-check/*.json) with this checkout's moe_eval.gates.layer_gate and the record's
limits (so a change of the rule is seen on the same measurements). --json writes the same rows as data.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_eval.core.record import RunRecord, result_files  # noqa: E402
from moe_eval.gates.layer_gate import (  # noqa: E402
    MIN_SLOTS,
    LayerCheckLimits,
    layer_checks,
    read_layer_files,
    summarize,
)


def rows(folder: Path) -> list[dict]:
    out = []
    for path in result_files(folder):
        record = RunRecord.read(path)
        check = record.judged.layer_check
        if not isinstance(check, dict) or not (path.parent / "layer-check").is_dir():
            continue  # vLLM's own kernel: no layer check
        limits = LayerCheckLimits(**check["limits"])
        summary = summarize(read_layer_files(path.parent))
        judged_now = layer_checks(summary, limits)
        ranges = [r for r in summary.ranges if r.rank == "all" and r.ratio is not None]
        worst = max(ranges, key=lambda r: r.ratio, default=None)
        flagged = [c for c in summary.experts if c.slots >= MIN_SLOTS and c.off(limits)]
        golden = record.judged.golden_gate or {}
        out.append(
            {
                "run": folder.name,
                "config": f"{path.parent.parent.name}/{path.parent.name}",
                "mutation": record.mutation,
                "status": record.status,
                "accuracy": record.accuracy,
                "golden_ratio": golden.get("ratio"),
                "golden_failed": (golden.get("rule") or {}).get("failed"),
                "worst_range": worst and {"range": worst.range, "ratio": worst.ratio, "rows": worst.rows},
                "ranges_covered": [r.range for r in summary.ranges if r.rank == "all"],
                "flagged": [
                    {
                        "range": c.range,
                        "rank": c.rank,
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
        "| experts flagged (range: s, incumbent's, z) | failed checks | layer checks failed, judged now |",
        "|---|---|---|---:|---:|---|---|---|---|",
    ]
    for r in all_rows:
        worst = r["worst_range"]
        flagged = "; ".join(
            f"{c['expert']} {c['range']}{'' if c['rank'] == 'all' else ' ' + c['rank']}: {c['scale']:+.4f}, "
            f"{c['incumbent_scale']:+.4f}, {c['z']:.0f}"
            for c in sorted(r["flagged"], key=lambda c: -abs(c["scale"]))
            if c["rank"] == "all"
        )
        golden = (
            "-"
            if r["golden_ratio"] is None
            else f"{r['golden_ratio']:.3f}" + (" FAIL" if r["golden_failed"] else "")
        )
        accuracy = "-" if r["accuracy"] is None else f"{r['accuracy']:.3f}"
        lines.append(
            f"| {r['run']} | {r['config']} | {r['mutation'] or 'none'} | {accuracy} | {golden} | "
            f"{worst['ratio']:.3f} ({worst['range']}) | {flagged or 'none'} | "
            f"{', '.join(r['failed_checks']) or 'none'} | "
            f"{', '.join(r['layer_checks_failed_now']) or 'none'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    all_rows = [row for folder in args.runs for row in rows(folder)]
    print(markdown(all_rows))
    if args.json:
        args.json.write_text(json.dumps(all_rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
