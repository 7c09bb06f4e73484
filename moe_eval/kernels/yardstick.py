"""The yardstick: a fixed chain of six small matmuls that the MoE timer runs, in its own bracket, right after
each eager MoE call on a GPU (kernels/moe_timer.py), so that the speed gate can tell a server's own pace from
the kernel's (gates/speed.py, "paired").

Why: the canary's eager MoE calls (24-55 us, about six ~3 us kernels) move 1.2-1.5 % between fresh processes
of one GPU with the same data and the SM clock pinned, while within one process they repeat within 0.4-0.5 %
(docs/perf.md, issue 54). A 10 % eager slowdown read against two servers' drift is caught only when the two
happen to agree. Measured outside vLLM on one H100 (`benchmarks/device/eager_drift_probe.py`, 8 processes x 3
buffer sets, docs/data/speed_h100/eager-drift-probe-2.jsonl): this chain, timed the same way on the same call
size, moves with the MoE call (r^2 0.58-0.80 between processes), more so than vLLM's own fused_experts at
8192 tokens (0.31), and needs nothing but torch.

Its shapes: the call's hidden states (M x D) through D x WIDTH and back, STEPS times, as the probe timed them
(the canary's D = 256). Its weights are made once per (D, dtype, device) from a fixed seed; its output is
dropped. It reads the hidden states the call was given (after a kernel that works in place, its output: the
same shape, the same time) and writes only its own buffers: the served model's numbers do not change. It
costs about 6 x 2 x M x D x 128 flops a layer per eager call (at the Qwen3 twin's D = 2048 and 8192 tokens,
~26 GFLOP against the call's ~1.3 ms): prefill throughput read end to end carries it too.
"""

from __future__ import annotations

import torch

WIDTH = 128  # the canary's expert width (F): the probe's control
STEPS = 3  # up and back this many times: six matmuls


class Yardstick:
    def __init__(self) -> None:
        self._weights: dict[tuple[int, torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self._warm: set[tuple[int, int, torch.dtype, torch.device]] = set()  # (M, D, dtype, device) run once

    def _for(self, hidden_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (hidden_TD.shape[1], hidden_TD.dtype, hidden_TD.device)
        weights = self._weights.get(key)
        if weights is None:
            D = hidden_TD.shape[1]
            generator = torch.Generator().manual_seed(54)
            # scaled so that the chain's values stay of the input's size (no infinities to time)
            up = torch.randn(D, WIDTH, generator=generator) / D**0.5
            down = torch.randn(WIDTH, D, generator=generator) / WIDTH**0.5
            weights = (
                up.to(device=hidden_TD.device, dtype=hidden_TD.dtype),
                down.to(device=hidden_TD.device, dtype=hidden_TD.dtype),
            )
            self._weights[key] = weights
        return weights

    def prepare(self, hidden_TD: torch.Tensor) -> bool:
        """Before the timed run, outside its bracket: make the weights for this call's D, and run the chain
        once at a call size it has not run at. The first matmul of a shape in a process does host work (the
        BLAS library's set-up, its choice for the shape, the allocator growing for the intermediates) that
        outlasted the timer's 10 ms gate: served on an H100, every row's yardstick gave up 1-7 times, once at
        each size first called inside the timed requests, and those sizes read 350-1,160 us against 25-33 us
        (docs/perf.md). True where it ran the chain now."""
        self._for(hidden_TD)
        key = (hidden_TD.shape[0], hidden_TD.shape[1], hidden_TD.dtype, hidden_TD.device)
        if key in self._warm:
            return False
        self.run(hidden_TD)
        self._warm.add(key)
        return True

    @torch.no_grad()
    def run(self, hidden_TD: torch.Tensor) -> torch.Tensor:
        up, down = self._for(hidden_TD)
        x = hidden_TD
        for _ in range(STEPS):
            x = (x @ up) @ down
        return x
