"""The layer check's estimates on pooled sums: a direction's scale, its standard errors, its degrees of
freedom, the t threshold they give, and the smallest error it resolves (moe_eval.gates.layer_gate judges
them; core/layer_cells.CELL_FIELDS defines the sums).

The degrees of freedom. A cell's variance estimate is a sum of one-term squares (each element's
y~^2 diff^2); where a few elements carry it (a trained model's outlier dimensions, a handful of slots) it is
a draw of few degrees of freedom and can read several times too small: the CPU canary's correct kernel had
a 9-slot cell at z = 4.5 against the incumbent. Kish's effective count nu = (sum v)^2 / sum v^2 measures
that concentration (it counts one-degree terms of equal weight exactly, and undercounts Gaussian terms up
to 3x: conservative), and the cell's threshold is the t quantile at nu: 12.4 at nu = 9, 6.3 at 30, 5.2 at
200 for z = 5. So the old fixed floor of 20 slots is gone: a thin cell is judged when its own numbers
say it can be, and counted as unjudged when they say it cannot.

The t quantile is capped by a bound that holds whatever the tails. z is a self-normalized sum:
(a - a_inc) / sqrt(vd) = sum X / sqrt(sum X^2) over the elements' terms X = y~ diff. Where each term is
symmetric about zero given its size (two correct kernels' rounding differences; their systematic part is
what the magnitude rule below handles), Hoeffding's inequality over the terms' signs gives
P(|z| >= x) <= 2 exp(-x^2 / 2) for any distribution of the sizes (Efron 1969; de la Pena 1999): x = 5.49 at
z = 5's tail. So the threshold is min(t(nu), 5.49) at z = 5: few degrees of freedom cannot push it higher.
Without the cap the trained GPU canary's cells, whose variance sits in a few outlier elements (nu 2-10 over
hundreds of slots), read t in the hundreds at nu ~ 1: on the full canary pair (H200, 2026-12-03) 17 of 56
cells with thousands of slots went unjudged and the correct row ended incomplete.

Beyond the incumbent, in magnitude. Two correct kernels round differently, and in a cell where the expert's
own part of the output is thin (its slot vector mostly explained by the row's other slots) that difference
projects to a large, real, reproducible scale: on the CPU canary's correct run, layer 0, vLLM's kernel read
s = -0.31 and the bundled one +0.36 in the same cell, 9 standard errors apart (15 of 187 cells were past
z = 5 on the signed difference). So a cell is off when |s| exceeds |s_incumbent| by t(dof) standard errors
of the difference, not when s differs from s_incumbent: a kernel's own rounding may take either sign, a bug
must be larger than the incumbent's rounding is. The power line (`detectable`) already asks a bug to exceed
|s_incumbent|; one of the opposite sign to the kernel's own rounding needs up to |s_incumbent| more, which
matters only where |s_incumbent| is near the power target (thin cells, mostly counted unjudged anyway).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moe_eval.gates.stats import normal_two_sided_p, student_t_quantile

POWER_Z = 0.8416  # the normal quantile of 80 %: the power lines are "caught with 80 % probability"


class _Quantiles:
    """t quantiles of one two-sided tail for many degrees of freedom at once: exact on a log grid of nu,
    interpolated between (t falls smoothly with nu)."""

    def __init__(self, z: float) -> None:
        self.z = z
        self.grid = np.geomspace(0.5, 1e7, 240)
        p = normal_two_sided_p(z)
        self.values = np.array([student_t_quantile(p, nu) for nu in self.grid])

    def __call__(self, nu: np.ndarray) -> np.ndarray:
        nu = np.asarray(nu, dtype=float)
        out = np.interp(
            np.log(np.clip(nu, self.grid[0], self.grid[-1])), np.log(self.grid), np.log(self.values)
        )
        out = np.exp(out)
        out = np.where(nu >= self.grid[-1], self.z, out)
        return np.where(np.isfinite(nu) & (nu > 0), out, np.where(np.isinf(nu), self.z, np.inf))


_QUANTILES: dict[float, _Quantiles] = {}


def self_normalized_bound(z: float) -> float:
    """x with 2 exp(-x^2 / 2) equal to the two-sided normal tail beyond z: where the terms of z's sum are
    symmetric, |z| passes x no more often than a normal z passes z, whatever their tails."""
    p = max(normal_two_sided_p(z), 1e-300)  # erfc underflows to 0 past z ~ 38; the bound is above z
    return max(z, math.sqrt(2.0 * math.log(2.0 / p)))


def t_threshold(z: float, nu: np.ndarray) -> np.ndarray:
    """The t quantile of z's normal tail at nu degrees of freedom, capped by self_normalized_bound(z)."""
    if z not in _QUANTILES:
        _QUANTILES[z] = _Quantiles(z)
    t = _QUANTILES[z](nu)
    # Where nu says nothing can be judged (no variance terms: inf), the threshold stays infinite.
    return np.where(np.isfinite(t), np.minimum(t, self_normalized_bound(z)), t)


@dataclass
class Estimates:
    """A direction's estimate over any array of pooled sums (the last axis: a, b, vb, a_inc, vd, vd2)."""

    scale: np.ndarray
    stderr: np.ndarray
    incumbent: np.ndarray
    diff_stderr: np.ndarray
    dof: np.ndarray
    z: np.ndarray  # max(|scale| - |incumbent|, 0) / diff_stderr: how far beyond the incumbent's size
    threshold: np.ndarray  # the t quantile at dof
    detectable: np.ndarray  # d80: the smallest error caught with 80 % probability

    @classmethod
    def of(cls, sums: np.ndarray, bound: float, z: float) -> Estimates:
        a, b, vb, a_inc, vd, vd2 = (sums[..., i] for i in range(6))
        with np.errstate(divide="ignore", invalid="ignore"):
            has = b > 0
            scale = np.where(has, a / b, 0.0)
            stderr = np.where(has, np.sqrt(np.maximum(vb, 0)) / b, np.inf)
            incumbent = np.where(has, a_inc / b, 0.0)
            diff_stderr = np.where(has, np.sqrt(np.maximum(vd, 0)) / b, np.inf)
            dof = np.where(vd2 > 0, vd * vd / vd2, np.inf)
            gap = np.maximum(np.abs(scale) - np.abs(incumbent), 0.0)  # within the incumbent's: 0
            zs = np.where(gap == 0, 0.0, np.where(diff_stderr > 0, gap / diff_stderr, np.inf))
        threshold = t_threshold(z, dof)
        detectable = np.maximum.reduce(
            [
                (threshold + POWER_Z) * diff_stderr,
                bound + POWER_Z * stderr,
                np.abs(incumbent) + POWER_Z * diff_stderr,
            ]
        )
        detectable = np.where(has, detectable, np.inf)
        return cls(scale, stderr, incumbent, diff_stderr, dof, zs, threshold, detectable)

    def off(self, bound: float) -> np.ndarray:
        off: np.ndarray = (np.abs(self.scale) > bound) & (self.z >= self.threshold)
        return off
