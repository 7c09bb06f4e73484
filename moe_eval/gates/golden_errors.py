"""The golden gate: is this kernel's error against an exact reference no worse than the incumbent's?

A bf16 MoE kernel cannot match another bf16 kernel bitwise, and a legitimate change (another tile
shape, another reduction order, another layout) moves the numbers as much as a subtle bug does when
both are measured against a bf16 kernel. Against a golden reference (the same model with its MoE
computed exactly, moe_eval.evaluate.golden) the two separate: a correct kernel's error is about the
incumbent's, a bug adds its own. The incumbent is the kernel users would otherwise run (vLLM's own
MoE kernel, at the same layout where vLLM has one) or, with `run --baseline`, the user's own run from
before the change.

Stages:
  1. `errors_vs_golden(golden, capture)`: per text, the mean |log p - log p_golden| of the reference
     tokens; pooled, that is "the error". Also KL over the shared top-k, top-1 agreement and the signed
     likelihood shift (reported, not gated).
  2. `golden_rule(run, incumbent, margin, alpha)`: FAIL iff the error ratio run / incumbent exceeds
     1 + margin AND a one-sided paired t-test over texts (run's per-text error minus the incumbent's)
     gives p < alpha. The margin keeps a correct kernel with a slightly larger error (a layout that adds
     an all-reduce in bf16) from failing on significance alone; the test keeps a ratio that is noise
     from failing on size alone.
  3. `scale_error_power(...)`: the smallest per-expert scale error the rule catches with 80% probability
     on this model and these texts (how: `scale_error_power`'s docstring).
  4. `decode_errors(golden, capture)`: greedy continuations compared position by position up to the
     first token where they part (the decode path: one token per step, CUDA graphs on a GPU), over the
     top-k tokens both list at a position, not the generated token alone (why: `decode_errors`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast

import numpy as np

from moe_eval.core.logprob_texts import TextLogprobs
from moe_eval.core.payload import described
from moe_eval.gates.divergence import divergence_of_pairs, paired_texts
from moe_eval.gates.stats import student_t_sf  # noqa: F401  (re-exported: the golden tests read it here)

DEFAULT_MARGIN = 0.10  # docs/logprob-gate.md: correct kernels measured at ratios 0.93-1.05
DEFAULT_ALPHA = 0.01
POWER = 0.8
BOOTSTRAP_DRAWS = 400  # resamples of the texts per candidate scale error (fixed seed: a pure function)


@dataclass(frozen=True)
class GoldenErrors:
    """One capture against the golden, over the same texts (positions exclude each text's first)."""

    texts: int = described("texts compared")
    positions: int = described("positions compared, each text's first left out")
    mean_abs: float = described("pooled mean |log p - log p_golden| of the reference tokens: the error")
    per_text: tuple[float, ...] = described("each text's mean |log p - log p_golden|, in text-index order")
    per_text_positions: tuple[int, ...] = described("each text's positions")
    signed_mean: float = described(
        "pooled mean of log p - log p_golden (> 0: the reference text more likely)"
    )
    texts_more_likely: int = described("texts whose mean signed shift is > 0")
    kl_topk: float = described("mean KL(golden || capture) on the shared top-k")
    top1_agreement: float = described("share of positions whose top-1 token is the golden's")

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["per_text"] = [round(v, 7) for v in self.per_text]
        return out


def errors_vs_golden(golden: Sequence[TextLogprobs], capture: Sequence[TextLogprobs]) -> GoldenErrors:
    pairs = paired_texts(golden, capture, ("golden", "capture"))  # paired once, by index, texts checked
    div = divergence_of_pairs(pairs)  # KL and top-1; refuses captures with no position to compare
    # Per text, log p - log p_golden of the reference tokens (position 0 left out).
    deltas = [
        np.array(c.logprobs[1:], dtype=np.float64) - np.array(g.logprobs[1:], dtype=np.float64)
        for g, c in pairs
    ]
    counts = [d.size for d in deltas]
    total = sum(counts)
    return GoldenErrors(
        texts=len(deltas),
        positions=total,
        mean_abs=float(sum(np.abs(d).sum() for d in deltas) / total),
        per_text=tuple(float(np.abs(d).mean()) if d.size else 0.0 for d in deltas),
        per_text_positions=tuple(counts),
        signed_mean=float(sum(d.sum() for d in deltas) / total),
        texts_more_likely=sum(1 for d in deltas if d.size and d.mean() > 0),
        kl_topk=div.kl_topk,
        top1_agreement=1.0 - div.top1_flip_rate,
    )


# --- the rule ------------------------------------------------------------------------------------


def paired_t_greater(diffs: np.ndarray) -> tuple[float, float]:
    """One-sided paired t-test, H1: mean(diffs) > 0. (t, p); all-equal diffs give p 0 or 1."""
    n = diffs.size
    if n < 2:
        return math.nan, 1.0
    mean, sd = float(diffs.mean()), float(diffs.std(ddof=1))
    if sd == 0.0:
        return (math.inf, 0.0) if mean > 0 else (-math.inf if mean < 0 else 0.0, 1.0)
    t = mean / (sd / math.sqrt(n))
    return t, student_t_sf(t, n - 1)


@dataclass(frozen=True)
class GoldenRuleResult:
    """Fails iff ratio > 1 + margin and p < alpha."""

    ratio: float = described("this run's error / the incumbent's")
    paired_mean_diff: float = described("mean over texts of (this run's error - the incumbent's)")
    t: float = described("the paired t statistic over texts")
    p: float = described("one-sided paired t-test")
    texts_worse: int = described("texts where this run's error is above the incumbent's")
    texts: int = described("texts compared")
    margin: float = described("the config's golden_margin")
    alpha: float = described("the config's golden_alpha")
    failed: bool = described("ratio > 1 + margin and p < alpha")

    def describe(self) -> str:
        verdict = "FAIL" if self.failed else "pass"
        return (
            f"{verdict}: error ratio {self.ratio:.3f} vs the incumbent (fail above {1 + self.margin:.2f} "
            f"with p < {self.alpha:g}); paired over {self.texts} texts: {self.paired_mean_diff:+.5f} "
            f"mean, t = {self.t:.2f}, p = {self.p:.3g}, {self.texts_worse} worse"
        )


def _rule(
    run_per_text: np.ndarray, run_counts: np.ndarray, inc_per_text: np.ndarray, margin: float, alpha: float
) -> GoldenRuleResult:
    # The ratio of pooled errors (each text weighted by its positions), the test over per-text differences.
    run_err = float((run_per_text * run_counts).sum() / run_counts.sum())
    inc_err = float((inc_per_text * run_counts).sum() / run_counts.sum())
    ratio = run_err / inc_err if inc_err > 0 else (math.inf if run_err > 0 else 1.0)
    diffs = run_per_text - inc_per_text
    t, p = paired_t_greater(diffs)
    return GoldenRuleResult(
        ratio=ratio,
        paired_mean_diff=float(diffs.mean()),
        t=t,
        p=p,
        texts_worse=int((diffs > 0).sum()),
        texts=int(diffs.size),
        margin=margin,
        alpha=alpha,
        failed=bool(ratio > 1 + margin and p < alpha),
    )


def golden_rule(
    run: GoldenErrors, incumbent: GoldenErrors, margin: float = DEFAULT_MARGIN, alpha: float = DEFAULT_ALPHA
) -> GoldenRuleResult:
    if run.per_text_positions != incumbent.per_text_positions:
        raise ValueError("run and incumbent were scored on different texts")
    return _rule(
        np.array(run.per_text),
        np.array(run.per_text_positions, dtype=np.float64),
        np.array(incumbent.per_text),
        margin,
        alpha,
    )


# --- the gate's power ------------------------------------------------------------------------------


def scale_error_power(
    golden: Sequence[TextLogprobs],
    probe: Sequence[TextLogprobs],
    probe_scale_error: float,
    run_err: GoldenErrors,
    incumbent: GoldenErrors,
    margin: float = DEFAULT_MARGIN,
    alpha: float = DEFAULT_ALPHA,
    power: float = POWER,
    seed: int = 0,
) -> float | None:
    """The smallest per-expert scale error (0.02 = one expert's output 2% short) that the rule catches
    with probability >= `power`, for this model and text set, on top of this run's kernel.

    How: the probe (the golden's model with global expert 0's output short by probe_scale_error, exact
    MoE, moe_eval.evaluate.golden) gives each text's error b_i from that bug alone: mean |log p_probe - log
    p_golden|. A run with an extra scale error ε is modelled text by text as
    sqrt(r_i^2 + (ε / probe_scale_error * b_i)^2), r_i this run's own error: independent error sources
    add in quadrature. (Adding the probe's
    deviations to this run's position by position over-predicted: the kernel's deviations re-randomise
    under a perturbation rather than stay put. On the CPU canary the quadrature model predicted ratios
    1.27 and 0.87 at TP1 for 5% and 2%, measured 1.26 and 0.79; docs/logprob-gate.md.) Linear in ε for
    b_i, which holds to first order. The simulated errors go through the rule against the incumbent's;
    "probability" is over text sets: the texts are resampled with replacement (BOOTSTRAP_DRAWS, fixed
    seed) and ε is the smallest value (bisection, to 2%) failing in >= `power` of the resamples. 0.0 when
    the run fails that often as it is; None when even a 50% error is not caught (an insensitive text set
    or a dead expert 0). run_err: this run's errors_vs_golden (the judge has them already)."""
    probe_err = np.array(errors_vs_golden(golden, probe).per_text)
    counts = np.array(run_err.per_text_positions, dtype=np.float64)
    own = np.array(run_err.per_text)
    inc = np.array(incumbent.per_text)
    if incumbent.per_text_positions != run_err.per_text_positions:
        raise ValueError("run and incumbent were scored on different texts")
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, counts.size, size=(BOOTSTRAP_DRAWS, counts.size))

    def caught(eps: float) -> bool:
        per_text = np.sqrt(own**2 + (eps / probe_scale_error * probe_err) ** 2)
        fails = sum(_rule(per_text[idx], counts[idx], inc[idx], margin, alpha).failed for idx in draws)
        return fails >= power * BOOTSTRAP_DRAWS

    if caught(0.0):
        return 0.0  # the run as it is fails in most text sets: nothing needs adding
    lo, hi = 1e-4, 0.5
    if not caught(hi):
        return None
    if caught(lo):
        return lo
    while hi / lo > 1.02:
        mid = math.sqrt(lo * hi)
        if caught(mid):
            hi = mid
        else:
            lo = mid
    return hi


