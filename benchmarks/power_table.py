"""The speed gate's power and false alarms from stored served runs (docs/perf.md, "The speed gate with the
eager calls gated"), re-judged by the rule as it is now.

    python benchmarks/power_table.py docs/data/speed_h100/power-gated-twin.json [...] [--floors]

Each file holds the slimmed rows (benchmarks/speed_table.py --slim) of benchmarks/device/served_speed.sh
STAGE=power runs: pairs (vLLM's row and the bundled row of one run id), then bundled rows run with
`--baseline` a pair's run (repeats: no mutation; `slow_range` mutations). Each pair's bundled row is judged
against its vLLM row; each correct bundled row against every earlier one (its own earlier runs); each
mutated row against the bundled row of its --baseline (read from its speed_gate detail) and against that
pair's vLLM row. Prints per range: the ratio, and "fails above" (the gate's threshold at that range's
errors), with FAIL where the range failed.

--together judges the rows of all the files as one set, so a correct row of one session is judged against
the earlier runs of another (each session's files come from one machine, handed back after it: a pair from
two files is a pair from two machines, marked "another machine").

--floors prints instead what servers of one kernel differ by per call size (every pair of its correct rows,
replayed and eager sizes apart, eager sizes with the yardstick beside them in both rows read with it and
alone): the rms of z (log ratio over its within-run error) and the per-server floor beyond those errors; the
figures gates/speed.py cites for the gated eager floor.

--rows prints instead each row's mean call per range beside its GPU's SM clock over the timed requests
(`timing.gpu_clocks`: min / median / max MHz, or why there is none), in the order of their run ids (a
pair's two rows share one): does a server whose calls ran slower also clock lower?
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
from pathlib import Path
from typing import Any

from moe_eval.core.moe_timing import TimingSummary
from moe_eval.core.plugin_protocol import layer_range_names
from moe_eval.gates.speed import Margins, compare, compare_size, matched_sizes, paired, speed_check

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
        where = ", another machine" if earlier.get("_file") != later.get("_file") else ""
        out.append((f"correct vs own earlier{where}", later, earlier))
    for row in sorted((r for r in rows if r["mutation"]), key=lambda r: r["run"]):
        pair = baseline_run(row)
        if pair not in pair_ids:
            print(f"{label(row)}: its --baseline {pair} is not a pair in this file: left out")
            continue
        out.append(("mutated vs own earlier", row, pairs[pair]["bundled"]))
        out.append(("mutated vs vLLM", row, pairs[pair]["vllm"]))
    return out


def baseline_run(row: dict[str, Any]) -> str | None:
    """The run id of the row's --baseline, as its speed_gate check named the reference's results.json."""
    detail = next((c["detail"] for c in row["checks"] if c["name"] == "speed_gate"), "")
    found = re.search(r"/(\d{8}-\d{6})/", detail or "")
    return found.group(1) if found else None


def floors(rows: list[dict[str, Any]]) -> None:
    """Same-kernel servers, size for size: rms z and the per-server floor beyond the within-run errors."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["mutation"] is None:
            kinds.setdefault("vLLM" if "vllm" in row["config"] else "bundled", []).append(row)
    for kind, same in sorted(kinds.items()):
        pairs: dict[str, list[tuple[float, float]]] = {
            "replayed": [],
            "eager": [],
            "eager paired": [],
            "eager paired, read alone": [],
        }
        for a, b in itertools.combinations(same, 2):
            theirs = timing(b).by_range()
            for name, mine in timing(a).by_range().items():
                other = theirs.get(name)
                if other is None or mine.sizes is None or other.sizes is None:
                    continue
                for size, ref in matched_sizes(mine.sizes, other.sizes)[0]:  # the gate's matched sizes
                    if size.replayed >= size.calls:
                        pairs["replayed"].append(compare_size(size, ref))
                    elif paired(size, ref):  # the yardstick beside both: read with it, and without it
                        pairs["eager paired"].append(compare_size(size, ref, pair=True))
                        pairs["eager paired, read alone"].append(compare_size(size, ref))
                    else:
                        pairs["eager"].append(compare_size(size, ref))
        for how, found in pairs.items():
            if found:
                rms_z = math.sqrt(sum(lr * lr / v for lr, v in found) / len(found))
                excess = sum(lr * lr - v for lr, v in found) / len(found)
                print(
                    f"{kind} {how}: {len(found)} size pairs over {len(same)} servers, rms z {rms_z:.2f}, "
                    f"per-server floor {math.sqrt(max(excess, 0.0) / 2):.4f}"
                )


def clocks(row: dict[str, Any]) -> str:
    found = (row.get("timing") or {}).get("gpu_clocks")
    if not found:
        return "not recorded"
    if "error" in found:
        said = found["error"].partition("it said: ")[2].rstrip(")") or found["error"]
        return f"none ({said[:100]})"
    low, middle, high = found["sm_mhz_min"], found["sm_mhz_median"], found["sm_mhz_max"]
    return f"{low:.0f} / {middle:.0f} / {high:.0f} ({found['samples']})"


def row_means(rows: list[dict[str, Any]], names: list[str]) -> None:
    """Each row's mean call per range (us) and its SM clock, by run id."""
    print("| row | SM MHz min / median / max (samples) | " + " | ".join(names) + " |")
    print("|---|---|" + "---:|" * len(names))
    for row in sorted(rows, key=lambda r: r["run"]):
        found = {r.range: r for r in timing(row).ranges}
        cells = [f"{found[n].mean_us:.1f}" if n in found and found[n].calls else "-" for n in names]
        print(f"| {label(row)} | {clocks(row)} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--floors", action="store_true", help="same-kernel spread per size, not the tables")
    parser.add_argument("--together", action="store_true", help="all files' rows as one set")
    parser.add_argument("--rows", action="store_true", help="each row's mean call per range and SM clock")
    args = parser.parse_args()
    names = list(layer_range_names())
    sets = [(p.name, [dict(r, _file=p.name) for r in json.loads(p.read_text())]) for p in args.files]
    if args.together:
        sets = [(" + ".join(name for name, _ in sets), [r for _, rows in sets for r in rows])]
    for name, rows in sets:
        if args.floors:
            print(f"\n### {name}")
            floors(rows)
            continue
        if args.rows:
            print(f"\n### {name}\n")
            row_means(rows, names)
            continue
        machines = sorted({m for r in rows for m in r["machine"]})
        print(f"\n### {name} ({', '.join(machines)})\n")
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
