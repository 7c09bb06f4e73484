"""The MoE timer's stamp kernels (kernels/moe_timer.py): one thread block each, on the call's stream.

`stamp_start_kernel` stores the clock before the MoE kernels of a call captured into a CUDA graph (its
replays run back to back with no host in between). `stamp_gated_start_kernel` does the same for an eager
call, once the host has launched the whole call: it waits until the host's release (pinned host memory)
reaches the call's ticket, which the host writes after launching the end stamp. Without the wait an eager
call's bracket held the host's launch pace, not the GPU's: at the Qwen3 twin's shape a 600-token call read
626-779 us between servers of one kernel for ~350 us of GPU work (H100, 2026-12-06), and the speed gate could
judge eager ranges only within x2-x270. The wait gives up after `timeout_ns` (a host that blocks on the GPU
inside the bracket would otherwise never release it) and counts the call in `timeouts_ptr`: the timer turns
the wait off after a few (kernels/moe_timer.py) and the record says so.

`stamp_end_kernel` reads the clock after the MoE kernels and adds
the call to its size's cell in pinned host memory: the call, its nanoseconds and their square, its tokens,
whether it was a CUDA-graph replay, and the number of distinct experts its routing hit with their products
(the speed gate's covariate: at real shapes a decode call's time follows how many experts' weights it reads,
so two rows' calls of one size are compared at the same routing). Two things happen after the clock is read,
outside the measured time: counting the experts (a flag per global expert id, then their sum, then the flags
cleared) and, for `--mutate slow_range`, a spin before the clock is read for the last time, until the call
has taken (1 + slow) x its own time: the delay is in the stream, and so in the bracket, with no kernel added
to the call (a separate delay kernel's own launch cost +2-3 us a call on the H100, +25 % of the canary's
10 us decode calls, 2026-12-06).

DEVICE_CLOCK False reads a test's clock instead of %globaltimer (Triton's interpreter cannot run inline
PTX): each read adds 1 us to it, so the kernels' arithmetic runs on the CPU (tests/speed/test_moe_timing.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

EXPERT_FLAGS = 1024  # global expert ids below this are counted (Qwen3 128, Scout 16, DeepSeek-V3 256)
COUNT_BLOCK = 1024  # routing slots read per step


@triton.jit
def _clock(clock_ptr, DEVICE_CLOCK: tl.constexpr):
    if DEVICE_CLOCK:
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        return tl.atomic_add(clock_ptr, 1000)


@triton.jit
def stamp_start_kernel(start_ptr, clock_ptr, DEVICE_CLOCK: tl.constexpr):
    tl.store(start_ptr, _clock(clock_ptr, DEVICE_CLOCK))


@triton.jit(do_not_specialize=["ticket", "timeout_ns"])
def stamp_gated_start_kernel(
    start_ptr,  # (1,) int64: the start stamp, ns
    clock_ptr,
    release_ptr,  # (1,) int64, pinned host memory: the newest ticket whose call the host has launched whole
    ticket,  # this call's ticket
    timeout_ns,
    timeouts_ptr,  # (1,) int64, pinned host memory: the calls whose wait gave up
    DEVICE_CLOCK: tl.constexpr,
):
    began = _clock(clock_ptr, DEVICE_CLOCK)
    now = began
    released = tl.load(release_ptr, volatile=True) >= ticket
    while (not released) and (now - began < timeout_ns):
        now = _clock(clock_ptr, DEVICE_CLOCK)
        released = tl.load(release_ptr, volatile=True) >= ticket
    if not released:
        tl.store(timeouts_ptr, tl.load(timeouts_ptr, volatile=True) + 1)
    tl.store(start_ptr, _clock(clock_ptr, DEVICE_CLOCK))


# do_not_specialize: a value of 1 (M = 1, a captured call's replayed, one slot) must not compile a second
# variant while serving.
@triton.jit(do_not_specialize=["cell_index", "tokens", "replayed", "slots", "slow"])
def stamp_end_kernel(
    start_ptr,  # (1,) int64: the start stamp, ns
    clock_ptr,  # (1,) int64: the test clock (unused with DEVICE_CLOCK)
    table_ptr,  # (cells, FIELDS_PER_CELL) float64, pinned host memory
    cell_index,
    tokens,
    replayed,  # 1 where the call was captured into a CUDA graph (then counted at every replay), else 0
    ids_ptr,  # the call's routing: global expert ids, `slots` of them
    slots,
    flags_ptr,  # (EXPERT_FLAGS,) int32, zero between calls
    slow,  # slow_range: the call takes (1 + slow) x its own time; 0: not slowed
    FIELDS_PER_CELL: tl.constexpr,
    COUNT_EXPERTS: tl.constexpr,
    FLAGS: tl.constexpr,
    BLOCK: tl.constexpr,
    DEVICE_CLOCK: tl.constexpr,
):
    start = tl.load(start_ptr)
    now = _clock(clock_ptr, DEVICE_CLOCK)
    if slow > 0:
        until = start + ((now - start).to(tl.float64) * (1.0 + slow)).to(tl.int64)
        while now < until:
            now = _clock(clock_ptr, DEVICE_CLOCK)
    elapsed = (now - start).to(tl.float64)
    experts = elapsed * 0.0
    if COUNT_EXPERTS:
        offs = tl.arange(0, BLOCK)
        for first in range(0, slots, BLOCK):
            idx = first + offs
            ids = tl.load(ids_ptr + idx, mask=idx < slots, other=0)
            tl.store(flags_ptr + ids, 1, mask=(idx < slots) & (ids >= 0) & (ids < FLAGS))
        tl.debug_barrier()  # every flag stored before any is read
        lanes = tl.arange(0, FLAGS)
        experts = tl.sum(tl.load(flags_ptr + lanes), axis=0).to(tl.float64)
        tl.store(flags_ptr + lanes, tl.zeros([FLAGS], dtype=tl.int32))  # each lane clears what it read
    # One stream runs a process's MoE layers in order: a plain read-modify-write needs no atomic.
    cell = table_ptr + cell_index * FIELDS_PER_CELL
    tl.store(cell, tl.load(cell, volatile=True) + 1.0)
    tl.store(cell + 1, tl.load(cell + 1, volatile=True) + elapsed)
    tl.store(cell + 2, tl.load(cell + 2, volatile=True) + elapsed * elapsed)
    tl.store(cell + 3, tl.load(cell + 3, volatile=True) + tokens.to(tl.float64))
    tl.store(cell + 4, tl.load(cell + 4, volatile=True) + replayed.to(tl.float64))
    tl.store(cell + 5, tl.load(cell + 5, volatile=True) + replayed.to(tl.float64) * elapsed)
    tl.store(cell + 6, tl.load(cell + 6, volatile=True) + experts)
    tl.store(cell + 7, tl.load(cell + 7, volatile=True) + experts * experts)
    tl.store(cell + 8, tl.load(cell + 8, volatile=True) + experts * elapsed)
