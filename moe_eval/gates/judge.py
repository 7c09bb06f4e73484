"""Measure, then judge: the verdict of one config from what its run measured, and nothing else.

The runner serves, evaluates, scores and reads files; it hands this module a `Measurements`. `judge` reads
no file, starts no server and takes no time of its own beyond arithmetic: the same measurements give the
same checks, verdict and results.json sections, in a test as in a run. Which gates a config gets, and each
gate's rule, come from the one registry (moe_eval.gates.registry). Decided here, the same for every gate:

- a gate called for that could not run is a check of its own (`<gate>_not_run`, status not_run);
- a check that passed on less evidence than its gate's floor (the registry's `floors`; a gate can also say
  what it needs in its evidence's `required`) is not run, never a pass;
- what an optional gate could not judge is skipped;
- the verdict (core/check.verdict) from the checks' statuses alone.
"""

from __future__ import annotations

from dataclasses import replace

from moe_eval.core.check import Check, verdict
from moe_eval.core.evidence import Status
from moe_eval.gates import registry
from moe_eval.gates.gate import Gate, GateConfig
from moe_eval.gates.measurements import Answers, GoldenRecord, Judgement, Measurements
from moe_eval.gates.registry import NOT_RUN_SUFFIX, planned

__all__ = ["Answers", "GoldenRecord", "Judgement", "Measurements", "judge", "not_run"]


def judge(config: GateConfig, m: Measurements, optional: frozenset[str] = frozenset()) -> Judgement:
    """The checks of every gate the registry gives this config, the verdict, and the records that explain
    them. `optional`: gates whose "not run" does not make the verdict incomplete."""
    out = Judgement([], "", {})
    if not config.answers_gated:
        out.sections["gate"] = {"skipped": "random weights (random_weights: true): the answers are not gated"}
    called = planned(config, m.incumbent is not None)
    for gate, why in called:
        why = why or m.not_measured.get(gate.name)
        made = len(out.checks)
        if why is None:
            try:
                why = gate.rule(config, m, out)
            except Exception as exc:  # noqa: BLE001
                # The judge never raises: what it could not compute (measurements of another shape, or a bug
                # in the rule) is that gate not run, with the reason, and the other gates' verdicts stand.
                del out.checks[made:]
                why = f"its measurements could not be judged: {type(exc).__name__}: {exc}"
        if why is not None:
            out.checks.append(not_run(gate, why, False))
        out.checks[made:] = [on_floor(config, gate, check) for check in out.checks[made:]]
        if gate.name in optional:  # what an optional gate could not measure is skipped, not a pass
            out.checks[made:] = [c.skipped() if c.status is Status.NOT_RUN else c for c in out.checks[made:]]
    names = {gate.name for gate, _ in called}
    for gate in registry.GATES:
        if gate.name not in names and gate.report is not None:
            try:
                gate.report(config, m, out)  # a section only: no check, so no verdict rests on it
            except Exception as exc:  # noqa: BLE001  a report is never a verdict, nor the end of one
                if gate.section:
                    out.sections[gate.section] = {"skipped": f"not reported: {type(exc).__name__}: {exc}"}
    out.verdict = verdict(out.checks)
    return out


def on_floor(config: GateConfig, gate: Gate, check: Check) -> Check:
    """A passed check whose evidence is below its floor (the gate's, or what the evidence itself requires)
    is not run: a pass on thin evidence is no pass. The evidence keeps what the floor asked for."""
    evidence = check.evidence
    if check.status is not Status.PASSED or evidence is None:
        return check
    required = max(gate.floor_of(check.name).required(config, evidence.total), evidence.required or 0)
    evidence = replace(evidence, required=required)
    if evidence.judged >= required:
        return replace(check, evidence=evidence)
    detail = (
        f"not run: judged {evidence.judged} of {evidence.total} {evidence.unit}s, {required} needed for a "
        f"pass; {check.detail}"
    )
    return Check.not_run(check.name, detail, evidence)


def not_run(gate: Gate, why: str, optional: bool) -> Check:
    """A gate called for that could not run: it stands in the way of a pass unless declared optional."""
    check = Check.not_run(f"{gate.name}{NOT_RUN_SUFFIX}", f"not run: {why}")
    return check.skipped() if optional else check
