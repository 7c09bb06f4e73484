"""The one registry of gates: each gate's name, the checks it makes, when it applies, what it needs, its rule
(moe_eval.gates.rules) and what it checks.

Both `moe-eval run` (through moe_eval.gates.judge, which calls each gate's rule) and `moe-eval list` read
this table, so the two cannot disagree about a config's gates. A gate is either *called for* by the config
(its keys ask for it) or not; a gate called for that needs an incumbent and has none, or whose measurement
could not be made, is judged "not run" (a check of its own, never a silent pass): the config's verdict is
then "incomplete" (exit 6) unless the config's `optional_gates` or `run --optional-gate` names that gate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe_eval.gates import rules
from moe_eval.plan.gate_names import GATE_NAMES

if TYPE_CHECKING:
    from moe_eval.gates.measurements import Judgement, Measurements
    from moe_eval.plan.config import EvalConfig

GARBAGE_LIMITS = (  # (check name, config key) of the answer checks, each on when its limit is set
    ("max_empty_rate", "max_empty_rate"),
    ("max_truncated_rate", "max_truncated_rate"),
    ("max_invalid_rate", "max_invalid_rate"),
)


@dataclass(frozen=True)
class Gate:
    name: str  # as `moe-eval list` prints it
    checks: tuple[str, ...]  # the checks it can make (results.json "checks" names)
    # The config's keys ask for it, given whether the run has an incumbent (baseline_config or --baseline):
    # the paired and divergence gates exist to compare with one, the golden gate is asked for by the kernel.
    called_for: Callable[[EvalConfig, bool], bool]
    needs_incumbent: bool  # cannot run without one: called for and none is "not run", not a pass
    # Appends the gate's checks and results.json section; returns why it could not judge (None: judged).
    rule: Callable[[EvalConfig, Measurements, Judgement], str | None]
    what: str  # what it checks, in one line: the table read as documentation (the README says it at length)
    # Why the config alone keeps it from running where it is called for (None: nothing does), with the short
    # words `moe-eval list` shows: (why, short).
    blocked: Callable[[EvalConfig], tuple[str, str] | None] = lambda c: None
    # Where it is not called for but could still be computed: its results.json section, reported only (no
    # check, so never a verdict).
    report: Callable[[EvalConfig, Measurements, Judgement], None] | None = None


GATES: tuple[Gate, ...] = (
    Gate(
        "served",
        ("served",),
        lambda c, _: True,
        False,
        rules.judge_served,
        "the server answered every question: what an incumbent row with nothing else to gate proves",
    ),
    Gate(
        "accuracy",
        ("accuracy_gate",),
        lambda c, _: c.answers_gated,
        False,
        rules.judge_accuracy,
        "strict-match accuracy against accuracy_threshold - tolerance (and stderr_gate_k)",
    ),
    Gate(
        "garbage",
        tuple(name for name, _ in GARBAGE_LIMITS),
        lambda c, _: c.answers_gated and any(getattr(c, key) is not None for _, key in GARBAGE_LIMITS),
        False,
        rules.judge_garbage,
        "empty, truncated and number-less answers, each against its max_*_rate",
    ),
    Gate(
        "paired",
        ("paired_gate",),
        lambda c, incumbent: c.answers_gated and incumbent,
        True,
        rules.judge_paired,
        "per-question flips against the incumbent, exact McNemar test (paired_alpha)",
    ),
    Gate(
        "divergence",
        ("logprob_mean_abs", "logprob_p99_abs", "logprob_top1_flips", "logprob_kl"),
        lambda c, incumbent: c.logprob_texts > 0 and incumbent,
        True,
        rules.judge_divergence,
        "log-probabilities of logprob_texts fixed texts against the incumbent's",
    ),
    Gate(
        "golden",
        ("golden_gate", "golden_gate_decode"),
        lambda c, _: c.golden_gated,
        True,
        rules.judge_golden,
        "error against the exact-MoE golden reference, no worse than the incumbent's (prefill and decode)",
    ),
    Gate(
        "jit",
        ("jit_while_serving",),
        lambda c, _: c.max_jit_while_serving is not None,
        False,
        rules.judge_jit,
        "kernel compilations while serving, at most max_jit_while_serving",
    ),
    Gate(
        "kernel_calls",
        ("bundled_kernel_calls",),
        lambda c, _: c.moe_backend is not None,
        False,
        rules.judge_kernel_calls,
        "the bundled kernel's own counters: it served on every rank",
    ),
    Gate(
        "layer_check",
        (
            "layer_check_coverage",
            "layer_check_ranges",
            "layer_check_experts",
            "layer_check_activation",
            "layer_check_power",
        ),
        lambda c, _: c.layer_checked,
        False,
        rules.judge_layer_check,
        "the served MoE calls of every layer, dispatch range, expert and rank against the exact MoE, "
        "with the cells it could not judge counted",
    ),
    Gate(
        "speed",
        ("speed_gate",),
        lambda c, incumbent: c.speed_gated(incumbent),
        True,
        rules.judge_speed,
        "per dispatch range, the served MoE calls' time at matched call sizes within x(1 + speed_margin) of "
        "the incumbent's (or --baseline's) on the same workload and machine, beyond noise",
        blocked=lambda c: (
            None
            if c.moe_timing
            else ("moe_timing is false: the row's MoE calls are not timed", "moe_timing false")
        ),
        report=rules.report_speed,
    ),
)

GATE_BY_NAME = {gate.name: gate for gate in GATES}
assert tuple(GATE_BY_NAME) == GATE_NAMES, "moe_eval/plan/gate_names.py lists the table's gates, in its order"
NOT_RUN_SUFFIX = "_not_run"  # the check a gate called for makes when it could not run: "<gate>_not_run"

NO_INCUMBENT = (
    "no incumbent to compare with: give the config a baseline_config running vLLM's own kernel at its "
    "layout, or pass --baseline RUN"
)


def gates_for(config: EvalConfig, has_incumbent: bool) -> list[Gate]:
    """The gates this config's keys call for, in the table's order."""
    return [gate for gate in GATES if gate.called_for(config, has_incumbent)]


def _blocked(gate: Gate, config: EvalConfig, has_incumbent: bool) -> tuple[str, str] | None:
    """(why, short words) the gate cannot run, known before anything is measured; None: it runs."""
    if gate.needs_incumbent and not has_incumbent:
        return NO_INCUMBENT, "no incumbent"
    return gate.blocked(config)


def planned(config: EvalConfig, has_incumbent: bool) -> list[tuple[Gate, str | None]]:
    """Each gate the config calls for, with the reason it cannot run before anything is measured (None:
    it runs). `moe-eval list` prints this; the judge starts from it."""
    return [
        (gate, (blocked or (None,))[0])
        for gate in gates_for(config, has_incumbent)
        for blocked in [_blocked(gate, config, has_incumbent)]
    ]


def describe_plan(
    config: EvalConfig, has_incumbent: bool, optional: frozenset[str] = frozenset()
) -> list[str]:
    """`moe-eval list`'s gates column: a gate's name, or `name(not run: why)`, or `name(skipped: why)` for
    one that is optional here (the config's optional_gates, `--optional-gate`)."""
    out = []
    for gate in gates_for(config, has_incumbent):
        blocked = _blocked(gate, config, has_incumbent)
        if blocked is None:
            out.append(gate.name)
        else:
            out.append(f"{gate.name}({'skipped' if gate.name in optional else 'not run'}: {blocked[1]})")
    return out
