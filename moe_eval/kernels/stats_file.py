"""A per-process statistics file that a background thread rewrites while vLLM serves.

The plugin's call counter and layer check keep their numbers in memory (host memory the device writes
into, on a GPU); `StatsFile` writes `snapshot()` to its path atomically at most every STATS_INTERVAL_SECONDS
and once more at exit, so the harness can read them while the server still runs and after it stops; after
each tick it marks when it copied them (core/flushes.py waits for that mark instead of sleeping blind).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe_eval.core.plugin_protocol import FLUSHED_SUFFIX, STATS_INTERVAL_SECONDS


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_json(path: Path, record: Any) -> None:
    _write_text(path, json.dumps(record))


class StatsFile:
    """`write(path, record)` writes atomically (JSON by default); `same(a, b)` says two snapshots need no
    rewrite (equality by default); `before_flush()` runs first at every flush (the flusher's tick: where a
    process follows what the harness asks of it through files beside its own)."""

    def __init__(
        self,
        path: Path | None,
        snapshot: Callable[[], Any],
        name: str,
        write: Callable[[Path, Any], None] = _write_json,
        same: Callable[[Any, Any], bool] = lambda a, b: a == b,
        before_flush: Callable[[], None] | None = None,
    ) -> None:
        self.path = path
        self.snapshot = snapshot
        self.name = name  # the flusher thread's name
        self.write = write
        self.same = same
        self.before_flush = before_flush
        self._lock = threading.Lock()
        self._last_written: Any = None
        self._flusher: threading.Thread | None = None

    def flush(self) -> None:
        if self.path is None:
            return
        with self._lock:
            # Before the tick's work: every call that finished before it is in the copy, and the pause file
            # as it stood then has been followed.
            copied_at = time.time()
            if self.before_flush is not None:
                self.before_flush()
            record = self.snapshot()
            if self._last_written is None or not self.same(record, self._last_written):
                self.write(self.path, record)
                self._last_written = record
            # After the file: a reader that finds the mark later than its moment finds the file up to date.
            _write_text(Path(f"{self.path}{FLUSHED_SUFFIX}"), repr(copied_at))

    def start(self) -> None:
        """Start the flusher once (a no-op after the first call, or without a path)."""
        if self._flusher is not None or self.path is None:
            return
        stop = threading.Event()

        def loop() -> None:
            failures: set[str] = set()
            while not stop.wait(STATS_INTERVAL_SECONDS):
                try:
                    self.flush()
                except Exception as exc:  # noqa: BLE001  one bad tick must not end the process's record
                    kind = f"{type(exc).__name__}: {exc}"[:300]
                    if kind not in failures:  # each kind of failure said once, in the server's log
                        failures.add(kind)
                        print(
                            f"{self.name}: a flush failed, the next tick tries again: {kind}", file=sys.stderr
                        )

        self._flusher = threading.Thread(target=loop, name=self.name, daemon=True)
        self._flusher.start()
        atexit.register(lambda: (stop.set(), self.flush()))
        self.flush()
