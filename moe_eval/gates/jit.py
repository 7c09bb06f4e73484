"""The JIT gate: kernels compiled after vLLM's warm-up (its JIT monitor's warnings in the server log), at
most max_jit_while_serving: a compile while serving is a latency spike."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from moe_eval.core.check import Check
from moe_eval.core.evidence import Evidence
from moe_eval.gates.gate import Gate, GateConfig, gate_keys

if TYPE_CHECKING:
    from moe_eval.gates.measurements import Judgement, Measurements


@gate_keys
class JitKeys:
    """The JIT gate's key: set, it turns the gate on."""

    max_jit_while_serving: int | None = Field(
        None,
        ge=0,
        description="fail when more kernel compilations than this happen while serving (vLLM's JIT "
        "monitor, GPU servers)",
    )


def judge_jit(config: GateConfig, m: Measurements, out: Judgement) -> str | None:
    if m.jit is None:
        return "the server's log was not read"
    jit, limit = m.jit, config.keys(JitKeys).max_jit_while_serving
    monitored = Evidence("process", jit["monitored_processes"], config.layout.world_size)
    if jit["monitored_processes"] == 0:
        detail = (
            "vLLM's JIT monitor never started (no 'Kernel JIT monitor activated' in server.log), so "
            "compilations while serving cannot be counted"
        )
        out.checks.append(Check.not_run("jit_while_serving", "not run: " + detail, monitored))
        return None
    kernels = f" ({', '.join(jit['kernels'])})" if jit["kernels"] else ""
    detail = (
        f"kernel compilations while serving: {jit['count']}{kernels} (limit {limit}; "
        f"{jit['monitored_processes']} process(es) monitored)"
    )
    out.checks.append(Check.judged("jit_while_serving", jit["count"] <= limit, detail, monitored))
    return None


GATE = Gate(
    "jit",
    ("jit_while_serving",),
    lambda c, _: c.keys(JitKeys).max_jit_while_serving is not None,
    False,
    judge_jit,
    "kernel compilations while serving, at most max_jit_while_serving",
    keys=JitKeys,
)
