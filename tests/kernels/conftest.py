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


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_GPU else "cpu")
