"""The end-of-run table: lm-eval's columns plus the gate, as Markdown (CI, PRs) or rich (terminal)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from moe_eval.runner import ConfigOutcome

COLUMNS = ("Config", "Layout", "MoE backend", "Filter", "n-shot", "Metric", "Value", "", "Stderr", "Floor",
           "Margin (stderr)", "Verdict")


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def _verdict(o: ConfigOutcome) -> str:
    if o.status == "passed":
        return "PASS"
    return "FAIL (" + ", ".join(c.name for c in o.failed_checks) + ")"


def rows(outcomes: Iterable[ConfigOutcome]) -> list[list[str]]:
    table = []
    for o in outcomes:
        cfg = o.config
        name = f"{cfg.path.parent.name}/{cfg.name}"
        backend = o.moe_backend_used or "n/a"
        if o.scores is None:
            table.append([name, cfg.layout.describe(), backend, "-", str(cfg.num_fewshot), "exact_match", "-", "",
                          "-", _fmt(cfg.accuracy_threshold - cfg.tolerance), "-", "ERROR"])
            continue
        for i, (filt, score) in enumerate(o.scores.items()):
            gated = filt == "strict-match"
            sigma = o.gate.margin_in_stderr if gated and o.gate else None
            table.append([
                name if i == 0 else "", cfg.layout.describe() if i == 0 else "", backend if i == 0 else "",
                filt, str(cfg.num_fewshot), "exact_match", _fmt(score["accuracy"]), "±", _fmt(score["stderr"]),
                _fmt(o.gate.floor) if gated and o.gate else "", f"{sigma:+.1f}" if sigma is not None else "",
                _verdict(o) if gated else "",
            ])
    return table


def markdown(outcomes: Iterable[ConfigOutcome]) -> str:
    lines = ["|" + "|".join(COLUMNS) + "|", "|" + "|".join("---" if c else "-" for c in COLUMNS) + "|"]
    lines += ["|" + "|".join(r) + "|" for r in rows(outcomes)]
    return "\n".join(lines) + "\n"


def print_table(outcomes: list[ConfigOutcome], rich_output: bool) -> None:
    if not rich_output:
        print(markdown(outcomes), end="")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="moe-eval GSM8K")
    for col in COLUMNS:
        table.add_column(col, justify="right" if col in ("Value", "Stderr", "Floor", "Margin (stderr)") else "left")
    for row in rows(outcomes):
        style = {"P": "green", "F": "red", "E": "yellow"}.get(row[-1][:1])
        table.add_row(*row, style=style)
    Console().print(table)