# --- decode ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeErrors:
    """Greedy continuations against the golden's: compared while both generated the same tokens."""

    texts: int = described("continuations compared")
    tokens_generated: int = described("by the golden, all texts")
    positions: int = described("compared: before the first token where the two part")
    mean_abs: float | None = described(
        "pooled mean |log p - log p_golden| over the top-k both list (null: no position)"
    )
    per_text: tuple[float | None, ...] = described("each text's (null: no position shared)")
    per_text_positions: tuple[int, ...] = described("each text's positions compared")
    identical_texts: int = described("continuations identical to the golden's to the end")
    first_difference: tuple[int | None, ...] = described(
        "per text, the first position whose token differs (null: identical)"
    )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _top_k_abs_delta(gold: TextLogprobs, other: TextLogprobs, position: int) -> float:
    """Mean |Δ log p| over the tokens both top-k lists hold at `position` (while the continuations agree
    the generated token is the top-1 of both, so there is at least one)."""
    theirs = dict(zip(other.top_ids[position] or (), other.top_logprobs[position] or ()))
    deltas = [
        abs(lp - theirs[token])
        for token, lp in zip(gold.top_ids[position] or (), gold.top_logprobs[position] or ())
        if token in theirs
    ]
    if not deltas:  # no top-k recorded: the generated token's own log p
        # A generated token always has its log p (parse_generation refuses one without); a None read from a
        # file fails in float() as before.
        return abs(float(cast(float, other.logprobs[position])) - float(cast(float, gold.logprobs[position])))
    return float(np.mean(deltas))


