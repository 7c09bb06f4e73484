"""The golden gate's calibration table from run folders (benchmarks/calibrate_golden.sh's WORK, or any).

For every bundled row of every run under the folders given: mutation, accuracy, the paired McNemar
gate, the old absolute divergence gate, the golden gate (ratio, p, verdict, power). Also the golden's
own noise: two golden records of one key made from empty caches (goldens-*/), compared text by text.

    python benchmarks/golden_calibration_table.py WORK [--json docs/data/golden_calibration_cpu.json]
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from moe_eval.core.logprob_texts import read_logprobs
from moe_eval.core.record import RunRecord, RunSummary, result_files
from moe_eval.core.results import atomic_write_json
from moe_eval.evaluate.golden import PROBE_SCALE_ERROR
from moe_eval.gates.divergence import divergence
from moe_eval.gates.golden_errors import errors_vs_golden, scale_error_power


def _checks(record: RunRecord) -> dict[str, bool]:
    return {c.name: c.passed for c in record.verdict.checks}


def _power(path: Path, record: RunRecord, work: Path) -> float | None:
    """The gate's power recomputed by the committed code (moe_eval.gates.golden_errors) from the files the run
    left: a run folder made by an earlier version keeps its own number in results.json."""
    gate = record.judged.get("golden_gate") or {}
    golden = Path(record.captures.golden["path"])
    incumbent = Path(gate["incumbent"]["results"]).parent / "logprobs.jsonl"
    if not golden.is_dir():  # moved with the run folders: a copy of its cache in WORK (goldens-*/<digest>)
        golden = next(work.glob(f"*/{golden.name}"), golden)
    if not incumbent.is_file():  # moved with its run folder: the same config folder in this run
        incumbent = path.parents[2].joinpath(*incumbent.parent.parts[-2:], incumbent.name)
    if not golden.is_dir() or not incumbent.is_file():
        return (gate.get("power") or {}).get("scale_error")
    gold = _logprobs(golden / "prefill.jsonl")
    return scale_error_power(
        gold,
        _logprobs(golden / "probe.jsonl"),
        PROBE_SCALE_ERROR,
        errors_vs_golden(gold, read_logprobs(path.parent / "logprobs.jsonl")),
        errors_vs_golden(gold, _logprobs(incumbent)),
        gate["margin"],
        gate["alpha"],
    )


@functools.cache
def _logprobs(path: Path) -> list:
    """A golden's or an incumbent's records, read once: every row of a run shares them (read-only)."""
    return read_logprobs(path)


@functools.cache
def _summary(folder: Path) -> RunSummary | None:
    """A run folder's summary.json, read once for all its rows; None where the folder has none."""
    path = folder / "summary.json"
    return RunSummary.read(path) if path.is_file() else None


def _ran_in_its_run(path: Path, work: Path) -> bool:
    """False for a results.json its run folder's summary.json does not list as run there: a row carried
    over by --resume (counted in the run it came from), or a copied row of a config the run did not
    select. A folder without summary.json (an earlier version's) counts whole."""
    for folder in path.parents:
        summary = _summary(folder)
        if summary is not None:
            here = path.parent.relative_to(folder).parts
            return any(
                Path(c.run_dir).parts[-len(here) :] == here and not c.resumed
                for c in summary.configs
                if c.run_dir
            )
        if folder == work:
            break
    return True


def rows(work: Path) -> list[dict]:
    found = []
    for path in result_files(work):
        record = RunRecord.read(path)
        gate = record.judged.get("golden_gate") or {}
        if record.config.get("moe_backend") is None or "ratio" not in gate:
            continue
        if not _ran_in_its_run(path, work):
            continue
        checks = _checks(record)
        old = [v for k, v in checks.items() if k.startswith("logprob_")]
        found.append(
            {
                "run": str(path.relative_to(work).parts[0]),
                "config": f"{Path(record.identity.config_path).parent.name}/{record.identity.config_name}",
                "layout": record.layout,
                "mutation": record.mutation,
                "accuracy": record.accuracy,
                "accuracy_gate": checks.get("accuracy_gate"),
                "mcnemar": checks.get("paired_gate"),
                "old_divergence_gate": all(old) if old else None,
                "old_mean_abs": (record.judged.get("divergence") or {}).get("mean_abs_dlogp"),
                "error": gate["run"]["mean_abs"],
                "incumbent_error": gate["incumbent"]["errors"]["mean_abs"],
                "ratio": gate["ratio"],
                "p": gate["p"],
                "margin": gate["margin"],
                "golden_gate": gate["passed"],
                "decode_gate": checks.get("golden_gate_decode"),
                "power_scale_error": _power(path, record, work),
                "status": record.status,
                "seconds": record.bookkeeping.timings.get("total_seconds"),
            }
        )
    return found


def golden_noise(work: Path) -> list[dict]:
    """Each pair of golden records with the same key digest in different goldens-*/ caches."""
    by_digest: dict[str, list[Path]] = {}
    for folder in sorted(work.glob("goldens-*/*/golden.json")):
        by_digest.setdefault(folder.parent.name, []).append(folder.parent)
    out = []
    for digest, folders in by_digest.items():
        for other in folders[1:]:
            div = divergence(
                read_logprobs(folders[0] / "prefill.jsonl"), read_logprobs(other / "prefill.jsonl")
            )
            out.append(
                {
                    "digest": digest,
                    "a": str(folders[0]),
                    "b": str(other),
                    "mean_abs": div.mean_abs_dlogp,
                    "max_abs": div.max_abs_dlogp,
                    "top1_flips": div.top1_flips,
                    "positions": div.positions,
                }
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    table, noise = rows(args.work), golden_noise(args.work)
    print(
        "| run | config | mutation | accuracy | McNemar | old divergence gate | error (incumbent) | ratio "
        "| p "
        "| golden gate | decode | catches (80%) |"
    )
    print("|---|---|---|---:|---|---|---|---:|---:|---|---|---:|")
    word = {True: "pass", False: "**FAIL**", None: "-"}
    for r in sorted(table, key=lambda r: (r["mutation"] or "", r["config"], r["run"])):
        power = "-" if r["power_scale_error"] is None else f"{r['power_scale_error']:.1%}"
        print(
            f"| {r['run']} | {r['config']} | {r['mutation'] or 'none'} | {r['accuracy']:.3f} "
            f"| {word[r['mcnemar']]} "
            f"| {word[r['old_divergence_gate']]} ({r['old_mean_abs']:.4f}) | {r['error']:.4f} "
            f"({r['incumbent_error']:.4f}) | {r['ratio']:.3f} | {r['p']:.2g} | {word[r['golden_gate']]} "
            f"| {word[r['decode_gate']]} | {power} |"
        )
    for n in noise:
        print(
            f"golden noise {n['digest']}: mean |Δ| {n['mean_abs']:.3g}, max {n['max_abs']:.3g}, "
            f"top-1 flips {n['top1_flips']} of {n['positions']}"
        )
    if args.json:
        atomic_write_json(args.json, {"rows": table, "golden_noise": noise})


if __name__ == "__main__":
    main()
