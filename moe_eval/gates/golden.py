"""The golden gate: the error of this row's log-probabilities against the golden reference (the same model
with its MoE computed exactly, in fp32: moe_eval.evaluate.golden), no worse than the incumbent's, on the
scored texts (prefill) and the greedy continuations (decode). The arithmetic is gates/golden_errors.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field
from typing_extensions import NotRequired, TypedDict  # pydantic reads typing's TypedDict from 3.12 only

from moe_eval.core.check import Check
from moe_eval.core.errors import InfraError
from moe_eval.core.evidence import Evidence
from moe_eval.gates.divergence import no_logprobs
from moe_eval.gates.gate import Column, Gate, GateConfig, RowView, Show, Skipped, gate_keys
from moe_eval.gates.golden_errors import (
    POWER,
    DecodeErrors,
    GoldenErrors,
    GoldenRuleResult,
    decode_errors,
    decode_rule,
    errors_vs_golden,
    golden_rule,
    scale_error_power,
)

if TYPE_CHECKING:
    from moe_eval.gates.measurements import IncumbentRow, Judgement, Measurements


@gate_keys
class GoldenKeys:
    """The golden gate's keys (whether the golden runs at all is the run's: golden, logprob_texts)."""

    golden_margin: float = Field(
        0.10,
        ge=0.0,
        le=10.0,
        description="golden gate: fail when error / incumbent's error > 1 + this and the paired test agrees",
    )
    golden_alpha: float = Field(
        0.01, ge=1e-9, le=0.5, description="golden gate: the one-sided paired t-test's significance level"
    )


SECTION = "golden_gate"


class GoldenIncumbent(TypedDict):
    """The run standing as the incumbent (incumbent_description) and its errors."""

    results: str
    """its results.json"""
    moe_backend_used: str
    """the kernel that served it"""
    layout: str | None
    """its layout, e.g. TP (TP1)"""
    same_layout: bool
    """the same layout as this config's"""
    role: str
    """vLLM's own kernel at the same layout, a stand-in at another, or your --baseline run"""
    errors: GoldenErrors
    """its errors against the golden"""


class GoldenPower(TypedDict):
    probability: float
    """the probability the scale error is caught with"""
    scale_error: float | None
    """the per-expert scale error caught with that probability (0: fails as it is; null: none up to 50 %)"""
    expert: int
    """the expert the probe scaled"""
    method: str
    """how the power was computed"""


class DecodeComparison(TypedDict):
    run: DecodeErrors
    """this run's continuations against the golden's"""
    incumbent: DecodeErrors
    """the incumbent's"""
    rule: GoldenRuleResult | None
    """null: fewer than 2 continuations share a first token with the golden's"""
    failed: NotRequired[str]
    """rule null and this run shares fewer first tokens than the incumbent: why it failed"""
    skipped: NotRequired[str]
    """rule null otherwise: why it was not judged"""


class GoldenGate(TypedDict):
    """results.json `golden_gate`; the first four only where the incumbent's errors could not be computed."""

    golden: str
    """the golden reference's digest"""
    run: GoldenErrors
    """this run's errors against the golden"""
    margin: float
    """the config's golden_margin"""
    alpha: float
    """the config's golden_alpha"""
    incumbent: NotRequired[GoldenIncumbent]
    """the incumbent and its errors against the golden"""
    rule: NotRequired[GoldenRuleResult]
    """the rule on this run's errors against the incumbent's"""
    ratio: NotRequired[float]
    """rule.ratio"""
    p: NotRequired[float]
    """rule.p"""
    passed: NotRequired[bool]
    """not rule.failed"""
    power: NotRequired[GoldenPower]
    """the smallest per-expert scale error the rule catches"""
    decode: NotRequired[DecodeComparison | Skipped]
    """the greedy continuations against the golden's, or {skipped}"""


def judge_golden(config: GateConfig, m: Measurements, out: Judgement) -> str | None:
    if m.logprobs is None or m.incumbent_logprobs is None:
        why = no_logprobs(m)
        out.sections[SECTION] = {"skipped": why}
        return why
    if m.golden is None:
        return "no golden reference was made"
    assert m.incumbent is not None  # the gate needs an incumbent
    golden = m.golden
    try:
        run = errors_vs_golden(golden.prefill, m.logprobs)
    except ValueError as exc:
        raise InfraError(f"log-probabilities not comparable with the golden {golden.path}: {exc}") from None
    gate: dict[str, Any] = {
        "golden": golden.digest,
        "run": run.as_dict(),
        "margin": config.keys(GoldenKeys).golden_margin,
        "alpha": config.keys(GoldenKeys).golden_alpha,
    }
    out.sections[SECTION] = gate
    try:
        incumbent = errors_vs_golden(golden.prefill, m.incumbent_logprobs)
    except ValueError as exc:
        raise InfraError(
            f"the incumbent's log-probabilities ({m.incumbent.logprobs_path}) are not comparable with "
            f"the golden {golden.path}: {exc}"
        ) from None
    rule = golden_rule(
        run, incumbent, config.keys(GoldenKeys).golden_margin, config.keys(GoldenKeys).golden_alpha
    )
    power = scale_error_power(
        golden.prefill,
        golden.probe,
        golden.probe_scale_error,
        run,
        incumbent,
        config.keys(GoldenKeys).golden_margin,
        config.keys(GoldenKeys).golden_alpha,
    )
    who = incumbent_description(config, m.incumbent)
    gate.update(
        {
            "incumbent": who | {"errors": incumbent.as_dict()},
            "rule": rule.__dict__,
            "ratio": rule.ratio,
            "p": rule.p,
            "passed": not rule.failed,
            "power": {
                "probability": POWER,
                "scale_error": power,
                "expert": 0,
                "method": "probe sensitivity x scale error, texts bootstrapped (golden_errors.py)",
            },
        }
    )
    if power is None:
        power_text = "catches no per-expert scale error up to 50% (insensitive texts)"
    elif power == 0.0:
        power_text = "fails without any added scale error"
    else:
        power_text = f"catches a per-expert scale error >= {power:.1%} with {POWER:.0%} probability"
    detail = (
        f"{rule.describe()}; error vs golden {run.mean_abs:.5f}, incumbent's {incumbent.mean_abs:.5f} "
        f"({who['moe_backend_used']} {who['layout']}); top-1 agreement {run.top1_agreement:.4f} vs "
        f"{incumbent.top1_agreement:.4f}; signed shift {run.signed_mean:+.5f} vs "
        f"{incumbent.signed_mean:+.5f}; "
        f"{power_text} [golden {golden.digest}]"
    )
    catch = f"a per-expert scale error of {power:.1%}" if power else None
    evidence = Evidence("text", run.texts, len(m.logprobs), would_catch=catch)
    out.checks.append(Check.judged("golden_gate", not rule.failed, detail, evidence))
    out.checks += _decode(config, m, gate)
    return None