def decode_errors(golden: Sequence[TextLogprobs], capture: Sequence[TextLogprobs]) -> DecodeErrors:
    """Per position, the mean |Δ log p| over the top-k tokens both list. Not the generated token's own
    log p, as prefill scoring uses: a greedy token is the model's most likely one, its log p sits near 0
    where log-softmax is flat, and vLLM returns 6 decimals, so that error read 0.00000 for a correct
    incumbent and 43x that for a correct bundled row (CPU, 2026-12-02), and a 5% one-expert scale error
    passed (p = 0.14-0.17). The runner-up tokens' log p move with the hidden state at full size: on the
    same captures correct rows read 1.03-1.10x the incumbent, that bug 2.2-3.0x with 8 of 8 texts worse
    (docs/logprob-gate.md, "The decode comparison")."""
    # Continuations are compared while their tokens agree: paired by prompt, not by token ids.
    pairs = paired_texts(golden, capture, ("golden decode", "decode capture"), same_tokens=False)
    per_text, counts, firsts, total_abs = [], [], [], 0.0
    identical = 0
    for g, c in pairs:
        shared = next(
            (p for p, (x, y) in enumerate(zip(g.token_ids, c.token_ids)) if x != y), min(len(g), len(c))
        )
        same_to_end = shared == len(g) == len(c)
        identical += same_to_end
        firsts.append(None if same_to_end else shared)
        d = np.array([_top_k_abs_delta(g, c, p) for p in range(shared)], dtype=np.float64)
        counts.append(int(d.size))
        per_text.append(float(d.mean()) if d.size else None)
        total_abs += float(d.sum())
    positions = sum(counts)
    return DecodeErrors(
        texts=len(pairs),
        tokens_generated=sum(len(g) for g, _ in pairs),
        positions=positions,
        mean_abs=total_abs / positions if positions else None,
        per_text=tuple(per_text),
        per_text_positions=tuple(counts),
        identical_texts=identical,
        first_difference=tuple(firsts),
    )


def decode_rule(
    run: DecodeErrors, incumbent: DecodeErrors, margin: float = DEFAULT_MARGIN, alpha: float = DEFAULT_ALPHA
) -> GoldenRuleResult | None:
    """The same rule on the decode positions, over the texts where both shared at least one token with
    the golden (each side over its own shared prefix); None when fewer than 2 such texts."""
    keep = [
        i for i, (r, c) in enumerate(zip(run.per_text, incumbent.per_text)) if r is not None and c is not None
    ]
    if len(keep) < 2:
        return None
    run_pt = np.array([run.per_text[i] for i in keep])
    inc_pt = np.array([incumbent.per_text[i] for i in keep])
    counts = np.array([run.per_text_positions[i] for i in keep], dtype=np.float64)
    return _rule(run_pt, counts, inc_pt, margin, alpha)
