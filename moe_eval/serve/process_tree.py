"""Process groups and parent-death signals (Linux): the small pieces the launcher, the server guard
and the scheduler share to leave no process behind."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

from moe_eval.core.proc_stat import stat_fields

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_alive(pgid: int, exclude: int | None = None) -> bool:
    """True while any process of the group (other than `exclude`) exists and is not a zombie."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == exclude:
            continue
        try:
            fields = stat_fields(entry)  # state ppid pgrp ...
        except OSError:
            continue
        if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def ask_for_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """The kernel sends `sig` to this process when the thread that started it ends (its parent
    process, if that started it from its main thread). Callers check os.getppid() afterwards: a
    parent that died before this call sends nothing."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
