"""Run the selected configs, one worker process each, as many at once as `--jobs` and the devices allow.

Order: the largest configs (most devices) first, the list order breaking ties; a config whose
baseline config is in the same run waits for it. A config starts as soon as enough devices are
free and fewer than `jobs` run; each worker gets a disjoint device set and its own port. Results
are collected per config from its results.json, so the reports never depend on which config ended
first. A config that ended in an infrastructure error runs again with a fresh server while
`retries` allow (earlier attempts are kept under `<config dir>/attempts/<n>/`).

Cancel: the first SIGTERM or SIGINT stops new starts and is passed on to every worker (each tears
its server down and records "cancelled" by that signal); a second one is passed on too (workers
then SIGKILL their servers at once); a third SIGKILLs the workers (their servers' guards then end
the servers). If
this process is killed outright, every worker gets SIGTERM from the kernel (moe_eval.worker).
Usage:

    outcomes = Scheduler(planned, options).run()   # {list index: ConfigOutcome}
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from moe_eval.configs.config import EvalConfig
from moe_eval.configs.devices import DevicePool
from moe_eval.core.plugin_protocol import RUN_DIR_ENV
from moe_eval.core.record import RESULTS_FILE, Attempt, RunRecord
from moe_eval.core.status import STATUS_FILE, Status, read_status
from moe_eval.launch import free_port
from moe_eval.runner import ConfigOutcome, config_run_dir
from moe_eval.worker import JOB_FILE, LOG_FILE, Job

POLL_SECONDS = 0.25
ATTEMPTS_DIR = "attempts"


@dataclass(frozen=True)
class Planned:
    index: int  # position in the selection (the list order)
    config: EvalConfig
    units: int  # devices it needs
    depends_on: int | None = None  # index of a config that must finish first (its baseline)


@dataclass(frozen=True)
class SchedulerOptions:
    job: Job  # the fields every worker shares (config_path, devices, port, attempt are set per config)
    pool: DevicePool
    jobs: int | None  # None: as many as the devices allow
    retries: int = 0
    port_base: int | None = None


class SchedulerView(Protocol):
    """What the scheduler tells whoever shows progress (progress_view.ProgressView; tests record it)."""

    def note(self, text: str) -> None: ...

    def started(self, planned: Planned, devices: list[int] | None, attempt: int) -> None: ...

    def tick(self, running: list[tuple[Planned, list[int] | None, Status | None]]) -> None:
        """Every poll: each running config with its devices and its worker's last status (None: none yet)."""

    def finished(self, planned: Planned, outcome: ConfigOutcome) -> None: ...


@dataclass
class _Running:
    planned: Planned
    proc: subprocess.Popen
    devices: list[int] | None
    port: int
    attempt: int
    started: float = field(default_factory=time.monotonic)


