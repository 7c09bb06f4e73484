"""Waiting for the plugin's flushers instead of sleeping blind.

Each statistics file a server process keeps (the call counter's, the layer check's: kernels/stats_file.py)
is rewritten by a thread at most every STATS_INTERVAL_SECONDS; after each tick the thread writes beside it
`<file><FLUSHED_SUFFIX>`, the wall time taken before it copied its numbers. A reader that wants every call
that finished before now waits until each live process's mark is later than now: half an interval on
average, where two intervals were slept blind before.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from moe_eval.core.plugin_protocol import FLUSHED_SUFFIX, STATS_INTERVAL_SECONDS
from moe_eval.core.proc_stat import stat_fields

# How long a live process's flusher may lag before the files are read as they stand (a loaded 2-core machine
# delays a thread's tick by a second or more; a process that never marks, such as one from before the mark,
# costs this once).
FLUSH_WAIT_SECONDS = 10 * STATS_INTERVAL_SECONDS


def flushed_at(path: Path) -> float | None:
    """When the process behind `path` last copied its numbers (None: no mark, or one that does not parse)."""
    try:
        return float(Path(f"{path}{FLUSHED_SUFFIX}").read_text())
    except (OSError, ValueError):
        return None


def pid_of(path: Path) -> int | None:
    """The process a statistics file belongs to: its name's leading number (`<pid>.json`, `<pid>-1.npz`)."""
    head = path.name.split(".")[0].split("-")[0]
    return int(head) if head.isdigit() else None


def alive(pid: int | None) -> bool:
    """Whether the process still runs on this machine (one that ended flushed for the last time at exit: its
    file is final). A zombie (ended, not yet reaped by its parent) has ended. A file named for no pid is taken
    as live."""
    if pid is None:
        return True
    try:
        fields = stat_fields(pid)
        return fields is not None and fields[0] != "Z"
    except (OSError, IndexError):  # no /proc here, or a stat that does not parse: ask the kernel
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # runs, under another user
        return True
    return True


def wait_for_flushes(
    folders: dict[Path, str],
    *,
    mark: float | None = None,
    timeout: float = FLUSH_WAIT_SECONDS,
    is_alive: Callable[[int | None], bool] = alive,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    wall: Callable[[], float] = time.time,
) -> list[Path]:
    """Wait until every live process's file in `folders` (folder: the glob pattern of its files) was copied
    after `mark` (default: now, wall clock), or `timeout` passed; returns the files still behind (empty: every
    one caught up). A folder without such files (a row whose plugin stayed out) returns at once."""
    mark = wall() if mark is None else mark
    started = clock()
    while True:
        behind = [
            path
            for folder, pattern in folders.items()
            for path in (sorted(folder.glob(pattern)) if folder.is_dir() else [])
            if (flushed_at(path) or 0.0) <= mark and is_alive(pid_of(path))
        ]
        if not behind or clock() - started >= timeout:
            return behind
        sleep(STATS_INTERVAL_SECONDS / 10)
