"""Kernel tests: without a GPU the Triton bodies run in Triton's interpreter.

The interpreter must be switched on (TRITON_INTERPRET=1) both when triton is first imported and
while a kernel runs (it imports lazily then). It is set here for the import and by an autouse
fixture around each test, never for the whole session, so servers started by other tests do not
inherit it.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
INTERPRETER_PROBLEM: str | None = None

if not HAS_GPU:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        INTERPRETER_PROBLEM = (
            "triton was imported before tests/kernels/conftest.py could switch its interpreter on; "
            "run `pytest tests/kernels` in a process of its own, or export TRITON_INTERPRET=1"
        )
    else:
        _previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            import triton  # noqa: F401  (imported with the interpreter on)

            import moe_eval.kernels._fused_moe_kernels  # noqa: F401
        finally:
            if _previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = _previous


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if not HAS_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    # Tiny CPU matmuls gain nothing from a second thread, and on the 2-core CI machine with a
    # server busy beside them, OpenMP's spinning turned a 256-token torch_moe call from ~1 ms
    # into 0.6-2.5 s (measured 2026-11-29). One thread keeps the suite's time independent of load.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_GPU else "cpu")
