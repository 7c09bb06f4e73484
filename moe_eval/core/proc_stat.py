"""A process's /proc/<pid>/stat, read where the harness asks whether a server process still runs."""

from __future__ import annotations


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields after the command name's ')' (state, ppid, pgrp, ...); None where the process is gone.
    Raises OSError where /proc cannot say (no /proc, no permission)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
