"""JUnit XML for CI systems: one testsuite per config, holding one testcase named after the config's
stem (as vLLM's harness names its cases, so CI filters mean the same).

A failed check is a <failure> (accuracy, gate, margin; garbage and paired checks); an
infrastructure problem is an <error> carrying the message and the last lines of the server log.
Suite properties carry the MoE kernel the server used, the layout, the hardware, versions, the
accuracy gate's power and the log-probability divergence against the baseline.
"""

from __future__ import annotations

import socket
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from moe_eval.core.results import atomic_write_text, versions
from moe_eval.gates import registry
from moe_eval.launch import log_tail
from moe_eval.runner import ConfigOutcome


def _properties(parent: ET.Element, values: dict[str, object]) -> None:
    props = ET.SubElement(parent, "properties")
    for name, value in values.items():
        ET.SubElement(props, "property", name=name, value=_property_text(value))


def _property_text(value: object) -> str:
    """A property's value as CI systems read one: booleans as JSON spells them (true, false), not Python."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def junit_xml(outcomes: list[ConfigOutcome], hw: str, gpus: list[str]) -> str:
    root = ET.Element("testsuites", name="moe-eval")
    totals = {"tests": 0, "failures": 0, "errors": 0, "time": 0.0}
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    host = socket.gethostname()
    for o in outcomes:
        seconds = o.timings.get("total_seconds", 0.0)
        # Incomplete (a gate called for could not run) is a failure to CI: the run judged less than asked.
        failures = int(o.status in ("failed", "incomplete"))
        errors = int(o.status in ("error", "cancelled"))
        # An optional gate that could not measure is a skipped testcase of its own beside the config's,
        # so a CI's test view says "skipped" where the table says so, never a plain pass.
        skipped = o.skipped_checks if o.status == "passed" else []
        suite = ET.SubElement(
            root,
            "testsuite",
            name=f"{o.config.path.parent.name}/{o.config.name}",
            tests=str(1 + len(skipped)),
            failures=str(failures),
            errors=str(errors),
            skipped=str(len(skipped)),
            time=f"{seconds:.3f}",
            timestamp=stamp,
            hostname=host,
        )
        _properties(
            suite,
            {
                "config_path": o.config.path,
                "model": o.config.model_name,
                "layout": o.config.layout.describe(),
                "moe_backend_requested": o.config.moe_backend,
                "moe_backend_used": o.moe_backend_used,
                "hardware": hw,
                "gpus": ", ".join(gpus),
                # Each gate's own properties (its Show), then what every check judged of what it was given.
                **{
                    name: value
                    for gate in registry.GATES
                    if gate.show.junit is not None
                    for name, value in gate.show.junit(
                        o.section(gate.section) if gate.section else None
                    ).items()
                },
                **{
                    f"evidence.{c.name}": f"{c.evidence.judged}/{c.evidence.total} {c.evidence.unit}s"
                    for c in o.checks
                    if c.evidence is not None
                },
                **{
                    f"would_catch.{c.name}": c.evidence.would_catch
                    for c in o.checks
                    if c.evidence is not None and c.evidence.would_catch
                },
                **{f"version.{k}": v for k, v in versions().items()},
            },
        )
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"moe-eval.{o.config.path.parent.name}",
            name=o.config.name,
            time=f"{seconds:.3f}",
        )
        if o.status in ("error", "cancelled"):
            kind = "Cancelled" if o.status == "cancelled" else "InfrastructureError"
            element = ET.SubElement(case, "error", type=kind, message=(o.error or "")[:500])
            element.text = f"{o.error}\n\n{log_tail(o.run_dir / 'server.log')}"
        elif o.status in ("failed", "incomplete"):
            failed = [c for c in o.failed_checks if c.ran] or o.failed_checks
            element = ET.SubElement(
                case,
                "failure",
                type=",".join(c.name for c in failed),
                message="; ".join(c.detail for c in failed)[:500],
            )
            element.text = "\n".join(c.detail for c in o.checks)
        ET.SubElement(case, "system-out").text = "\n".join(c.detail for c in o.checks) or (o.error or "")
        for check in skipped:
            gate_case = ET.SubElement(
                suite,
                "testcase",
                classname=f"moe-eval.{o.config.path.parent.name}",
                name=f"{o.config.name}.{check.name}",
                time="0.000",
            )
            ET.SubElement(gate_case, "skipped", message=check.detail[:500])
        totals["tests"] += 1 + len(skipped)
        totals["failures"] += failures
        totals["errors"] += errors
        totals["time"] += seconds
    root.set("tests", str(totals["tests"]))
    root.set("failures", str(totals["failures"]))
    root.set("errors", str(totals["errors"]))
    root.set("time", f"{totals['time']:.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(path: Path, outcomes: list[ConfigOutcome], hw: str, gpus: list[str]) -> None:
    atomic_write_text(path, junit_xml(outcomes, hw, gpus))
