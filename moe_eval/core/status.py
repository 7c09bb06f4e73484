"""Live status of one config, written by the process that runs it and read by the one that shows it.

The worker running a config (moe_eval.worker) rewrites `<config run dir>/status.json` atomically
when its stage changes and at most every WRITE_INTERVAL_SECONDS while lm-eval answers questions;
the scheduler (moe_eval.scheduler) reads every running config's file to draw one progress line per
config. Questions are scored on the fly with GSM8K's strict-match rule (the `#### <number>` of the
answer against the reference's) wherever the reference answers are known, so a user sees the
accuracy so far; the verdict still comes from lm-eval's own scoring. Usage:

    status = StatusWriter(run_dir / "status.json", config="configs/x.yaml", total=200)
    status.stage("evaluating")
    status.answered(prompt, text)
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moe_eval.core.results import atomic_write_text


def progress_line(message: str) -> str:
    """One progress line on stderr, the same from the CLI and from a config's worker process."""
    return f"[moe-eval {time.strftime('%H:%M:%S')}] {message}"


STATUS_FILE = "status.json"
WRITE_INTERVAL_SECONDS = 0.5
# lm-eval's gsm8k strict-match: the number after "#### ", then its exact_match ignores "," "$" and a final
# ".".
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_QUESTION = re.compile(r"Question: (.*?)\nAnswer:", re.DOTALL)


def _normalized(number: str) -> str:
    return re.sub(r"[,$]", "", number).rstrip(".")


def reference_answers(rows: list[dict[str, Any]]) -> dict[str, str]:
    """question text -> normalized reference number, from GSM8K-format rows."""
    found = {}
    for row in rows:
        match = _STRICT.search(row.get("answer", ""))
        if match:
            found[row["question"].strip()] = _normalized(match[1])
    return found


@dataclass
class Status:
    config: str
    stage: str = "queued"
    stage_started_at: float = field(default_factory=time.time)
    started_at: float = field(default_factory=time.time)
    total: int = 0  # questions to answer
    answered: int = 0
    scored: int = 0  # answered questions whose reference is known
    correct: int = 0  # strict-match right among the scored
    devices: list[int] | None = None
    attempt: int = 1
    updated_at: float = field(default_factory=time.time)
    first_answer_at: float | None = None  # the pace is measured from here: lm-eval's set-up comes before

    @property
    def accuracy_so_far(self) -> float | None:
        return self.correct / self.scored if self.scored else None

    def eta_seconds(self, now: float) -> float | None:
        """Remaining evaluation time at the pace since the first answer (None before two answers)."""
        if self.stage != "evaluating" or self.first_answer_at is None or self.answered < 2 or not self.total:
            return None
        rate = (self.answered - 1) / max(now - self.first_answer_at, 1e-6)
        return max(self.total - self.answered, 0) / rate


class StatusWriter:
    def __init__(
        self,
        path: Path,
        *,
        config: str,
        total: int,
        devices: list[int] | None = None,
        attempt: int = 1,
        references: dict[str, str] | None = None,
    ) -> None:
        self.path = path
        self.status = Status(config=config, total=total, devices=devices, attempt=attempt)
        self.references = references or {}
        self._lock = threading.Lock()
        self._written_at = 0.0
        self.write()

    def stage(self, name: str) -> None:
        with self._lock:
            self.status.stage = name
            self.status.stage_started_at = time.time()
        self.write()

    def answered(self, prompt: str, text: str) -> None:
        """One question answered (lm-eval may call this from its request tasks)."""
        with self._lock:
            self.status.answered += 1
            if self.status.first_answer_at is None:
                self.status.first_answer_at = time.time()
            question = _QUESTION.findall(prompt)
            reference = self.references.get(question[-1].strip()) if question else None
            if reference is not None:
                self.status.scored += 1
                got = _STRICT.search(text)
                self.status.correct += bool(got and _normalized(got[1]) == reference)
        if time.monotonic() - self._written_at >= WRITE_INTERVAL_SECONDS:
            self.write()

    def write(self) -> None:
        with self._lock:
            self.status.updated_at = time.time()
            text = json.dumps(asdict(self.status))
            self._written_at = time.monotonic()
        atomic_write_text(self.path, text)


def read_status(path: Path) -> Status | None:
    try:
        return Status(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
