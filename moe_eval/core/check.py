"""A check and the verdict: what every gate yields, and the one rule that turns checks into a status."""

from __future__ import annotations

from dataclasses import dataclass

PASSED, FAILED, INCOMPLETE = "passed", "failed", "incomplete"
# A config's end that is a verdict; "error" and "cancelled" are not. Incomplete: a gate the config calls
# for could not run (moe_eval.gates.table), and the config did not declare it optional.
VERDICTS = (PASSED, FAILED, INCOMPLETE)
STATUSES = (*VERDICTS, "error", "cancelled")  # a config's end; the first three are verdicts


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str
    ran: bool = True  # False: a gate the config calls for could not run ("<gate>_not_run", moe_eval.gates)

    def as_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "detail": self.detail} | (
            {} if self.ran else {"ran": False}
        )

    @classmethod
    def from_dict(cls, d: dict) -> Check:
        return cls(d["name"], d["passed"], d.get("detail", ""), d.get("ran", True))


def verdict(checks: list[Check]) -> str:
    """A finished config's verdict from its checks, and nothing else: failed when a check that ran failed;
    else incomplete when a gate that is not optional could not run, or nothing was judged at all; else
    passed."""
    if any(c.ran and not c.passed for c in checks):
        return FAILED
    if not checks or any(not c.passed for c in checks):
        return INCOMPLETE
    return PASSED
