"""Statistics for the gates: the standard error of an accuracy, the exact McNemar test, and the accuracy
gate's power (the smallest drop it catches).

The paired test asks "did this kernel change answers?": over the questions both runs answered,
b = baseline right and new wrong, c = baseline wrong and new right. Under "no change" each
discordant question is a fair coin, so b ~ Binomial(b + c, 1/2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def accuracy_stderr(correct: int, n: int) -> float:
    """Sample standard deviation of 0/1 outcomes over sqrt(n), as lm-eval's mean_stderr computes it."""
    if n < 2:
        return float("nan")
    p = correct / n
    return math.sqrt(p * (1 - p) * n / (n - 1) / n)


def _binom_cdf(m: int, n: int, p: float) -> float:
    """P(X <= m), X ~ Binomial(n, p), exact up to float rounding: log-space terms via lgamma."""
    if m < 0:
        return 0.0
    if m >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    log_p, log_q, log_n_fact = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    terms = [
        log_n_fact - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
        for i in range(m + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * math.fsum(math.exp(t - top) for t in terms))


def mcnemar_exact(b: int, c: int) -> tuple[float, float]:
    """(p one-sided for 'new is worse', p two-sided) for b = base-only right, c = new-only right."""
    n = b + c
    if n == 0:
        return 1.0, 1.0
    # P(X >= k) for X ~ Binomial(n, 1/2) is P(X <= n - k) by symmetry: the lower tail, no 1 - x rounding.
    p_worse = _binom_cdf(n - b, n, 0.5)
    p_two = min(1.0, 2 * _binom_cdf(n - max(b, c), n, 0.5))
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
            f"{verdict}: paired vs the incumbent on {self.n} questions: {self.baseline_only} flipped "
            f"right->wrong, {self.new_only} wrong->right; exact McNemar p(worse) = {self.p_worse:.4g} "
            f"(alpha {self.alpha:g})"
        )

    def as_dict(self) -> dict[str, Any]:
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
            f"the runs answered different questions (only the incumbent: {only_base[:5]}, "
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


# --- the accuracy gate's power -----------------------------------------------------------------


def _min_passing_correct(n: int, floor: float) -> int:
    """Smallest correct count k with k / n passing the gate, by gate.GateResult.passed's own rule."""
    k = max(0, min(n, math.ceil(floor * n)))
    while k > 0 and round((k - 1) / n - floor, 12) >= 0:
        k -= 1
    while k <= n and round(k / n - floor, 12) < 0:
        k += 1
    return k  # n + 1 when not even a perfect run passes


def gate_fail_probability(n: int, true_accuracy: float, floor: float) -> float:
    """P(a run of n independent questions, each right with probability true_accuracy, fails the gate)."""
    return _binom_cdf(_min_passing_correct(n, floor) - 1, n, true_accuracy)


def detectable_drop(n: int, accuracy: float, floor: float, power: float = 0.8) -> float:
    """The smallest drop Δ of true accuracy below `accuracy` that the gate catches with probability
    >= `power`: a run of n questions at true accuracy accuracy - Δ ends below `floor` that often.

    Model: the n questions are independent, each answered right with the same probability (the true
    accuracy); the run passes when its observed accuracy is >= floor (GateResult's rule). The
    failure probability falls as the true accuracy rises, so bisection on it finds the boundary.
    Returns 0.0 when even a run at `accuracy` fails that often, inf when no run can fail (floor <= 0).
    """
    if n < 1 or not 0.0 < power < 1.0 or not 0.0 <= accuracy <= 1.0:
        raise ValueError(
            f"need n >= 1, 0 < power < 1, 0 <= accuracy <= 1 (n={n}, power={power}, accuracy={accuracy})"
        )
    k_pass = _min_passing_correct(n, floor)
    if k_pass == 0:
        return math.inf
    if _binom_cdf(k_pass - 1, n, accuracy) >= power:
        return 0.0
    lo, hi = 0.0, accuracy  # fail probability >= power at lo (1 at p = 0), < power at hi
    for _ in range(60):
        mid = (lo + hi) / 2
        if _binom_cdf(k_pass - 1, n, mid) >= power:
            lo = mid
        else:
            hi = mid
    return accuracy - lo


def describe_power(n: int, accuracy: float, floor: float, power: float = 0.8) -> str:
    drop = detectable_drop(n, accuracy, floor, power)
    if math.isinf(drop):
        return f"at n={n} the gate (floor {floor:.4f}) cannot fail"
    return (
        f"at n={n} the gate (floor {floor:.4f}) catches a drop of >= {drop:.3f} from {accuracy:.3f} "
        f"with {power:.0%} probability"
    )


def student_t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with df degrees of freedom: I_x(df/2, 1/2) / 2 with x = df / (df + t^2),
    the regularized incomplete beta by its continued fraction (Numerical Recipes' betacf, Lentz's method).
    Written out so the gate needs no SciPy on the GPU image; tests check it against SciPy."""
    if t == 0.0:
        return 0.5
    x = df / (df + t * t)
    a, b = df / 2.0, 0.5
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1) / (a + b + 2):
        tail = front * _beta_cf(a, b, x) / a
    else:
        tail = 1.0 - front * _beta_cf(b, a, 1.0 - x) / b
    return tail / 2 if t > 0 else 1.0 - tail / 2


def _beta_cf(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def normal_two_sided_p(z: float) -> float:
    """P(|Z| > z) for a standard normal Z."""
    return math.erfc(z / math.sqrt(2.0))


def student_t_quantile(p_two_sided: float, df: float) -> float:
    """t with P(|T| > t) = p_two_sided for Student's t with df (> 0, not necessarily whole) degrees of
    freedom: bisection on student_t_sf (monotone), to 1e-9 relative."""
    target = p_two_sided / 2
    low, high = 0.0, 1.0
    while student_t_sf(high, df) > target:
        high *= 2
        if high > 1e300:
            return math.inf
    for _ in range(200):
        mid = (low + high) / 2
        if student_t_sf(mid, df) > target:
            low = mid
        else:
            high = mid
        if high - low <= 1e-9 * high:
            break
    return high
