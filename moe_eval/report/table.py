"""The end-of-run table: lm-eval's columns plus the gate, as Markdown (CI, PRs) or rich (terminal)."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: `moe-eval compare` uses the table helpers without the runner
    from rich.table import Table

    from moe_eval.plan.config import EvalConfig
    from moe_eval.runner import ConfigOutcome

COLUMNS = (
    "Config",
    "Layout",
    "MoE backend",
    "Filter",
    "n-shot",
    "Metric",
    "Value",
    "",
    "Stderr",
    "Floor",
    "Margin (stderr)",
    "Catches a drop of (80%)",
    "Δ log p vs baseline",
    "Error vs golden (incumbent)",
    "Layer check vs exact",
    "MoE time (x reference)",
    "Verdict",
)


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def _verdict(o: ConfigOutcome) -> str:
    if o.status == "passed":
        skipped = o.skipped_checks
        return "PASS (skipped: " + ", ".join(c.name for c in skipped) + ")" if skipped else "PASS"
    if o.status == "incomplete":  # a gate called for could not run: which, not a failure of the kernel
        return "INCOMPLETE (" + ", ".join(c.name for c in o.failed_checks) + ")"
    return "FAIL (" + ", ".join(c.name for c in o.failed_checks if c.ran) + ")"


def divergence_cell(divergence: dict | None) -> str:
    """'0.0211 mean, 0.32% top-1' (mean |Δ log p| of the reference tokens, positions whose top-1 changed)."""
    if not divergence or "mean_abs_dlogp" not in divergence:
        return "-"
    return f"{divergence['mean_abs_dlogp']:.4f} mean, {divergence['top1_flip_rate']:.2%} top-1"


def golden_cell(gate: dict | None) -> str:
    """'0.0169 (0.0172) x0.98 p=0.9; catches 1.6%': this run's error against the golden reference, the
    incumbent's, their ratio and the paired test's p, and the smallest per-expert scale error caught."""
    if not gate:
        return "-"
    run = (gate.get("run") or {}).get("mean_abs")
    if gate.get("skipped") and run is None:
        return "no incumbent" if "incumbent" in gate["skipped"] else "not scored"
    if "ratio" not in gate:
        return f"{run:.4f} (no incumbent)" if run is not None else "-"
    incumbent = gate["incumbent"]["errors"]["mean_abs"]
    power = (gate.get("power") or {}).get("scale_error")
    caught = "; catches none <= 50%" if power is None else "" if power == 0.0 else f"; catches {power:.1%}"
    return f"{run:.4f} ({incumbent:.4f}) x{gate['ratio']:.2f} p={gate['p']:.2g}{caught}"


def layer_cell(check: dict | None) -> str:
    """'x0.85 worst (M=1); 890/896 cells at 1%; |s| <= 0.0005': the served MoE calls against the exact MoE
    (gates/layer_gate.py): the worst range's error ratio to the incumbent's arithmetic, the (range, expert)
    cells that resolve the power target of the total, and the largest per-expert scale error."""
    if not check:
        return "-"
    ranges = [
        r | {"ratio": layer_ratio(r)} for r in check.get("ranges", []) if layer_ratio(r) is not None
        and r.get("layer") is None and (r.get("rank") == "all" or check.get("processes") == 1)
    ]  # fmt: skip
    worst = max(ranges, key=lambda r: r["ratio"], default=None)
    parts = [f"{ratio_text(worst['ratio'])} worst ({worst['range']})" if worst else "no range"]
    judged, total = power_counts(check)
    if total:
        parts.append(f"{judged}/{total} cells at {check['limits']['power']:.0%}")
    largest = max((abs(c["scale"]) for c in check.get("expert_cells", [])), default=None)
    if largest is not None:
        parts.append(f"|s| <= {largest:.4f}")
    return "; ".join(parts)


def speed_cell(gate: dict | None, timing: dict | None) -> str:
    """'x1.01 worst (M=2-16), 7/7 ranges judged, would catch x1.04': the speed gate's worst judged range
    against its reference (a failed gate's worst failing range), the ranges it judged of those either row
    called, and the slowdown its least sensitive judged range would catch with 80 % probability; 'report
    only: ...' where the row was compared but not gated (the CPU); a row timed with nothing to compare shows
    its slowest range's call ('412.4 us at M>=1024, 6 ranges timed, not gated')."""
    if gate and gate.get("ranges") and "evidence" in gate:
        judged = [r for r in gate["ranges"] if r.get("passed") is not None]
        evidence = gate["evidence"]
        counted = f"{evidence['judged']}/{evidence['total']} ranges judged"
        if gate.get("required_not_judged"):
            counted += f" ({', '.join(gate['required_not_judged'])} not: required)"
        prefix = "report only: " if gate.get("gated") is False else ""
        if not judged:
            return f"{prefix}no range judged, {counted}"
        failed = [r for r in judged if r.get("passed") is False]
        worst = max(failed or judged, key=lambda r: r["ratio"])
        catch = max(r["would_catch"] for r in judged)
        return f"{prefix}x{worst['ratio']:.2f} worst ({worst['range']}), {counted}, would catch x{catch:.2f}"
    if gate and gate.get("worst_ratio") is not None:  # a record from before matched sizes (schema 8)
        judged = [r for r in gate["ranges"] if r.get("passed") is not None]
        worst = max(judged, key=lambda r: r["ratio"])
        counted = f"{len(judged)}/{len(gate['ranges'])} ranges judged"
        return f"x{worst['ratio']:.2f} worst ({worst['range']}), {counted}"
    ranges = (timing or {}).get("ranges") or []
    if not ranges:
        return "-"
    slowest = max(ranges, key=lambda r: r["mean_us"])
    return f"{slowest['mean_us']:.1f} us at {slowest['range']}, {len(ranges)} ranges timed, not gated"


def ratio_text(ratio: float | None) -> str:
    """ "x1.02"; "xinf" for an error against an exact incumbent (results.json writes it null); 'no ratio'."""
    if ratio is None:
        return "no ratio"
    return "xinf" if math.isinf(ratio) else f"x{ratio:.2f}"


def layer_ratio(row: dict) -> float | None:
    """A range's error ratio as results.json holds it; null with an error against an exact incumbent is
    infinite (JSON has no inf), the worst there is, not a range left out."""
    if row.get("ratio") is not None:
        return row["ratio"]
    return math.inf if (row.get("error") or 0) > 0 and row.get("incumbent_error") == 0 else None


def power_counts(check: dict) -> tuple[int, int]:
    """(judged, total) (range, expert) cells over the ranges and the ranks (not their pool)."""
    rows = [p for p in check.get("power", []) if p.get("rank") != "all" or check.get("processes") == 1]
    return sum(p["judged"] for p in rows), sum(p["cells"] for p in rows)


def _floor(config: EvalConfig) -> str:
    return (
        _fmt(config.accuracy_threshold - config.tolerance) if config.accuracy_threshold is not None else "n/a"
    )


def rows(outcomes: Iterable[ConfigOutcome]) -> list[list[str]]:
    table = []
    for o in outcomes:
        cfg = o.config
        name = f"{cfg.path.parent.name}/{cfg.name}"
        backend = o.moe_backend_used or "n/a"
        if o.scores is None:  # an infrastructure error, or cancelled before the evaluation ended
            table.append(
                [
                    name,
                    cfg.layout.describe(),
                    backend,
                    "-",
                    str(cfg.num_fewshot),
                    "exact_match",
                    "-",
                    "",
                    "-",
                    _floor(cfg),
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    o.status.upper(),
                ]
            )
            continue
        for i, (filt, score) in enumerate(o.scores.items()):
            gated = filt == "strict-match"
            sigma = o.gate.margin_in_stderr if gated and o.gate else None
            # A random-weights twin answers nothing: its accuracy is not a number to read (n/a), never 0.000.
            value, stderr = (
                (_fmt(score["accuracy"]), _fmt(score["stderr"])) if cfg.answers_gated else ("n/a", "n/a")
            )
            table.append(
                [
                    name if i == 0 else "",
                    cfg.layout.describe() if i == 0 else "",
                    backend if i == 0 else "",
                    filt,
                    str(cfg.num_fewshot),
                    "exact_match",
                    value,
                    "±",
                    stderr,
                    _fmt(o.gate.floor) if gated and o.gate else "",
                    f"{sigma:+.1f}" if sigma is not None else "",
                    _fmt(o.detectable_drop, 3) if gated and o.detectable_drop is not None else "",
                    divergence_cell(o.divergence) if gated else "",
                    golden_cell(o.golden_gate) if gated else "",
                    layer_cell(o.layer_check) if gated else "",
                    speed_cell(o.speed, o.moe_timing) if gated else "",
                    _verdict(o) if gated else "",
                ]
            )
    return table


def markdown_table(header: Sequence[str], body: Iterable[Sequence[str]]) -> str:
    """A Markdown table, one line per row, ending in a newline; a column with an empty header gets a
    one-dash separator."""
    lines = ["|" + "|".join(header) + "|", "|" + "|".join("---" if c else "-" for c in header) + "|"]
    lines += ["|" + "|".join(r) + "|" for r in body]
    return "\n".join(lines) + "\n"


def rich_table(
    title: str,
    header: Sequence[str],
    body: Iterable[Sequence[str]],
    right: Collection[str] = (),
    row_style: Callable[[Sequence[str]], str | None] = lambda _: None,
) -> Table:
    """The same table for a terminal: columns named in `right` right-justified, rows styled by `row_style`."""
    from rich.table import Table

    table = Table(title=title)
    for col in header:
        table.add_column(col, justify="right" if col in right else "left")
    for row in body:
        table.add_row(*row, style=row_style(row))
    return table


def markdown(outcomes: Iterable[ConfigOutcome]) -> str:
    return markdown_table(COLUMNS, rows(outcomes))


def print_table(outcomes: list[ConfigOutcome], rich_output: bool) -> None:
    if not rich_output:
        print(markdown(outcomes), end="")
        return
    from rich.console import Console

    table = rich_table(
        "moe-eval GSM8K",
        COLUMNS,
        rows(outcomes),
        right=("Value", "Stderr", "Floor", "Margin (stderr)", "Catches a drop of (80%)"),
        row_style=lambda row: {"P": "green", "F": "red", "E": "yellow", "C": "yellow"}.get(row[-1][:1]),
    )
    Console().print(table)
