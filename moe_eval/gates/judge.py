"""Measure, then judge: the verdict of one config from what its run measured, and nothing else.

The runner serves, evaluates, scores and reads files; it hands this module a `Measurements`. `judge` reads
no file, starts no server and takes no time of its own beyond arithmetic: the same measurements give the
same checks, verdict and results.json sections, in a test as in a run. Which gates a config gets, and each
gate's rule, come from the one registry (moe_eval.gates.table); a gate called for that could not run is a
check of its own (`<gate>_not_run`, `ran` false), shown wherever checks are.
"""

from __future__ import annotations

from moe_eval.core.check import Check, verdict
from moe_eval.gates.measurements import Answers, GoldenRecord, Judgement, Measurements
from moe_eval.gates.table import GATES, NOT_RUN_SUFFIX, Gate, planned
from moe_eval.plan.config import EvalConfig

__all__ = ["Answers", "GoldenRecord", "Judgement", "Measurements", "judge", "not_run"]


def judge(config: EvalConfig, m: Measurements, optional: frozenset[str] = frozenset()) -> Judgement:
    """The checks of every gate the table gives this config, the verdict, and the records that explain
    them. `optional`: gates whose "not run" does not make the verdict incomplete."""
    out = Judgement([], "", {})
    if not config.answers_gated:
        out.sections["gate"] = {"skipped": "random weights (random_weights: true): the answers are not gated"}
    for gate, why in planned(config, m.incumbent is not None):
        why = why or m.not_measured.get(gate.name)
        if why is None:
            made = len(out.checks)
            try:
                why = gate.rule(config, m, out)
            except Exception as exc:  # noqa: BLE001
                # The judge never raises: what it could not compute (measurements of another shape, or a bug
                # in the rule) is that gate not run, with the reason, and the other gates' verdicts stand.
                del out.checks[made:]
                why = f"its measurements could not be judged: {type(exc).__name__}: {exc}"
        if why is not None:
            out.checks.append(not_run(gate, why, False))
        gate_checks = set(gate.checks) | {f"{gate.name}{NOT_RUN_SUFFIX}"}
        if gate.name in optional:  # what an optional gate could not measure is skipped, not a pass
            out.checks = [c.skipped() if c.name in gate_checks and not c.ran else c for c in out.checks]
    called = {gate.name for gate, _ in planned(config, m.incumbent is not None)}
    for gate in GATES:
        if gate.name not in called and gate.report is not None:
            try:
                gate.report(config, m, out)  # a section only: no check, so no verdict rests on it
            except Exception as exc:  # noqa: BLE001  a report is never a verdict, nor the end of one
                out.sections[gate.name] = {"skipped": f"not reported: {type(exc).__name__}: {exc}"}
    out.verdict = verdict(out.checks)
    return out


def not_run(gate: Gate, why: str, optional: bool) -> Check:
    """A gate called for that could not run: it stands in the way of a pass unless declared optional."""
    check = Check.not_run(f"{gate.name}{NOT_RUN_SUFFIX}", f"not run: {why}")
    return check.skipped() if optional else check
