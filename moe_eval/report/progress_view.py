"""Progress on stderr while configs run: one live line per running config on a terminal, plain lines in CI.

Each running config shows its devices, its stage and, while lm-eval answers, questions answered of
the total, strict-match so far, time in the stage and an estimate of the rest:

    Canary-Qwen3-MoE-BF16-torch [cpu 0] evaluating 120/200 strict-match 1.000 so far, 14 s, ETA 9 s

On a terminal (rich) those lines are redrawn in place; elsewhere a line is printed when a config's
stage changes and every PLAIN_INTERVAL_SECONDS while it evaluates. Stdout stays for results.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from moe_eval.core.check import STATUSES
from moe_eval.core.status import Status, progress_line

PLAIN_INTERVAL_SECONDS = 30.0


def describe(name: str, devices: list[int] | None, kind: str, status: Status | None, now: float) -> str:
    where = f" [{kind} {','.join(map(str, devices))}]" if devices is not None else ""
    if status is None:
        return f"{name}{where} starting"
    line = f"{name}{where} {status.stage}"
    if status.stage == "evaluating" and status.total:
        line += f" {status.answered}/{status.total}"
        if status.accuracy_so_far is not None:
            line += f" strict-match {status.accuracy_so_far:.3f} so far"
        line += f", {now - status.stage_started_at:.0f} s"
        eta = status.eta_seconds(now)
        if eta is not None:
            line += f", ETA {eta:.0f} s"
    elif status.stage not in ("queued",):
        line += f" ({now - status.stage_started_at:.0f} s)"
    return line


class ProgressView:
    """What the scheduler calls: started / tick / finished / note; `close()` at the end."""

    def __init__(
        self,
        total: int,
        device_kind: str,
        live: bool | None = None,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        self.total = total
        self.kind = device_kind
        self.live = sys.stderr.isatty() if live is None else live
        self.echo = echo or (lambda text: print(text, file=sys.stderr, flush=True))
        self.finished_count = 0
        self._last_plain: dict[int, tuple[str, float]] = {}
        self._live = None
        if self.live:
            from rich.console import Console
            from rich.live import Live

            self._console = Console(stderr=True)
            self._live = Live(console=self._console, refresh_per_second=4, transient=True)
            self._live.start()

    def _print(self, text: str) -> None:
        line = progress_line(text)
        if self._live is not None:
            self._console.print(line, highlight=False, markup=False)
        else:
            self.echo(line)

    def note(self, text: str) -> None:
        self._print(text)

    def started(self, planned, devices: list[int] | None, attempt: int) -> None:
        where = f" on {self.kind} {','.join(map(str, devices))}" if devices is not None else ""
        again = f" (attempt {attempt})" if attempt > 1 else ""
        self._print(
            f"[{planned.index + 1}/{self.total}] {planned.config.path}{where}{again}: "
            f"{planned.config.layout.describe()}, {planned.config.num_questions} questions"
        )

    def tick(self, running: list) -> None:
        now = time.time()
        lines = [describe(p.config.name, devices, self.kind, status, now) for p, devices, status in running]
        if self._live is not None:
            from rich.text import Text

            self._live.update(Text("\n".join(lines)))
            return
        for (planned, _, status), line in zip(running, lines, strict=True):
            if status is None or status.stage in STATUSES:  # not begun yet, or finished() says it
                continue
            stage = status.stage
            last = self._last_plain.get(planned.index)
            if (
                last is None
                or last[0] != stage
                or (stage == "evaluating" and now - last[1] >= PLAIN_INTERVAL_SECONDS)
            ):
                self._last_plain[planned.index] = (stage, now)
                self._print(line)

    def finished(self, planned, outcome) -> None:
        self.finished_count += 1
        verdict = {
            "passed": "PASS",
            "failed": "FAIL",
            "incomplete": "INCOMPLETE",
            "error": "ERROR",
            "cancelled": "CANCELLED",
        }[outcome.status]
        seconds = outcome.timings.get("total_seconds")
        took = f" in {seconds:.0f} s" if seconds is not None else ""
        self._print(f"[{planned.index + 1}/{self.total}] {planned.config.name}: {verdict}{took}")
        if outcome.error:
            self._print(f"  {outcome.error}")
        for check in outcome.checks:
            self._print(f"  {check.name}: {check.detail}")

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
