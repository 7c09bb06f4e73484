"""The accuracy gate.

vLLM's rule: pass iff strict-match accuracy >= threshold - tolerance. With `stderr_gate_k` set,
also accuracy >= threshold - k * stderr: at 1319 questions and accuracy near 0.88 the stderr is
about 0.009, so the tolerance of 0.08 is about nine standard errors and only catches breakage,
while k = 3 catches a 3-point regression. The effective floor is the stricter of the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GateResult:
    accuracy: float
    stderr: float
    threshold: float
    tolerance: float
    stderr_k: float | None = None

    @property
    def tolerance_floor(self) -> float:
        return self.threshold - self.tolerance

    @property
    def stderr_floor(self) -> float | None:
        if self.stderr_k is None or self.stderr is None or math.isnan(self.stderr):
            return None
        return self.threshold - self.stderr_k * self.stderr

    @property
    def floor(self) -> float:
        floors = [self.tolerance_floor] + ([self.stderr_floor] if self.stderr_floor is not None else [])
        return max(floors)

    @property
    def passed(self) -> bool:
        # Rounded so that an accuracy printed equal to the floor never fails on float noise.
        return round(self.accuracy - self.floor, 12) >= 0

    @property
    def margin(self) -> float:
        return self.accuracy - self.floor

    @property
    def margin_in_stderr(self) -> float | None:
        """How many standard errors above (+) or below (-) the floor; None when stderr is 0 or unknown."""
        if self.stderr is None or math.isnan(self.stderr) or self.stderr <= 0:
            return None
        return self.margin / self.stderr

    def describe(self) -> str:
        sigma = self.margin_in_stderr
        sigma_text = "n/a" if sigma is None else f"{sigma:+.1f} stderr"
        verdict = "PASS" if self.passed else "FAIL"
        rule = f"threshold {self.threshold:.4f} - tolerance {self.tolerance:.4f}"
        if self.stderr_floor is not None:
            rule += f"; threshold - {self.stderr_k:g} x stderr = {self.stderr_floor:.4f}"
        return (
            f"{verdict}: accuracy {self.accuracy:.4f} vs floor {self.floor:.4f} ({rule}); "
            f"margin {self.margin:+.4f}, {sigma_text}"
        )

    def as_dict(self) -> dict:
        return {
            "metric": "exact_match,strict-match",
            "accuracy": self.accuracy,
            "stderr": self.stderr,
            "threshold": self.threshold,
            "tolerance": self.tolerance,
            "tolerance_floor": self.tolerance_floor,
            "stderr_k": self.stderr_k,
            "stderr_floor": self.stderr_floor,
            "floor": self.floor,
            "margin": self.margin,
            "margin_in_stderr": self.margin_in_stderr,
            "passed": self.passed,
        }
