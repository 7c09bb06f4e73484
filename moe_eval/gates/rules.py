"""Each gate's rule: from a config and its measurements, the gate's checks and results.json section.

One function per gate of moe_eval.gates.table, where each is registered with its name, when it applies and
what it needs: `rule(config, measurements, judgement)` appends the gate's checks and sections to the
judgement and returns None, or returns why the gate could not be judged (the judge then records it as not
run, or skipped where the gate is optional). No I/O.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from typing import Any

from moe_eval.core.check import Check
from moe_eval.core.errors import InfraError
from moe_eval.gates.accuracy import GateResult
from moe_eval.gates.checks import Baseline, garbage_checks, paired_check
from moe_eval.gates.divergence import DivergenceLimits, default_limits, divergence, divergence_checks
from moe_eval.gates.golden_gate import (
    POWER,
    decode_errors,
    decode_rule,
    errors_vs_golden,
    golden_rule,
    scale_error_power,
)
from moe_eval.gates.layer_gate import LayerCheckLimits, layer_checks, summary_record
from moe_eval.gates.measurements import Judgement, Measurements
from moe_eval.gates.speed import Margins, speed_check, times_differ_by
from moe_eval.gates.stats import describe_power, detectable_drop
from moe_eval.plan.config import EvalConfig


def judge_served(config: EvalConfig, m: Measurements, out: Judgement) -> str | None:
    if m.answers is None:
        return "the evaluation made no answers"
    # Against the questions asked, not a count of the same samples (which could not fail).
    n = m.answers.num_questions
    asked = m.answers.asked if m.answers.asked is not None else config.num_questions
    out.checks.append(
        Check.judged("served", n == asked, f"{n} of {asked} questions asked answered by the server")
    )
    return None


def judge_accuracy(config: EvalConfig, m: Measurements, out: Judgement) -> str | None:
    if m.answers is None:
        return "the evaluation made no answers"
    strict = m.answers.scores["strict-match"]
    gate = GateResult(
        accuracy=strict["accuracy"],
        stderr=strict["stderr"],
        threshold=config.accuracy_threshold,
        tolerance=config.tolerance,
        stderr_k=config.stderr_gate_k,
    )
    n = m.answers.num_questions
    drop = detectable_drop(n, config.accuracy_threshold, gate.floor)
    # inf: no accuracy can fail the gate (a floor at or below 0), said as null rather than a number
    out.sections["gate"] = gate.as_dict() | {
        "power": 0.8,
        "detectable_drop": drop if math.isfinite(drop) else None,
        "power_n": n,
    }
    power = describe_power(n, config.accuracy_threshold, gate.floor)
    out.checks.append(Check.judged("accuracy_gate", gate.passed, f"{gate.describe()}; {power}"))
    return None


def judge_garbage(config: EvalConfig, m: Measurements, out: Judgement) -> str | None:
    if m.answers is None:
        return "the evaluation made no answers"
    out.checks += garbage_checks(config, m.answers.stats)
    return None


def judge_paired(config: EvalConfig, m: Measurements, out: Judgement) -> str | None:
    if m.answers is None:
        return "the evaluation made no answers"
    check, result = paired_check(m.incumbent, m.answers.correctness, config.paired_alpha)
    out.sections["paired"] = result.as_dict() | {"baseline": str(m.incumbent.results_path)}
    out.checks.append(check)
    return None


def judge_divergence(config: EvalConfig, m: Measurements, out: Judgement) -> str | None:
    """Limits from the config, else the defaults for the kind of incumbent (the same kernel at the same
    layout repeats bitwise; another kernel or layout differs by rounding)."""
    base = m.incumbent
    same_kernel = base.moe_backend_used == m.moe_backend_used and base.layout == config.layout.describe()
    # Under the golden gate the strict same-kernel limits do not gate: a legitimate change of the kernel's
    # rounding would fail them (docs/logprob-gate.md); the loose limits stay, a net for gross changes.
    same = same_kernel and not config.golden_gated
    defaults = default_limits(same)
    if config.random_weights:
        # A random-weights twin's next-token distributions are near flat: its top-1 token flips on rounding
        # alone (1.9% for a correct kernel on the Scout twin, H200), so only an explicit max_top1_flip_rate
        # gates it.
        defaults = replace(defaults, max_top1_flip_rate=None)
    limits = DivergenceLimits(
        _first_set(config.max_logprob_mean_abs_diff, defaults.max_mean_abs_dlogp),
        _first_set(config.max_logprob_p99_abs_diff, defaults.max_p99_abs_dlogp),
        _first_set(config.max_top1_flip_rate, defaults.max_top1_flip_rate),
        _first_set(config.max_logprob_kl, defaults.max_kl_topk),
    )
    if m.logprobs is None or m.incumbent_logprobs is None:
        why = _no_logprobs(m)
        out.sections["divergence"] = {"skipped": why}
        return why
    try:
        div = divergence(m.incumbent_logprobs, m.logprobs)
    except ValueError as exc:  # other texts or another tokenizer: not comparable, so not a verdict
        raise InfraError(f"log-probabilities not comparable with {base.logprobs_path}: {exc}") from None
    out.sections["divergence"] = div.as_dict() | {
        "baseline": str(base.logprobs_path),
        "limits": asdict(limits),
        "comparison": (
            "same kernel and layout"
            if same
            else "same kernel and layout; the golden gate decides (loose limits)"
            if config.golden_gated and same_kernel
            else "another kernel or layout"
        ),
    }
    out.checks += divergence_checks(div, limits)
    return None


def _no_logprobs(m: Measurements) -> str:
    if m.logprobs is None:
        return f"this run scored no log-probabilities ({m.logprobs_skipped or 'logprob_texts 0'})"
    return f"the incumbent ({m.incumbent.results_path}) scored no log-probabilities"


def _first_set(value: float | None, default: float | None) -> float | None:
    return default if value is None else value


def judge_jit(config: EvalConfig, m: Measurements, out: Judgement) -> str | None:
    """max_jit_while_serving: kernels compiled after vLLM's warm-up (its JIT monitor's warnings)."""
    if m.jit is None:
        return "the server's log was not read"
    jit, limit = m.jit, config.max_jit_while_serving
    if jit["monitored_processes"] == 0:
        detail = (
            "vLLM's JIT monitor never started (no 'Kernel JIT monitor activated' in server.log), so "
            "compilations while serving cannot be counted"
        )
        out.checks.append(Check.not_run("jit_while_serving", "not run: " + detail))
        return None
    kernels = f" ({', '.join(jit['kernels'])})" if jit["kernels"] else ""
    detail = (
        f"kernel compilations while serving: {jit['count']}{kernels} (limit {limit}; "
        f"{jit['monitored_processes']} process(es) monitored)"
    )
    out.checks.append(Check.judged("jit_while_serving", jit["count"] <= limit, detail))
    return None


def judge_kernel_calls(config: EvalConfig, m: Measurements, out: Judgement) -> str | None:
    """A bundled kernel must have run in every rank of the layout, as its own counters say (counted on the
    device where CUDA graphs replay it): a server that loaded the plugin but routed around it fails here."""
    if m.kernel_calls is None:
        return "the kernel's counters were not read"
    calls, ranks = m.kernel_calls, config.layout.world_size
    ran = calls["processes"] >= ranks and calls["calls"] > 0
    detail = (
        f"{calls['calls']} MoE calls ({calls['tokens']} tokens) counted by {calls['processes']} of "
        f"{ranks} rank(s), on {', '.join(map(str, calls['counted_on'])) or 'nothing'}"
    )
    out.checks.append(Check.judged("bundled_kernel_calls", ran, detail))
    return None


def _speed_comparable(config: EvalConfig, m: Measurements) -> str | None:
    """Why this row's MoE times cannot be compared with its reference's (None: they can)."""
    if m.speed is None:
        return "the row's MoE calls were not timed"
    if m.incumbent is None:
        return NO_INCUMBENT_SPEED
    reference = m.incumbent.speed
    if reference is None:
        return (
            f"the reference ({m.incumbent.results_path}) holds no MoE timing: it ran with moe_timing: false "
            "or before moe-eval timed its calls"
        )
    apart = times_differ_by(m.machine, m.workload, m.incumbent.machine, m.incumbent.workload)
    if apart == "machine":
        return f"the reference ran on {m.incumbent.machine}, this row on {m.machine}: times do not compare"
    if apart == "requests":
        # Other prompts route to other experts: the per-size means of two workloads are not one kernel's
        # against another's (the sweep's prompts changed in moe-eval itself on 2026-12-05).
        there, here = (workload or "not recorded" for workload in (m.incumbent.workload, m.workload))
        return (
            f"the reference's timed requests differ from this row's (workload {there} there, {here} here: "
            "another moe-eval, tokenizer, task texts or token limit)"
        )
    for what, timing, ranks in (
        ("this row", m.speed, config.layout.world_size),
        ("the reference", reference, m.incumbent.world_size),
    ):
        if timing.processes < ranks:
            # A rank that wrote no timing could be the slow one: the slowest rank is what the gate compares.
            return f"{what} was timed on {timing.processes} of its {ranks} ranks"
    if set(m.speed.timed_on) != set(reference.timed_on):
        return (
            f"this row was timed on the {'/'.join(m.speed.timed_on)}, the reference on the "
            f"{'/'.join(reference.timed_on)}: the brackets differ"
        )
    return None


NO_INCUMBENT_SPEED = "no reference to compare the MoE calls' time with (no incumbent, no --baseline)"


def _speed_margins(config: EvalConfig) -> Margins:
    return Margins(replayed=config.speed_margin, eager=config.speed_margin_eager)


def judge_speed(config: EvalConfig, m: Measurements, out: Judgement) -> str | None:
    """Per dispatch range, the served MoE calls' time against the reference's at matched sizes
    (gates/speed.py)."""
    why = _speed_comparable(config, m)
    if why is not None:
        return why
    check, section = speed_check(
        m.speed, m.incumbent.speed, _speed_margins(config), str(m.incumbent.results_path)
    )
    out.sections["speed"] = section
    if check is None:
        return "no dispatch range could be judged: " + "; ".join(
            f"{r['range']}: {r['why_not']}" for r in section["ranges"]
        )
    logged = (("this row's", m.speed_warnings), ("the reference's", m.incumbent.speed_warnings))
    warned = [f"{whose} server logged: {'; '.join(warnings)}" for whose, warnings in logged if warnings]
    if warned:
        # Not a verdict of its own: a change that breaks the autotune is a slowdown the gate must still show.
        check = replace(check, detail=f"{check.detail}; {'; '.join(warned)}")
    out.checks.append(check)
    return None


def report_speed(config: EvalConfig, m: Measurements, out: Judgement) -> None:
    """A row timed beside an incumbent but not gated (the CPU): the same comparison, reported only."""
    if not config.speed_reported(m.incumbent is not None):
        return
    why = _speed_comparable(config, m)
    if why is not None:
        out.sections["speed"] = {"skipped": f"not compared: {why}"}
        return
    _, section = speed_check(
        m.speed, m.incumbent.speed, _speed_margins(config), str(m.incumbent.results_path)
    )
    out.sections["speed"] = section | {"gated": False}


def layer_check_limits(config: EvalConfig) -> LayerCheckLimits:
    return LayerCheckLimits(
        margin=config.layer_check_margin,
        scale_bound=config.layer_check_scale_bound,
        z=config.layer_check_z,
        activation_bound=config.layer_check_activation_bound,
        power=config.layer_check_power,
        min_judged=config.layer_check_min_judged,
    )


def judge_layer_check(config: EvalConfig, m: Measurements, out: Judgement) -> str | None:
    if m.layer is None:
        return "the processes' layer-check sums were not read"
    limits = layer_check_limits(config)
    out.checks += layer_checks(m.layer, limits)
    out.sections["layer_check"] = summary_record(m.layer, limits)
    return None


def judge_golden(config: EvalConfig, m: Measurements, out: Judgement) -> str | None:
    if m.logprobs is None or m.incumbent_logprobs is None:
        why = _no_logprobs(m)
        out.sections["golden_gate"] = {"skipped": why}
        return why
    if m.golden is None:
        return "no golden reference was made"
    golden = m.golden
    try:
        run = errors_vs_golden(golden.prefill, m.logprobs)
    except ValueError as exc:
        raise InfraError(f"log-probabilities not comparable with the golden {golden.path}: {exc}") from None
    gate: dict[str, Any] = {
        "golden": golden.digest,
        "run": run.as_dict(),
        "margin": config.golden_margin,
        "alpha": config.golden_alpha,
    }
    out.sections["golden_gate"] = gate
    try:
        incumbent = errors_vs_golden(golden.prefill, m.incumbent_logprobs)
    except ValueError as exc:
        raise InfraError(
            f"the incumbent's log-probabilities ({m.incumbent.logprobs_path}) are not comparable with "
            f"the golden {golden.path}: {exc}"
        ) from None
    rule = golden_rule(run, incumbent, config.golden_margin, config.golden_alpha)
    power = scale_error_power(
        golden.prefill,
        golden.probe,
        golden.probe_scale_error,
        run,
        incumbent,
        config.golden_margin,
        config.golden_alpha,
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
                "method": "probe sensitivity x scale error, texts bootstrapped (golden_gate.py)",
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
    out.checks.append(Check.judged("golden_gate", not rule.failed, detail))
    out.checks += _decode(config, m, gate)
    return None


def _decode(config: EvalConfig, m: Measurements, gate: dict[str, Any]) -> list[Check]:
    """The greedy continuations against the golden's: part of the golden gate where both made them."""
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
    rule = decode_rule(run, incumbent, config.golden_margin, config.golden_alpha)
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
    if rule is None:
        # Too few continuations start as the golden's to compare errors. A kernel that breaks decoding
        # produces exactly that: fewer first tokens shared than the incumbent's is a failure, not a pass.
        mine, theirs = (sum(e is not None for e in d.per_text) for d in (run, incumbent))
        firsts = (
            f"{mine} of {run.texts} continuations share a first token with the golden's, the "
            f"incumbent's {theirs}"
        )
        if mine < theirs:  # judged, and failed: the record says so, never "skipped" beside a failure
            gate["decode"]["failed"] = f"{firsts}: fewer than the incumbent"
            return [
                Check.judged(
                    "golden_gate_decode", False, f"decode: {firsts}: fewer than the incumbent; {shared}"
                )
            ]
        gate["decode"]["skipped"] = "fewer than 2 continuations share a first token with the golden's"
        return [Check.not_run("golden_gate_decode", f"not run: {firsts}: too few to compare; {shared}")]
    detail = (
        f"decode: {rule.describe()}; error {run.mean_abs:.5f} vs incumbent's {incumbent.mean_abs:.5f}; "
        f"{shared}"
    )
    return [Check.judged("golden_gate_decode", not rule.failed, detail)]


def incumbent_description(config: EvalConfig, baseline: Baseline) -> dict[str, Any]:
    """Which run stands as the incumbent, and whether it is the kernel users would otherwise run at this
    config's layout or a stand-in."""
    layout = config.layout.describe()
    same_layout = baseline.layout == layout
    backend = baseline.moe_backend_used or "unknown"
    if backend.startswith("bundled:"):
        role = "your baseline run (--baseline): the kernel before your change"
    elif same_layout:
        role = "vLLM's own MoE kernel at the same layout"
    else:
        role = (
            f"vLLM's own MoE kernel at {baseline.layout}, standing in: this config's baseline_config runs "
            f"another layout than {layout}"
        )
    return {
        "results": str(baseline.results_path),
        "moe_backend_used": backend,
        "layout": baseline.layout,
        "same_layout": same_layout,
        "role": role,
    }