class Scheduler:
    def __init__(self, planned: list[Planned], options: SchedulerOptions, view: SchedulerView) -> None:
        self.options = options
        self.view = view
        self.pending = sorted(planned, key=lambda p: (-p.units, p.index))
        # A dependency outside this list (kept by --resume) finished in an earlier run: never waited for.
        self.scheduled = {p.index for p in planned}
        self.attempt = {p.index: 1 for p in planned}
        self.history: dict[int, list[Attempt]] = {p.index: [] for p in planned}
        self.running: list[_Running] = []
        self.done: dict[int, ConfigOutcome] = {}
        self.free = list(options.pool.ids)
        self.signals: list[str] = []
        self._acted_on = 0

    # --- the loop ---

    def run(self) -> dict[int, ConfigOutcome]:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            while self.pending or self.running:
                self._pass_on_signals()
                if not self.signals:
                    self._start_what_fits()
                self._collect_finished()
                self.view.tick([(r.planned, r.devices, self._status(r)) for r in self.running])
                time.sleep(POLL_SECONDS)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self.done

    @property
    def cancelled_by(self) -> str | None:
        return self.signals[0] if self.signals else None

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signal.Signals(signum).name)

    def _pass_on_signals(self) -> None:
        while self._acted_on < len(self.signals):
            self._acted_on += 1
            if self._acted_on == 1:
                self.view.note(
                    f"{self.signals[0]}: cancelling; no new config starts, running servers are torn down"
                )
                self.pending.clear()
            # The same signal, so that the record says what the user or CI sent.
            sig = signal.SIGKILL if self._acted_on >= 3 else signal.Signals[self.signals[self._acted_on - 1]]
            for run in self.running:
                os.kill(run.proc.pid, sig)

    # --- starting ---

    def _limit(self) -> int:
        return self.options.jobs if self.options.jobs is not None else len(self.options.pool.ids) or 1

    def _start_what_fits(self) -> None:
        for planned in list(self.pending):
            if len(self.running) >= self._limit():
                return
            if planned.depends_on in self.scheduled and planned.depends_on not in self.done:
                continue
            share = self.options.jobs != 1  # jobs 1: the server may use the whole machine, as before --jobs
            if share and planned.units > len(self.free):
                continue
            devices = None
            if share:
                devices, self.free = self.free[: planned.units], self.free[planned.units :]
            self.pending.remove(planned)
            self._launch(planned, devices)

    def _launch(self, planned: Planned, devices: list[int] | None) -> None:
        config = planned.config
        run_dir = config_run_dir(Path(self.options.job.run_root), config)
        run_dir.mkdir(parents=True, exist_ok=True)
        attempt = self.attempt[planned.index]
        port = self._port(planned)
        job = Job(
            **{
                **self.options.job.__dict__,
                "config_path": str(config.path),
                "config_text": config.text,
                "devices": devices,
                "port": port,
                "attempt": attempt,
            }
        )
        job.write(run_dir / JOB_FILE)
        with (run_dir / LOG_FILE).open("ab") as log:
            # Own session: a terminal's Ctrl-C reaches this process only, which passes it on once.
            proc = subprocess.Popen(
                [sys.executable, "-m", "moe_eval.worker", str(run_dir / JOB_FILE)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, RUN_DIR_ENV: str(run_dir)},
                start_new_session=True,
            )
        self.running.append(_Running(planned, proc, devices, port, attempt))
        self.view.started(planned, devices, attempt)

    def _port(self, planned: Planned) -> int:
        if self.options.port_base is not None:
            return self.options.port_base + (planned.index if self.options.jobs != 1 else 0)
        taken = {r.port for r in self.running}
        while (port := free_port()) in taken:
            pass
        return port

    def _status(self, run: _Running) -> Status | None:
        return read_status(config_run_dir(Path(self.options.job.run_root), run.planned.config) / STATUS_FILE)

    # --- finishing ---

    def _collect_finished(self) -> None:
        for run in list(self.running):
            code = run.proc.poll()
            if code is None:
                continue
            self.running.remove(run)
            if run.devices is not None:
                self.free = sorted(self.free + run.devices)
            outcome = self._outcome(run, code)
            index = run.planned.index
            if outcome.status == "error" and run.attempt <= self.options.retries and not self.signals:
                self.history[index].append(self._archive(outcome, run.attempt))
                self.attempt[index] = run.attempt + 1
                self.view.note(
                    f"{run.planned.config.path}: attempt {run.attempt} ended in an infrastructure "
                    f"error; retrying with a fresh server ({run.attempt + 1} of {self.options.retries + 1})"
                )
                self.pending.append(run.planned)
                self.pending.sort(key=lambda p: (-p.units, p.index))
                continue
            if self.history[index]:
                outcome.attempts = self.history[index]
                self._record_attempts(outcome)
            self.done[index] = outcome
            self.view.finished(run.planned, outcome)

    def _outcome(self, run: _Running, code: int) -> ConfigOutcome:
        config = run.planned.config
        run_dir = config_run_dir(Path(self.options.job.run_root), config)
        record = RunRecord.read_if_any(run_dir / RESULTS_FILE)
        if record is None or record.attempt != run.attempt:
            why = "cancelled before it wrote results" if self.signals else f"worker exited with code {code}"
            return ConfigOutcome(
                config=config,
                run_dir=run_dir,
                status="cancelled" if self.signals else "error",
                error=f"{why}; see {run_dir / LOG_FILE}",
            )
        return ConfigOutcome.from_record(config, run_dir, record)

    def _archive(self, outcome: ConfigOutcome, attempt: int) -> Attempt:
        """Move an attempt's files into attempts/<n>/, so the next attempt starts clean and this one is
        kept."""
        target = outcome.run_dir / ATTEMPTS_DIR / str(attempt)
        move_run_files(outcome.run_dir, target)
        return Attempt(attempt, outcome.status, outcome.error, str(target.relative_to(outcome.run_dir)))

    def _record_attempts(self, outcome: ConfigOutcome) -> None:
        record = RunRecord.read_if_any(outcome.run_dir / RESULTS_FILE)
        if record is None:
            return
        record.bookkeeping.attempts = outcome.attempts
        record.write()


def move_run_files(run_dir: Path, target: Path) -> None:
    """Every file and folder of a config's run folder but the attempts/ folder itself, into `target`."""
    target.mkdir(parents=True, exist_ok=True)
    for entry in run_dir.iterdir():
        if entry.name != ATTEMPTS_DIR:
            shutil.move(str(entry), target / entry.name)
