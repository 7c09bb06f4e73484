"""A check and the verdict: what every gate yields, and the one rule that turns checks into a status."""

from __future__ import annotations

from dataclasses import dataclass

from moe_eval.core.evidence import Evidence

PASSED, FAILED, INCOMPLETE = "passed", "failed", "incomplete"
# A config's end that is a verdict; "error" and "cancelled" are not. Incomplete: a gate the config calls
# for could not run (moe_eval.gates.table), and the config did not declare it optional.
VERDICTS = (PASSED, FAILED, INCOMPLETE)
STATUSES = (*VERDICTS, "error", "cancelled")  # a config's end; the first three are verdicts

# One status per check. passed / failed: it measured and judged. not_run: it is required and could not
# measure (the row is incomplete, exit 6). skipped: it is optional here and could not measure (shown as
# skipped, never as a pass).
CHECK_PASSED, CHECK_FAILED, CHECK_NOT_RUN, CHECK_SKIPPED = "passed", "failed", "not_run", "skipped"
CHECK_STATUSES = (CHECK_PASSED, CHECK_FAILED, CHECK_NOT_RUN, CHECK_SKIPPED)


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool  # did not stand in the way of a pass (a skipped check did not either)
    detail: str
    ran: bool = True  # False: a check the config calls for could not measure (moe_eval.gates)
    evidence: Evidence | None = None  # what it judged from (core/evidence.py), where the gate counts it

    @property
    def status(self) -> str:
        if self.ran:
            return CHECK_PASSED if self.passed else CHECK_FAILED
        return CHECK_SKIPPED if self.passed else CHECK_NOT_RUN

    def as_dict(self) -> dict:
        out = {"name": self.name, "passed": self.passed, "detail": self.detail, "status": self.status}
        if not self.ran:
            out["ran"] = False
        if self.evidence is not None:
            out["evidence"] = self.evidence.as_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Check:
        evidence = Evidence.from_dict(d["evidence"]) if d.get("evidence") else None
        return cls(d["name"], d["passed"], d.get("detail", ""), d.get("ran", True), evidence)


def verdict(checks: list[Check]) -> str:
    """A finished config's verdict from its checks, and nothing else: failed when a check that ran failed;
    else incomplete when a required check could not run, or no check ran at all (what was skipped proves
    nothing); else passed."""
    if any(c.status == CHECK_FAILED for c in checks):
        return FAILED
    if not any(c.ran for c in checks) or any(c.status == CHECK_NOT_RUN for c in checks):
        return INCOMPLETE
    return PASSED
