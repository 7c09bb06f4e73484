"""The end-of-run table: lm-eval's columns, each registered gate's columns (its `Show`), what every check
judged (its evidence) and the verdict, as Markdown (CI, PRs) or rich (terminal)."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING

from moe_eval.core.check import Check
from moe_eval.core.evidence import Evidence
from moe_eval.gates import registry
from moe_eval.gates.gate import Column

if TYPE_CHECKING:  # annotations only: `moe-eval compare` uses the table helpers without the runner
    from rich.table import Table

    from moe_eval.runner import ConfigOutcome

LEADING = ("Config", "Layout", "MoE backend", "Filter", "n-shot", "Metric", "Value", "", "Stderr")
TRAILING = ("Evidence (judged/total; would catch)", "Verdict")


def gate_columns() -> list[tuple[Column, str | None]]:
    """Each registered gate's run-table columns, in the registry's order, with its section key."""
    return [(column, gate.section) for gate in registry.GATES for column in gate.show.columns]


def columns() -> tuple[str, ...]:
    return (*LEADING, *(column.header for column, _ in gate_columns()), *TRAILING)


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


def evidence_cell(checks: Iterable[Check]) -> str:
    """'accuracy 200/200 questions, catches an accuracy drop of 0.013; speed 5/7 dispatch ranges, catches
    x1.04': per gate, its weakest check's evidence (the least share judged of what it was given) and what the
    gate would catch; a check short of its floor is named. JUnit's evidence.<check> has every check's."""
    gate_of = {name: gate.name for gate in registry.GATES for name in gate.checks}
    by_gate: dict[str, list[tuple[Check, Evidence]]] = {}
    for check in checks:
        if check.evidence is not None:
            by_gate.setdefault(gate_of.get(check.name, check.name), []).append((check, check.evidence))
    parts = []
    for gate, counted in by_gate.items():
        # the least share judged; among equals the check given the most units (its evidence says the most)
        _, ev = min(counted, key=lambda pair: (pair[1].judged / max(pair[1].total, 1), -pair[1].total))
        part = f"{gate} {ev.judged}/{ev.total} {ev.unit}s"
        short = [(c, e) for c, e in counted if e.required is not None and e.judged < e.required]
        if short:
            part += f" ({short[0][0].name}: {short[0][1].required} needed)"
        catches = ev.would_catch or next((e.would_catch for _, e in counted if e.would_catch), None)
        if catches:
            part += f", catches {catches}"
        parts.append(part)
    return "; ".join(parts) or "-"


def rows(outcomes: Iterable[ConfigOutcome]) -> list[list[str]]:
    table = []
    shown = gate_columns()
    for o in outcomes:
        cfg = o.config
        name = f"{cfg.path.parent.name}/{cfg.name}"
        backend = o.moe_backend_used or "n/a"
        if o.scores is None:  # an infrastructure error, or cancelled before the evaluation ended
            lead = [
                name,
                cfg.layout.describe(),
                backend,
                "-",
                str(cfg.num_fewshot),
                "exact_match",
                "-",
                "",
                "-",
            ]
            cells = [column.cell(None, o) for column, _ in shown]
            table.append([*lead, *cells, evidence_cell(o.checks), o.status.upper()])
            continue
        for i, (filt, score) in enumerate(o.scores.items()):
            gated = filt == "strict-match"
            # A random-weights twin answers nothing: its accuracy is not a number to read (n/a), never 0.000.
            value, stderr = (
                (_fmt(score["accuracy"]), _fmt(score["stderr"])) if cfg.answers_gated else ("n/a", "n/a")
            )
            first = i == 0
            lead = [name if first else "", cfg.layout.describe() if first else "", backend if first else ""]
            lead += [filt, str(cfg.num_fewshot), "exact_match", value, "±", stderr]
            cells = [
                column.cell(o.section(key) if key else None, o) if gated else "" for column, key in shown
            ]
            tail = [evidence_cell(o.checks), _verdict(o)] if gated else ["", ""]
            table.append([*lead, *cells, *tail])
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
    return markdown_table(columns(), rows(outcomes))


def print_table(outcomes: list[ConfigOutcome], rich_output: bool) -> None:
    if not rich_output:
        print(markdown(outcomes), end="")
        return
    from rich.console import Console

    table = rich_table(
        "moe-eval GSM8K",
        columns(),
        rows(outcomes),
        right=("Value", "Stderr", "Floor", "Margin (stderr)", "Catches a drop of (80%)"),
        row_style=lambda row: {"P": "green", "F": "red", "E": "yellow", "C": "yellow"}.get(row[-1][:1]),
    )
    Console().print(table)
