"""The one registry of gates: a gate is its module plus one row here.

A row (`Gate`) carries everything the rest of moe-eval needs of a gate: its name and checks, when the config
calls for it and what it needs, its rule (measurements in, checks and its results.json section out), the
least evidence a pass needs (`Floor`, applied by the judge for every gate alike), its section's payload type
(docs/results.schema.json is generated from it), and how it is shown (`Show`: run-table columns, JUnit
properties, `moe-eval compare` rows). `moe-eval list`, `run` (moe_eval.gates.judge), results.json, its
schema, the table, JUnit and compare all read GATES, so none can disagree about a config's gates; a test
adds a gate for its own duration with `registered()`.

A gate is either *called for* by the config (its keys ask for it) or not; a gate called for that needs an
incumbent and has none, that its config keeps from running (`blocked`), or whose measurement could not be
made, is judged "not run" (a check of its own, never a silent pass): the config's verdict is then
"incomplete" (exit 6) unless the config's `optional_gates` or `run --optional-gate` names that gate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from moe_eval.gates.gate import Gate, GateConfig

NOT_RUN_SUFFIX = "_not_run"  # the check a gate called for makes when it could not run: "<gate>_not_run"
NO_INCUMBENT = (
    "no incumbent to compare with: give the config a baseline_config running vLLM's own kernel at its "
    "layout, or pass --baseline RUN"
)


def _shipped() -> list[Gate]:
    from moe_eval.gates import (
        accuracy,
        divergence,
        garbage,
        golden,
        jit,
        kernel_calls,
        layer_gate,
        paired,
        repeat,
        served,
        speed,
    )

    modules = (
        served,
        accuracy,
        garbage,
        paired,
        divergence,
        golden,
        jit,
        kernel_calls,
        layer_gate,
        speed,
        repeat,
    )
    return [module.GATE for module in modules]


# Read as registry.GATES (never imported by name) so that a test's replacement is what everyone reads.
GATES: list[Gate] = _shipped()


def gate_names() -> tuple[str, ...]:
    return tuple(gate.name for gate in GATES)


def gate_by_name() -> dict[str, Gate]:
    return {gate.name: gate for gate in GATES}


def sections() -> dict[str, Gate]:
    """Each results.json section key with the gate that writes it."""
    return {gate.section: gate for gate in GATES if gate.section}


@contextlib.contextmanager
def registered(gate: Gate) -> Iterator[Gate]:
    """The registry with `gate` added last, for the duration (tests: a gate defined in the test alone)."""
    if gate.name in gate_names():
        raise ValueError(f"a gate named {gate.name!r} is registered already")
    GATES.append(gate)
    try:
        yield gate
    finally:
        GATES.remove(gate)


def gates_for(config: GateConfig, has_incumbent: bool) -> list[Gate]:
    """The gates this config's keys call for, in the registry's order."""
    return [gate for gate in GATES if gate.called_for(config, has_incumbent)]


def _blocked(gate: Gate, config: GateConfig, has_incumbent: bool) -> tuple[str, str] | None:
    """(why, short words) the gate cannot run, known before anything is measured; None: it runs."""
    if gate.needs_incumbent and not has_incumbent:
        return NO_INCUMBENT, "no incumbent"
    return gate.blocked(config)


def planned(config: GateConfig, has_incumbent: bool) -> list[tuple[Gate, str | None]]:
    """Each gate the config calls for, with the reason it cannot run before anything is measured (None:
    it runs). `moe-eval list` prints this; the judge starts from it."""
    out = []
    for gate in gates_for(config, has_incumbent):
        blocked = _blocked(gate, config, has_incumbent)
        out.append((gate, None if blocked is None else blocked[0]))
    return out


def describe_plan(
    config: GateConfig, has_incumbent: bool, optional: frozenset[str] = frozenset()
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
