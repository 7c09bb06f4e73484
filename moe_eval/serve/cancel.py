"""Cancellation of a run by SIGTERM (what CI systems send on cancel) or SIGINT (Ctrl-C).

The first signal raises `Cancelled` (a KeyboardInterrupt, so that libraries which let Ctrl-C
through, lm-eval's request loop among them, let it through too) wherever the main thread is.
While a server is being torn down (`teardown()`), signals do not raise: the first one only marks
the run cancelled, and any further one runs the escalation hooks (SIGKILL of the server's group)
at once, so a second Ctrl-C never waits for the grace period. Usage:

    install()                        # once, in the main thread of a process
    with teardown(lambda: killpg(pgid, SIGKILL)):
        graceful_stop()
    raise_if_cancelled()             # after a teardown that a signal interrupted
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

EXIT_CANCELLED = 130  # the shell's code for a process ended by SIGINT; CI systems read it as "cancelled"


class Cancelled(KeyboardInterrupt):
    """The run was cancelled by a signal; `signal_name` says which."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


@dataclass
class _State:
    signals: list[str] = field(default_factory=list)  # names, in the order they came
    teardown_depth: int = 0
    escalations: list[Callable[[], None]] = field(default_factory=list)

    @property
    def cancelled_by(self) -> str | None:
        return self.signals[0] if self.signals else None


STATE = _State()


def _on_signal(signum: int, frame: object) -> None:
    name = signal.Signals(signum).name
    STATE.signals.append(name)
    if STATE.teardown_depth > 0:
        if len(STATE.signals) >= 2:  # a second signal: no more grace
            for hook in list(STATE.escalations):
                hook()
        return
    raise Cancelled(name)


def install() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)


def cancelled_by() -> str | None:
    return STATE.cancelled_by


def raise_if_cancelled() -> None:
    if STATE.cancelled_by is not None:
        raise Cancelled(STATE.cancelled_by)


@contextlib.contextmanager
def teardown(escalate: Callable[[], None]) -> Iterator[None]:
    """Signals inside do not interrupt; a second signal of the run calls `escalate` right away."""
    STATE.teardown_depth += 1
    STATE.escalations.append(escalate)
    try:
        if len(STATE.signals) >= 2:
            escalate()
        yield
    finally:
        STATE.escalations.remove(escalate)
        STATE.teardown_depth -= 1
