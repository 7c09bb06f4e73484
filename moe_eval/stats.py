"""Statistics for the gates: the standard error of an accuracy and the exact McNemar test.

The paired test asks "did this kernel change answers?": over the questions both runs answered,
b = baseline right and new wrong, c = baseline wrong and new right. Under "no change" each
discordant question is a fair coin, so b ~ Binomial(b + c, 1/2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def accuracy_stderr(correct: int, n: int) -> float:
    """Sample standard deviation of 0/1 outcomes over sqrt(n), as lm-eval's mean_stderr computes it."""
    if n < 2:
        return float("nan")
    p = correct / n
    return math.sqrt(p * (1 - p) * n / (n - 1) / n)


def _binom_tail_at_least(k: int, n: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2), exact."""
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2**n


def mcnemar_exact(b: int, c: int) -> tuple[float, float]:
    """(p one-sided for 'new is worse', p two-sided) for b = base-only right, c = new-only right."""
    n = b + c
    if n == 0:
        return 1.0, 1.0
    p_worse = _binom_tail_at_least(b, n)
    p_two = min(1.0, 2 * _binom_tail_at_least(max(b, c), n))
    return p_worse, p_two


@dataclass(frozen=True)
class PairedResult:
    n: int
    both_right: int
    baseline_only: int  # b: baseline right, new wrong
    new_only: int  # c: baseline wrong, new right
    both_wrong: int
    p_worse: float  # exact one-sided McNemar p-value for "the new run is worse"
    p_two_sided: float
    alpha: float

    @property
    def passed(self) -> bool:
        return not (self.baseline_only > self.new_only and self.p_worse < self.alpha)

    def describe(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{verdict}: paired vs baseline on {self.n} questions: {self.baseline_only} flipped "
            f"right->wrong, {self.new_only} wrong->right; exact McNemar p(worse) = {self.p_worse:.4g} "
            f"(alpha {self.alpha:g})"
        )

    def as_dict(self) -> dict:
        return {
            "n": self.n,
            "both_right": self.both_right,
            "baseline_only_right": self.baseline_only,
            "new_only_right": self.new_only,
            "both_wrong": self.both_wrong,
            "p_worse": self.p_worse,
            "p_two_sided": self.p_two_sided,
            "alpha": self.alpha,
            "passed": self.passed,
        }


def paired_compare(baseline: dict[int, bool], new: dict[int, bool], alpha: float) -> PairedResult:
    """Per-question correctness keyed by question id; both runs must have answered the same questions."""
    if set(baseline) != set(new):
        only_base, only_new = sorted(set(baseline) - set(new)), sorted(set(new) - set(baseline))
        raise ValueError(
            f"the runs answered different questions (only baseline: {only_base[:5]}, "
            f"only new: {only_new[:5]})"
        )
    cells = {(True, True): 0, (True, False): 0, (False, True): 0, (False, False): 0}
    for qid, base_right in baseline.items():
        cells[(base_right, new[qid])] += 1
    b, c = cells[(True, False)], cells[(False, True)]
    p_worse, p_two = mcnemar_exact(b, c)
    return PairedResult(
        n=len(baseline),
        both_right=cells[(True, True)],
        baseline_only=b,
        new_only=c,
        both_wrong=cells[(False, False)],
        p_worse=p_worse,
        p_two_sided=p_two,
        alpha=alpha,
    )
