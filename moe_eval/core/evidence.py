"""What a check judged from: the units it judged of those it was given, and what it could have caught.

Every gate counts its evidence the same way, so that a reader (the table, JUnit, the step summary, compare)
can tell a pass on thin evidence from a pass on all of it: the speed gate counts dispatch ranges, the layer
check (range, expert) cells, the accuracy gate questions.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any

from moe_eval.core.payload import described


class Status(enum.StrEnum):
    """A check's end: it judged (passed, failed), or it could not (not_run: required; skipped: optional)."""

    PASSED = "passed"
    FAILED = "failed"
    NOT_RUN = "not_run"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class Evidence:
    unit: str = described('what one unit is: "dispatch range", "(range, expert) cell", "question", "text"')
    judged: int = described("units the check judged")
    total: int = described("units it was given (judged or named not judged)")
    required: int | None = described(
        "the units a pass needs (the gate's floor, applied by the judge); null: one judged unit", None
    )
    would_catch: str | None = described(
        "the smallest effect it fails with 80 % probability, in the gate's own terms (x1.04 in its least "
        "sensitive range, a 1.0 % one-expert error, an accuracy drop of 0.013); null: it cannot say",
        None,
    )

    def describe(self) -> str:
        """'6/7 dispatch ranges judged; would catch x1.04 ...'"""
        text = f"{self.judged}/{self.total} {self.unit}s judged"
        if self.required is not None and self.judged < self.required:
            text += f" ({self.required} needed)"
        if self.would_catch:
            text += f"; would catch {self.would_catch}"
        return text

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Evidence:
        return cls(
            **{k: data[k] for k in ("unit", "judged", "total", "required", "would_catch") if k in data}
        )
