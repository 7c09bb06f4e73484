"""The lead process of a vLLM server's process group: the server dies with the harness.

vLLM's API server, its engine core and its workers live in their own session (so that a teardown
can signal them all at once), which also means nothing ends them if the harness itself is killed
(SIGKILL by CI after its cancel grace period, or by the OOM killer). The launcher therefore starts
this guard as the group's leader, and the guard starts vLLM in the same group. The guard asks the
kernel for a signal when its parent dies (PR_SET_PDEATHSIG); then it ends the group: SIGTERM,
a grace period, SIGKILL. While the parent lives, a SIGTERM to the group is the launcher's own
teardown, which escalates by itself, so the guard just waits for vLLM. Usage (by the launcher):

    python -m moe_eval.serve.server_guard <parent pid> <grace seconds> -- python -m vllm... ARGS
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from moe_eval.serve.process_tree import ask_for_parent_death_signal, group_alive


def _end_group(grace: float) -> None:
    """SIGTERM to everyone else in the group, then SIGKILL to the group (this process included)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    group = os.getpgrp()
    os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and group_alive(group, exclude=os.getpid()):
        time.sleep(0.2)
    os.killpg(group, signal.SIGKILL)


def main(argv: list[str]) -> int:
    parent, grace, sep, *command = argv
    if sep != "--" or not command:
        print("usage: python -m moe_eval.serve.server_guard PARENT_PID GRACE -- COMMAND...", file=sys.stderr)
        return 2
    parent_pid, grace_s = int(parent), float(grace)
    ask_for_parent_death_signal(signal.SIGTERM)

    def orphaned() -> bool:
        return os.getppid() != parent_pid

    def on_sigterm(signum: int, frame: object) -> None:
        if orphaned():  # the parent-death signal: nobody else will end the group
            _end_group(grace_s)
        # else: the launcher's teardown signalled the whole group; it escalates on its own

    signal.signal(signal.SIGTERM, on_sigterm)  # (a new session has no terminal: no Ctrl-C reaches the group)
    if orphaned():  # the parent died before prctl took effect
        _end_group(grace_s)
    server = subprocess.Popen(command)
    while True:
        try:
            code = server.wait()
            break
        except InterruptedError:
            continue
    if code < 0:  # end as the server ended, so the launcher reads the same exit status
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
