"""The decode comparison judged again, with this checkout's rule, on stored run folders
(docs/logprob-gate.md, "The decode comparison").

    python benchmarks/decode_rule_table.py --goldens DIR RUN_FOLDER... [--json OUT.json]

For each config of a run that has greedy continuations (decode.jsonl) and a baseline_config in the same run
folder: the golden's continuations (DIR/<digest>/decode.jsonl, the digest from the row's results.json),
the row's and its incumbent's errors by `moe_eval.gates.golden_errors.decode_errors` and the verdict of
`decode_rule` with the row's margin and alpha. The verdict the run recorded is shown beside it, so a
change of the rule is seen on the same captures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_eval.core.logprob_texts import read_logprobs  # noqa: E402
from moe_eval.core.record import RunRecord, result_files  # noqa: E402
from moe_eval.gates.golden_errors import decode_errors, decode_rule  # noqa: E402


def rows_of(run_folder: Path, goldens: Path) -> list[dict]:
    rows = []
    for path in result_files(run_folder):
        record = RunRecord.read(path)
        gate = record.judged.get("golden_gate") or {}
        baseline = record.config.get("baseline_config")
        decode = path.parent / "decode.jsonl"
        if not gate.get("golden") or not baseline or not decode.is_file():
            continue
        # A run folder holds <config folder>/<config name>/; baseline_config is relative to the config.
        incumbent = path.parent.parent / Path(baseline).parent / Path(baseline).stem / "decode.jsonl"
        golden = read_logprobs(goldens / gate["golden"] / "decode.jsonl")
        run = decode_errors(golden, read_logprobs(decode))
        inc = decode_errors(golden, read_logprobs(incumbent))
        rule = decode_rule(run, inc, gate.get("margin", 0.10), gate.get("alpha", 0.01))
        recorded = record.check("golden_gate_decode")
        rows.append(
            {
                "run": run_folder.name,
                "config": f"{path.parent.parent.name}/{path.parent.name}",
                "mutation": record.mutation or "none",
                "error": run.mean_abs,
                "incumbent_error": inc.mean_abs,
                "ratio": None if rule is None else rule.ratio,
                "p": None if rule is None else rule.p,
                "texts_worse": None if rule is None else f"{rule.texts_worse}/{rule.texts}",
                "failed_now": None if rule is None else rule.failed,
                "recorded": None if recorded is None else ("pass" if recorded.passed else "FAIL"),
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--goldens", type=Path, required=True, help="the golden cache the runs used")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [row for run in args.runs for row in rows_of(run, args.goldens)]
    print("| run | config | mutation | error (incumbent) | ratio | p | texts worse | now | recorded |")
    print("|---|---|---|---|---:|---:|---:|---|---|")
    for r in rows:
        now = "-" if r["failed_now"] is None else ("**FAIL**" if r["failed_now"] else "pass")
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        p = "-" if r["p"] is None else f"{r['p']:.2g}"
        print(
            f"| {r['run']} | {r['config']} | {r['mutation']} | {r['error']:.4f} "
            f"({r['incumbent_error']:.4f}) | {ratio} | {p} | {r['texts_worse']} | {now} | {r['recorded']} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
