"""The GPUs' SM clock while a row's timed requests run (results.json `timing.gpu_clocks`, report only).

Why: the canary's short eager MoE calls (24-55 us) moved 2-5 % between servers and between two H100s while
its graph-replayed calls repeated within 1 % (docs/perf.md, "The speed gate on a second H100"). A GPU that
idles between bursts of prefill may run them at a lower clock; this records what the clock did, so the next
GPU run can tell. nvidia-smi samples every INTERVAL_MS in a process of its own beside the requests (nothing
runs in the server): the row's devices, else CUDA_VISIBLE_DEVICES's, else every GPU, pooled into one
summary. It is stopped on every way out of the block, and asks the kernel for SIGTERM should the process
that started it die first (a worker killed outright). It never fails the row: what goes wrong is recorded.
What it found (one H100, 2026-12-06, docs/perf.md): the clock at its 1980 MHz maximum in every sample of 8
canary rows, while their eager calls still moved between servers; a row without the polling ran within
what servers differ by (tests/speed/test_h100_clocks_tiles_fi.py).
"""

from __future__ import annotations

import shutil
import signal
import statistics
import subprocess
import tempfile
from types import TracebackType
from typing import IO

from moe_eval.configs.hardware import visible_devices
from moe_eval.core.captures import GpuClocks
from moe_eval.serve.process_tree import ask_for_parent_death_signal

INTERVAL_MS = 100
STOP_TIMEOUT_SECONDS = 5.0


class ClockSampler:
    """`with ClockSampler(devices) as clocks: ...`, then `clocks.summary()`: None where nothing was asked to
    sample (no nvidia-smi: the CPU), else the SM clock's min / median / max over the samples, or why none."""

    def __init__(self, devices: tuple[int, ...] | None, interval_ms: int = INTERVAL_MS) -> None:
        self.devices = devices
        self.interval_ms = interval_ms
        self._proc: subprocess.Popen[str] | None = None
        self._output = ""
        self._error: str | None = None
        self._sampled = False  # a sampler ran and was stopped
        self._file: IO[str] | None = None

    def __enter__(self) -> ClockSampler:
        if shutil.which("nvidia-smi") is None:
            return self
        argv = ["nvidia-smi", "--query-gpu=index,clocks.sm", "--format=csv,noheader,nounits"]
        ids = self._ids()
        if ids:
            argv.append("--id=" + ",".join(ids))
        argv.append(f"--loop-ms={self.interval_ms}")
        try:
            # A file, not a pipe: minutes of samples outgrow a pipe's buffer, and a full pipe stops the loop.
            self._file = tempfile.TemporaryFile(mode="w+")
            self._proc = subprocess.Popen(
                argv,
                stdout=self._file,
                stderr=subprocess.STDOUT,
                text=True,
                preexec_fn=lambda: ask_for_parent_death_signal(signal.SIGTERM),
            )
        except Exception as exc:  # noqa: BLE001  report only: the row goes on without clocks
            self._error = f"nvidia-smi did not start: {exc}"
            self._close_file()
        return self

    def _ids(self) -> list[str]:
        if self.devices is not None:
            return [str(d) for d in self.devices]
        return sorted(visible_devices() or ())

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.terminate()  # stopped on every way out: no sampler outlives its row
            try:
                proc.wait(timeout=STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_SECONDS)  # a wedged GPU's nvidia-smi: give up, say so
            if self._file is not None:
                self._file.seek(0)
                self._output = self._file.read()
            self._sampled = True
        except Exception as exc:  # noqa: BLE001  report only
            self._error = f"nvidia-smi did not stop: {exc}"
        finally:
            self._close_file()

    def summary(self) -> GpuClocks | None:
        if self._error is not None:
            return {"error": self._error}
        if not self._sampled:
            return None
        mhz, other = [], []
        for line in self._output.splitlines():
            index, _, clock = (part.strip() for part in line.partition(","))
            if index.isdigit() and clock.replace(".", "", 1).isdigit():
                mhz.append(float(clock))
            elif line.strip():
                other.append(line.strip())
        if not mhz:
            said = "; ".join(other[:3]) or "nothing"
            return {"error": f"nvidia-smi gave no SM clock sample (it said: {said})"}
        return {
            "sm_mhz_min": min(mhz),
            "sm_mhz_median": statistics.median(mhz),
            "sm_mhz_max": max(mhz),
            "samples": len(mhz),
            "interval_ms": self.interval_ms,
            "devices": list(self.devices) if self.devices is not None else None,
        }
