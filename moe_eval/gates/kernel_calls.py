"""The kernel-calls gate: the bundled kernel's own counters say it served on every rank of the layout
(counted on the device where CUDA graphs replay it): a server that loaded the plugin but routed around it
fails here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_eval.core.check import Check
from moe_eval.core.evidence import Evidence
from moe_eval.gates.gate import Gate, GateConfig

if TYPE_CHECKING:
    from moe_eval.gates.measurements import Judgement, Measurements


def judge_kernel_calls(config: GateConfig, m: Measurements, out: Judgement) -> str | None:
    if m.kernel_calls is None:
        return "the kernel's counters were not read"
    calls, ranks = m.kernel_calls, config.layout.world_size
    ran = calls["processes"] >= ranks and calls["calls"] > 0
    detail = (
        f"{calls['calls']} MoE calls ({calls['tokens']} tokens) counted by {calls['processes']} of "
        f"{ranks} rank(s), on {', '.join(map(str, calls['counted_on'])) or 'nothing'}"
    )
    evidence = Evidence("rank", min(calls["processes"], ranks), ranks)
    out.checks.append(Check.judged("bundled_kernel_calls", ran, detail, evidence))
    return None


GATE = Gate(
    "kernel_calls",
    ("bundled_kernel_calls",),
    lambda c, _: c.moe_backend is not None,
    False,
    judge_kernel_calls,
    "the bundled kernel's own counters: it served on every rank",
)
