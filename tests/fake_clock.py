"""A clock for tests of code that polls: `monotonic` and `sleep` where each sleep advances the clock and
runs `on_sleep(n)` (a server process's flusher writing between two looks)."""

from __future__ import annotations

from collections.abc import Callable


class FakeClock:
    def __init__(self, on_sleep: Callable[[int], object] | None = None, start: float = 1000.0) -> None:
        self.now, self.sleeps, self.on_sleep = start, 0, on_sleep

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1
        if self.on_sleep is not None:
            self.on_sleep(self.sleeps)