def _decode(config: GateConfig, m: Measurements, gate: dict[str, Any]) -> list[Check]:
    """The greedy continuations against the golden's: part of the golden gate where both made them."""
    assert m.golden is not None and m.incumbent is not None
    golden_decode = m.golden.decode
    if not golden_decode or m.decode is None or m.incumbent_decode is None:
        missing = (
            "the golden"
            if not golden_decode
            else "this run"
            if m.decode is None
            else f"the incumbent ({m.incumbent.results_path})"
        )
        gate["decode"] = {"skipped": f"{missing} made no greedy continuations (decode_texts 0?)"}
        if config.decode_texts == 0:  # not asked for
            return []
        return [Check.not_run("golden_gate_decode", f"not run: {gate['decode']['skipped']}")]
    try:
        run = decode_errors(golden_decode, m.decode)
        incumbent = decode_errors(golden_decode, m.incumbent_decode)
    except ValueError as exc:
        raise InfraError(f"greedy continuations not comparable with the golden's: {exc}") from None
    rule = decode_rule(
        run, incumbent, config.keys(GoldenKeys).golden_margin, config.keys(GoldenKeys).golden_alpha
    )
    gate["decode"] = {
        "run": run.as_dict(),
        "incumbent": incumbent.as_dict(),
        "rule": rule.__dict__ if rule is not None else None,
    }
    shared = (
        f"{run.positions} of {run.tokens_generated} generated tokens shared with the golden "
        f"({run.identical_texts}/{run.texts} continuations identical; incumbent {incumbent.positions}, "
        f"{incumbent.identical_texts}/{incumbent.texts})"
    )
    compared = sum(e is not None for e in run.per_text)
    evidence = Evidence("continuation", compared, run.texts)
    if rule is None:
        # Too few continuations start as the golden's to compare errors. A kernel that breaks decoding
        # produces exactly that: fewer first tokens shared than the incumbent's is a failure, not a pass.
        theirs = sum(e is not None for e in incumbent.per_text)
        firsts = (
            f"{compared} of {run.texts} continuations share a first token with the golden's, the "
            f"incumbent's {theirs}"
        )
        if compared < theirs:  # judged, and failed: the record says so, never "skipped" beside a failure
            gate["decode"]["failed"] = f"{firsts}: fewer than the incumbent"
            detail = f"decode: {firsts}: fewer than the incumbent; {shared}"
            return [Check.judged("golden_gate_decode", False, detail, evidence)]
        gate["decode"]["skipped"] = "fewer than 2 continuations share a first token with the golden's"
        return [
            Check.not_run("golden_gate_decode", f"not run: {firsts}: too few to compare; {shared}", evidence)
        ]
    detail = (
        f"decode: {rule.describe()}; error {run.mean_abs:.5f} vs incumbent's {incumbent.mean_abs:.5f}; "
        f"{shared}"
    )
    return [Check.judged("golden_gate_decode", not rule.failed, detail, evidence)]


def incumbent_description(config: GateConfig, incumbent: IncumbentRow) -> dict[str, Any]:
    """Which run stands as the incumbent, and whether it is the kernel users would otherwise run at this
    config's layout or a stand-in."""
    layout = config.layout.describe()
    same_layout = incumbent.layout == layout
    backend = incumbent.moe_backend_used or "unknown"
    if backend.startswith("bundled:"):
        role = "your baseline run (--baseline): the kernel before your change"
    elif same_layout:
        role = "vLLM's own MoE kernel at the same layout"
    else:
        role = (
            f"vLLM's own MoE kernel at {incumbent.layout}, standing in: this config's baseline_config runs "
            f"another layout than {layout}"
        )
    return {
        "results": str(incumbent.results_path),
        "moe_backend_used": backend,
        "layout": incumbent.layout,
        "same_layout": same_layout,
        "role": role,
    }


def golden_cell(gate: Any, row: RowView | None = None) -> str:
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


GATE = Gate(
    "golden",
    ("golden_gate", "golden_gate_decode"),
    lambda c, _: c.golden_gated,
    True,
    judge_golden,
    "error against the exact-MoE golden reference, no worse than the incumbent's (prefill and decode)",
    keys=GoldenKeys,
    section=SECTION,
    payload=GoldenGate | Skipped,
    show=Show(columns=(Column("Error vs golden (incumbent)", golden_cell),)),
)
