"""The timer's stamp kernels and slow_range's delay on this GPU (benchmarks/device/served_speed.sh STAGE=power
SPIN=1): a 20 us and a 1 ms sleep as the MoE call, timed by kernels/moe_timer.MoeTimer as a server times it,
eager and replayed from a CUDA graph, plain and slowed by 5 % and 10 % (the end stamp's spin), routed to 3
experts. Prints each case's mean call and its ratio to the plain one; exit 1 where a ratio is off by more
than 0.5 % or the experts were miscounted.

Then the eager calls' gate: an eager call of KERNELS short kernels with the host busy HOST_GAP_US between its
launches (a launch-bound call, as the eager prefill calls are in a server), timed with the start stamp gated
(it waits for the host's last launch) and host-paced (as before the gate). Exit 1 where the gated bracket
reads more than 1.25 x the same call launched with no host gaps, where no give-up was expected and one
happened, or where the host-paced one does not show the host's gaps (the case would prove nothing).

Last, the canary's eager calls as a server makes them (issue 54: a 10 % eager slowdown read x1.067-1.074
there, x1.10 on the twin): SHORT_KERNELS ~3 us kernels with the host busy between launches and between
calls, so the GPU idles before each call, plain and slowed 5 % / 10 %, each ratio printed beside the same
calls made with the GPU kept busy (no host gaps). Report only: does the spin read short on an idle GPU?"""

from __future__ import annotations

import time

import torch

from moe_eval.core.moe_timing import FIELDS
from moe_eval.kernels.moe_timer import MoeTimer

CALLS = 50
TOKENS = 3
KERNELS = 10
HOST_GAP_US = 100.0
SHORT_KERNELS = 6
SHORT_CYCLES = 6_000  # ~3 us at the H100's ~1.98 GHz


def timed(cycles: int, slow: float, graph: bool) -> tuple[float, float]:
    """(mean us, mean experts) of CALLS calls."""
    timer = MoeTimer("probe", None, "probe")
    timer.attach_device(torch.device("cuda"))
    assert timer.device_problem is None, timer.device_problem
    x = torch.zeros(TOKENS, 8, device="cuda")
    ids = torch.tensor([[0, 5], [5, 9], [0, 9]], dtype=torch.int32, device="cuda")

    def call() -> None:
        started = timer.start(x)
        torch.cuda._sleep(cycles)
        timer.stop(started, x, ids, slow)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call()  # compiled outside any capture
        torch.cuda.synchronize()
        timer.table.zero_()
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                call()
            for _ in range(CALLS):
                g.replay()
        else:
            for _ in range(CALLS):
                call()
    torch.cuda.synchronize()
    cell = dict(zip(FIELDS, timer.table[TOKENS].tolist(), strict=True))
    assert cell["calls"] == CALLS, cell
    return cell["ns"] / CALLS / 1e3, cell["experts"] / CALLS


def launch_bound(gated: bool, host_gap_us: float) -> tuple[float, int]:
    """(mean us, give-ups) of CALLS eager calls of KERNELS ~10 us kernels, the host busy between launches."""
    timer = MoeTimer("probe", None, "probe")
    timer.attach_device(torch.device("cuda"))
    assert timer.device_problem is None, timer.device_problem
    timer.gate_eager = gated
    x = torch.zeros(TOKENS, 8, device="cuda")

    def call() -> None:
        started = timer.start(x)
        for _ in range(KERNELS):
            torch.cuda._sleep(15_000)
            until = time.perf_counter() + host_gap_us / 1e6
            while time.perf_counter() < until:
                pass
        timer.stop(started, x)

    call()
    torch.cuda.synchronize()
    timer.table.zero_()
    for _ in range(CALLS):
        call()
    torch.cuda.synchronize()
    cell = dict(zip(FIELDS, timer.table[TOKENS].tolist(), strict=True))
    return cell["ns"] / cell["calls"] / 1e3, int(timer._timeouts[0])


def gate_cases() -> int:
    tight, tight_giveups = launch_bound(gated=True, host_gap_us=0.0)
    gated, giveups = launch_bound(gated=True, host_gap_us=HOST_GAP_US)
    paced, _ = launch_bound(gated=False, host_gap_us=HOST_GAP_US)
    ok_gated = gated < 1.25 * tight and giveups == tight_giveups == 0
    ok_paced = paced > KERNELS * HOST_GAP_US * 0.9
    print(
        f"eager gate: {KERNELS} kernels, host busy {HOST_GAP_US:g} us between launches: gated {gated:.1f} us "
        f"(the same with no host gaps {tight:.1f} us, x{gated / tight:.3f}; give-ups {giveups}) "
        f"{'OK' if ok_gated else 'WRONG'}; host-paced {paced:.1f} us {'OK' if ok_paced else 'WRONG'}"
    )
    return int(not ok_gated) + int(not ok_paced)


def short_eager(slow: float, launch_gap_us: float, call_gap_us: float) -> float:
    """Mean us of CALLS gated eager calls of SHORT_KERNELS short kernels; the host busy launch_gap_us between
    launches and call_gap_us between calls (the GPU idles before each call where that exceeds its work)."""
    timer = MoeTimer("probe", None, "probe")
    timer.attach_device(torch.device("cuda"))
    assert timer.device_problem is None, timer.device_problem
    x = torch.zeros(TOKENS, 8, device="cuda")

    def busy(us: float) -> None:
        until = time.perf_counter() + us / 1e6
        while time.perf_counter() < until:
            pass

    def call() -> None:
        started = timer.start(x)
        for _ in range(SHORT_KERNELS):
            torch.cuda._sleep(SHORT_CYCLES)
            busy(launch_gap_us)
        timer.stop(started, x, None, slow)
        busy(call_gap_us)

    call()
    torch.cuda.synchronize()
    timer.table.zero_()
    for _ in range(CALLS * 4):
        call()
    torch.cuda.synchronize()
    cell = dict(zip(FIELDS, timer.table[TOKENS].tolist(), strict=True))
    return cell["ns"] / cell["calls"] / 1e3


def idle_gpu_cases() -> None:
    cases = (("GPU kept busy", 0.0, 0.0), ("GPU idle before each call", 5.0, 300.0))
    for name, launch_gap, call_gap in cases:
        plain = short_eager(0.0, launch_gap, call_gap)
        reads = []
        for pct in (5.0, 10.0):
            slowed = short_eager(pct / 100, launch_gap, call_gap)
            reads.append(f"{pct:g} % x{slowed / plain:.4f}")
        print(f"short eager calls, {name}: plain {plain:.2f} us; " + ", ".join(reads))


def main() -> None:
    failures = gate_cases()
    for cycles in (20_000, 1_000_000):
        for graph in (False, True):
            plain, experts = timed(cycles, 0.0, graph)
            failures += experts != 3
            for pct in (5.0, 10.0):
                slowed, _ = timed(cycles, pct / 100, graph)
                ratio = slowed / plain
                ok = abs(ratio - (1 + pct / 100)) < 0.005
                failures += not ok
                kind = "graph" if graph else "eager"
                verdict = "OK" if ok else "WRONG"
                print(
                    f"{kind} {cycles:>9} cycles {pct:4.1f} %: {plain:8.2f} -> {slowed:8.2f} us x{ratio:.4f} "
                    f"{verdict}; experts {experts}"
                )
    idle_gpu_cases()  # report only, last: nothing before it depends on it
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
