"""A check and the verdict: what every gate yields, and the one rule that turns checks into a status."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from typing_extensions import NotRequired, TypedDict  # pydantic reads typing's TypedDict from 3.12 only

from moe_eval.core.evidence import Evidence, Status

PASSED, FAILED, INCOMPLETE = "passed", "failed", "incomplete"
# A config's end that is a verdict; "error" and "cancelled" are not. Incomplete: a gate the config calls
# for could not run (moe_eval.gates.registry), and the config did not declare it optional.
VERDICTS = (PASSED, FAILED, INCOMPLETE)
STATUSES = (*VERDICTS, "error", "cancelled")  # a config's end; the first three are verdicts

# A check's status (core/evidence.Status): passed / failed: it measured and judged. not_run: it is required
# and could not measure, or judged less than its gate's floor (the row is incomplete, exit 6). skipped: it
# is optional here and could not measure (shown as skipped, never as a pass).
CHECK_PASSED, CHECK_FAILED, CHECK_NOT_RUN, CHECK_SKIPPED = (s.value for s in Status)
CHECK_STATUSES = tuple(s.value for s in Status)


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    evidence: Evidence | None = None  # what it judged from (core/evidence.py), where the gate counts it

    @classmethod
    def judged(cls, name: str, ok: bool, detail: str, evidence: Evidence | None = None) -> Check:
        """A check that measured and judged: passed where `ok`, else failed."""
        return cls(name, Status.PASSED if ok else Status.FAILED, detail, evidence)

    @classmethod
    def not_run(cls, name: str, detail: str, evidence: Evidence | None = None) -> Check:
        """A check the config calls for that could not judge: in the way of a pass unless optional."""
        return cls(name, Status.NOT_RUN, detail, evidence)

    def skipped(self) -> Check:
        """This not-run check of a gate that is optional here: not in the way of a pass, never a pass."""
        detail = self.detail.removeprefix("not run: ").removeprefix("not run")
        return replace(self, status=Status.SKIPPED, detail="not run (optional here): " + detail.lstrip(": "))

    @property
    def passed(self) -> bool:
        """Did not stand in the way of a pass (a skipped check did not either)."""
        return self.status in (Status.PASSED, Status.SKIPPED)

    @property
    def ran(self) -> bool:
        """It measured and judged (passed or failed)."""
        return self.status in (Status.PASSED, Status.FAILED)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name, "passed": self.passed, "detail": self.detail, "status": self.status.value,
        }  # fmt: skip
        if not self.ran:
            out["ran"] = False
        if self.evidence is not None:
            out["evidence"] = self.evidence.as_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Check:
        """A check as results.json holds it; records before the status key say passed and ran."""
        if "status" in d:
            status = Status(d["status"])
        elif d.get("ran", True):
            status = Status.PASSED if d["passed"] else Status.FAILED
        else:
            status = Status.SKIPPED if d["passed"] else Status.NOT_RUN
        evidence = Evidence.from_dict(d["evidence"]) if d.get("evidence") else None
        return cls(d["name"], status, d.get("detail", ""), evidence)


def verdict(checks: list[Check]) -> str:
    """A finished config's verdict from its checks, and nothing else: failed when a check that ran failed;
    else incomplete when a required check could not run, or no check ran at all (what was skipped proves
    nothing); else passed."""
    if any(c.status is Status.FAILED for c in checks):
        return FAILED
    if not any(c.ran for c in checks) or any(c.status is Status.NOT_RUN for c in checks):
        return INCOMPLETE
    return PASSED


class CheckRecord(TypedDict):
    """A check as results.json and summary.json write it (Check.as_dict): the schema's."""

    name: str
    """the check's name, e.g. accuracy_gate, golden_gate_decode, <gate>_not_run"""
    passed: bool
    """did not stand in the way of a pass (a skipped check did not either)"""
    detail: str
    """its numbers and rule, as the table prints them"""
    status: NotRequired[Literal["passed", "failed", "not_run", "skipped"]]
    """passed, failed, not_run (required, could not judge, or judged under its floor), skipped (optional);
    absent in older records"""
    ran: NotRequired[Literal[False]]
    """present only for a check that did not judge"""
    evidence: NotRequired[Evidence]
    """what it judged from, where its gate counts it (absent before schema 9)"""
