"""The accuracy gate: pass iff strict-match accuracy >= threshold - tolerance (vLLM's rule)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GateResult:
    accuracy: float
    stderr: float
    threshold: float
    tolerance: float

    @property
    def floor(self) -> float:
        return self.threshold - self.tolerance

    @property
    def passed(self) -> bool:
        # Rounded so that an accuracy printed equal to the floor never fails on float noise.
        return round(self.accuracy - self.floor, 12) >= 0

    @property
    def margin(self) -> float:
        return self.accuracy - self.floor

    @property
    def margin_in_stderr(self) -> float | None:
        """How many standard errors above (+) or below (-) the floor; None when stderr is 0."""
        if self.stderr <= 0 or math.isnan(self.stderr):
            return None
        return self.margin / self.stderr

    def describe(self) -> str:
        sigma = self.margin_in_stderr
        sigma_text = "n/a" if sigma is None else f"{sigma:+.1f} stderr"
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{verdict}: accuracy {self.accuracy:.4f} vs floor {self.floor:.4f} "
                f"(threshold {self.threshold:.4f} - tolerance {self.tolerance:.4f}); margin {self.margin:+.4f}, "
                f"{sigma_text}")

    def as_dict(self) -> dict:
        return {"metric": "exact_match,strict-match", "accuracy": self.accuracy, "stderr": self.stderr,
                "threshold": self.threshold, "tolerance": self.tolerance, "floor": self.floor,
                "margin": self.margin, "margin_in_stderr": self.margin_in_stderr, "passed": self.passed}
