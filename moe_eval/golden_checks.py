"""The golden gate inside a config's run: find or make the golden, measure run and incumbent, decide.

Called by moe_eval.runner after the config's own server is down (its GPUs or cores then make the
golden when the cache has none). Writes results.json's `golden` (which record, made now or cached, its
cost) and `golden_gate` (both errors, the rule's numbers, the power, the decode comparison); returns the
checks `golden_gate` and `golden_gate_decode`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from moe_eval.checks import Baseline, Check
from moe_eval.config import EvalConfig
from moe_eval.errors import InfraError
from moe_eval.golden import PROBE_SCALE_ERROR, GoldenStore, ServerPlace, cache_dir, ensure_golden, golden_plan
from moe_eval.golden_gate import (
    POWER,
    decode_errors,
    decode_rule,
    errors_vs_golden,
    golden_rule,
    scale_error_power,
)
from moe_eval.gsm8k import Gsm8kData
from moe_eval.logprobs import TextLogprobs, read_logprobs
from moe_eval.results import cpu_model


def golden_device(hw: str, gpus: tuple[str, ...]) -> str:
    """The golden key's device: numbers differ between CPU instruction sets and GPU generations."""
    if hw == "cpu":
        return f"cpu: {cpu_model()}"
    return gpus[0] if gpus else hw


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


def golden_checks(
    config: EvalConfig,
    options: Any,
    data: Gsm8kData,
    model: str,
    run_dir: Path,
    logprobs: list[TextLogprobs] | None,
    decode: list[TextLogprobs] | None,
    baseline: Baseline | None,
    record: dict[str, Any],
    timings: dict[str, float],
) -> list[Check]:
    if logprobs is None:
        record["golden_gate"] = {"skipped": "this run scored no log-probabilities (no local GSM8K copy?)"}
        return []
    if baseline is None or baseline.logprobs_path is None:
        # Nothing to gate against: no golden is made for a number that would decide nothing.
        record["golden_gate"] = {
            "skipped": "no incumbent to compare with: give the config a baseline_config "
            "running vLLM's own kernel at its layout, or pass --baseline RUN"
        }
        return []
    started = time.monotonic()
    store = GoldenStore(options.golden_cache or cache_dir())
    plan = golden_plan(
        config,
        data,
        model,
        golden_device(options.hw, options.gpus),
        memo_path=store.root / "weights-digests.json",
    )
    place = ServerPlace(
        hw=options.hw,
        devices=options.devices,
        gpus=len(options.gpus),
        log_dir=run_dir / "golden",
        progress=options.progress,
        stage=options.status.stage if options.status is not None else (lambda _: None),
    )
    golden, made_now = ensure_golden(plan, config, place, store)
    timings["golden_seconds"] = time.monotonic() - started
    record["golden"] = golden.describe() | {"made_now": made_now, "seconds": timings["golden_seconds"]}
    try:
        run = errors_vs_golden(golden.prefill, logprobs)
    except ValueError as exc:
        raise InfraError(f"log-probabilities not comparable with the golden {golden.path}: {exc}") from None
    gate: dict[str, Any] = {
        "golden": golden.key.digest,
        "run": run.as_dict(),
        "margin": config.golden_margin,
        "alpha": config.golden_alpha,
    }
    record["golden_gate"] = gate
    try:
        incumbent = errors_vs_golden(golden.prefill, read_logprobs(baseline.logprobs_path))
    except ValueError as exc:
        raise InfraError(
            f"the incumbent's log-probabilities ({baseline.logprobs_path}) are not comparable with "
            f"the golden {golden.path}: {exc}"
        ) from None
    rule = golden_rule(run, incumbent, config.golden_margin, config.golden_alpha)
    power = scale_error_power(
        golden.prefill,
        golden.probe,
        PROBE_SCALE_ERROR,
        logprobs,
        incumbent,
        config.golden_margin,
        config.golden_alpha,
    )
    who = incumbent_description(config, baseline)
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
        f"{power_text} [golden {golden.key.digest}]"
    )
    checks = [Check("golden_gate", not rule.failed, detail)]
    checks += _decode_checks(config, golden.decode, decode, baseline, gate)
    return checks


def _decode_checks(
    config: EvalConfig,
    golden_decode: list[TextLogprobs],
    decode: list[TextLogprobs] | None,
    baseline: Baseline,
    gate: dict[str, Any],
) -> list[Check]:
    if not golden_decode or decode is None or baseline.decode_path is None:
        missing = (
            "the golden"
            if not golden_decode
            else "this run"
            if decode is None
            else f"the incumbent ({baseline.results_path})"
        )
        gate["decode"] = {"skipped": f"{missing} made no greedy continuations (decode_texts 0?)"}
        return []
    try:
        run = decode_errors(golden_decode, decode)
        incumbent = decode_errors(golden_decode, read_logprobs(baseline.decode_path))
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
        gate["decode"]["skipped"] = "fewer than 2 continuations share a first token with the golden's"
        return []
    return [
        Check(
            "golden_gate_decode",
            not rule.failed,
            f"decode: {rule.describe()}; error {run.mean_abs:.5f} vs incumbent's {incumbent.mean_abs:.5f}; "
            f"{shared}",
        )
    ]
