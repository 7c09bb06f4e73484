"""`--mutate slow_range:range=R,pct=P`: the same MoE, P % slower in the calls of one dispatch range.

What the speed gate's power is measured with: a slowdown of adjustable size where a kernel change would put
one (a decode range, a prefill range), the output untouched. The delay is sized from the call's own time, so
P % means P % at every size of the range and on any machine:

- on a CUDA device, two one-thread Triton kernels on the call's stream: one stores %globaltimer before the
  kernel's launches, one after them spins until the device clock has run P % of the time since that stamp
  again. Kernels only, no host sync: a CUDA graph captures both beside the MoE kernels and every replay is
  slowed by its own time (a capture-safe delay);
- on the host (the CPU build), time.perf_counter_ns around the call, then a busy wait of P % of it.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def _spin_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _clock():
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )

    @triton.jit
    def _stamp_kernel(start_ptr):
        tl.store(start_ptr, _clock())

    @triton.jit(do_not_specialize=["fraction"])
    def _spin_kernel(start_ptr, fraction):
        now = _clock()
        until = now + ((now - tl.load(start_ptr)).to(tl.float32) * fraction).to(tl.int64)
        while _clock() < until:
            pass

    return _stamp_kernel, _spin_kernel


class Slowdown:
    """Wraps a kernel callable (oracle.make_moe_kernel's contract): calls of low <= M <= high tokens take
    (1 + pct / 100) x their time."""

    def __init__(self, kernel: Any, low: int, high: int | None, pct: float) -> None:
        self.kernel = kernel
        self.low, self.high, self.fraction = low, high, pct / 100.0
        self._kernels: tuple[Any, Any] | None = None
        self._start: torch.Tensor | None = None
        self.__name__ = f"{getattr(kernel, '__name__', 'kernel')}_slow_range"

    def hits(self, tokens: int) -> bool:
        return self.low <= tokens and (self.high is None or tokens <= self.high)

    def __call__(self, hidden_TD: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self.hits(hidden_TD.shape[0]):
            return self.kernel(hidden_TD, *args, **kwargs)
        if hidden_TD.device.type == "cuda":
            if self._kernels is None:
                self._kernels = _spin_kernels()
                self._start = torch.zeros(1, dtype=torch.int64, device=hidden_TD.device)
            stamp, spin = self._kernels
            stamp[(1,)](self._start, num_warps=1)
            out = self.kernel(hidden_TD, *args, **kwargs)
            spin[(1,)](self._start, self.fraction, num_warps=1)
            return out
        started = time.perf_counter_ns()
        out = self.kernel(hidden_TD, *args, **kwargs)
        until = time.perf_counter_ns() + (time.perf_counter_ns() - started) * self.fraction
        while time.perf_counter_ns() < until:
            pass
        return out
