"""The speed measurement: the layer sweep's workload, timed, on every row's server (the incumbent's too).

The workload is the layer check's sweep (evaluate/layer_sweep.sweep: single prompts of 24-1500 tokens
three times each, the batched prefill at the server's token limit, decode batches of 1, 8, 40 and 100
sequences): fixed prompts and lengths, so every row of a model and layout serves the same calls. The MoE
timer of each server process (kernels/moe_timer.py) is read before and after it; the difference is the
workload's per-range MoE time (core/moe_timing.summarize). On a row with the layer check the check is paused
while the timed requests run (`layer_check_paused`: every process says so in its file before the sweep
starts): no row is compared, so the client's end-to-end times hold none of the check's sampled work. What
stays is fixed: an eager call launches nothing for the check, but a captured call replays the check's pick
(which reads the flag) and four launches that return at once. The check then gets a sweep of its own on
later prompts (evaluate/layer_sweep.reach_every_range). The MoE bracket never held the check's work: its end
stamp comes before the check's kernels.

A prefill range whose most-called size is short of what the gate needs gets more units of its workload
before the second reading, in rounds read anew until it has enough or TOP_UP_ROUNDS are spent (`top_up`;
`timing.workload.top_up` in results.json, with what the last round wanted and why: `range_wants`):
- MIN_CALLS, to be judged at all (a model of few MoE layers: the two-layer twins made 2-12 calls there on the
  H200, spread over several chunk sizes);
- in a single-prompt range, two thirds of the range's time (TOP_SIZE_SHARE), so that the sizes a row and its
  reference both make hold the gate's half: beside the sweep's own length sit sizes the batched prompts'
  steps made, different in each row;
- on GPUs, the calls that let the range catch a slowdown of EAGER_AIM at the config's eager margin
  (gates/speed.py calls_to_catch): a noisy size (the canary's 8192-token calls, 5-6 % a call) needs several
  times MIN_CALLS.
The decode ranges get far more calls than that from the sweep alone. Units follow each row's own readings,
so a row and its reference can differ by a unit where chunked prefill packed their batched prompts otherwise:
the gate compares calls of the same size, not the workload's total.

End to end, from the client: each single prefill's tokens per second (median of its three) and each decode
batch's wall time per generated token (which includes its 16-token prompts' prefill).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from moe_eval.core import layer_cells, moe_timing
from moe_eval.core.plugin_protocol import (
    LAYER_CHECK_DIR,
    LAYER_CHECK_PAUSE,
    LAYER_RANGE_EDGES,
    MOE_TIMING_DIR,
    STATS_INTERVAL_SECONDS,
    layer_range_names,
)
from moe_eval.evaluate.layer_sweep import (
    DECODE_BATCHES,
    DECODE_TOKENS,
    RANGE_UNITS,
    SweepTarget,
    send_units,
    sweep,
)
from moe_eval.gates.speed import MIN_CALLS, calls_to_catch, gated_eager

# At most this many more units of one range in one round (a range the sweep called once asks for 17): each
# is at most two batched-token limits of prompts, a fraction of a second on the H200.
MAX_TOP_UP_UNITS = 2 * MIN_CALLS
# The ranges only prefills reach (above the sweep's decode batches): the ranges the top-up sends units of.
PREFILL_ONLY_RANGES = tuple(
    name
    for name, low in zip(layer_range_names(), LAYER_RANGE_EDGES, strict=True)
    if low > max(DECODE_BATCHES)
)
# The prefill ranges whose unit is single prompts of one length sent one at a time (layer_sweep.RANGE_UNITS:
# one prompt at once, one token generated), with that length: every call of a unit lands at that size, so
# more units raise its share of the range's time. (M>=4096's unit is a batched prefill whose steps land at
# several sizes: more of it keeps the shares.)
SINGLE_PROMPT_RANGES = {
    name: length
    for name, (prompts, at_once, length, generated) in zip(layer_range_names(), RANGE_UNITS, strict=True)
    if name in PREFILL_ONLY_RANGES and prompts > 0 and at_once == 1 and generated == 1
}
# The share of a single-prompt range's time its unit's size is topped up to hold. The gate judges a range only
# where the sizes both rows made hold MIN_MATCHED_SHARE (half) of each row's time; the canary's M=1024-4095
# missed it in 5 of 8 comparisons on one H100 (2026-12-07: its 1500-token calls held 35-49 %, beside sizes
# the batched prompts' steps made, different in each row). Two thirds in each row leave room.
TOP_SIZE_SHARE = 2 / 3
# The most calls a size is asked for, by the share or the aim (8 x MIN_CALLS): past it, a range says what it
# would catch. (A compile among another size's calls, ~0.7 s on vLLM's canary row, would otherwise ask the
# share for tens of thousands.)
MAX_WANTED_CALLS = 8 * MIN_CALLS
# Rounds of top-up, each read anew (top_up): the second is for a range whose units the scheduler packed into
# other sizes than the most-called one, or whose aim grew with the spread its new calls showed. With the wants
# (share, aim) every row of the canary on one H100 sent in all three and ended with 44-84 calls at 8192 tokens
# where 41-80 were asked: short in some rows, yet every range was judged and would catch x1.10 or less
# (docs/perf.md, "The canary with the top-up's wants").
TOP_UP_ROUNDS = 3


# How long the processes get to say they paused (each looks every STATS_INTERVAL_SECONDS; a loaded 2-core
# machine's server threads can lag a few intervals).
PAUSE_WAIT_SECONDS = 10 * STATS_INTERVAL_SECONDS


def timed_sweep(
    target: SweepTarget, run_dir: Path, pause_layer_check: bool = False, eager_margin: float | None = None
) -> tuple[dict[str, Any], moe_timing.TimingSummary]:
    """(what was sent with its wall times, the per-range MoE time of those calls), the processes' timing files
    read from run_dir before the sweep, after it and after the top-up (where one was sent).
    pause_layer_check: the row's layer check samples nothing meanwhile (`layer_check_paused` in what was
    sent: true, or why not). eager_margin: the config's speed_margin_eager where the top-up aims the eager
    ranges at EAGER_AIM (on GPUs; None: it tops up to the gate's MIN_CALLS and the share alone)."""
    if not pause_layer_check:
        return _timed(target, run_dir, eager_margin)
    paused: str | None = None
    try:  # the pause inside it: an interrupt while waiting still removes the pause file
        paused = switch_layer_check(run_dir, paused=True)
        sent, summary = _timed(target, run_dir, eager_margin)
    finally:
        # Where no process had written a file, none could have paused: remove the file, wait for nobody.
        anyone = bool(layer_cells.paths(run_dir))
        resumed = switch_layer_check(run_dir, paused=False) if anyone else None
        if not anyone:
            (run_dir / LAYER_CHECK_DIR / LAYER_CHECK_PAUSE).unlink(missing_ok=True)
    # True where every process said so before the first timed request; else why not (the check may then
    # have sampled some timed calls, whose end-to-end times hold its work).
    sent["layer_check_paused"] = True if paused is None else paused
    if resumed is not None:  # the check's own sweep may then have started with a process still paused
        sent["layer_check_resumed"] = resumed
    return sent, summary


def switch_layer_check(run_dir: Path, paused: bool, wait: float = PAUSE_WAIT_SECONDS) -> str | None:
    """Pause (or resume) every layer-check process of the row through LAYER_CHECK_PAUSE in its folder, and
    wait until each process's file says it follows: None once they all do; else why not (no process has
    written a file yet, or those that lag)."""
    folder = run_dir / LAYER_CHECK_DIR
    control = folder / LAYER_CHECK_PAUSE
    if paused:
        folder.mkdir(parents=True, exist_ok=True)
        control.touch()
    else:
        control.unlink(missing_ok=True)
    deadline = time.monotonic() + wait
    while True:
        # An unreadable file (mid-rewrite on a file system without atomic renames) lags: read again.
        states = {name: (meta or {}).get("paused") for name, meta in layer_cells.read_metas(run_dir).items()}
        lagging = sorted(name for name, state in states.items() if state is not paused)
        if states and not lagging:
            return None
        if time.monotonic() >= deadline:
            state = "paused" if paused else "resumed"
            if not states:
                return f"no layer-check process had written its file in {folder} to say it {state}"
            who = f"{len(lagging)} of {len(states)} layer-check processes"
            return f"{who} did not say they {state} in {wait:g} s"
        time.sleep(STATS_INTERVAL_SECONDS / 5)


def _timed(
    target: SweepTarget, run_dir: Path, eager_margin: float | None
) -> tuple[dict[str, Any], moe_timing.TimingSummary]:
    # The same workload once untimed first, on prompts of its own: every call size the timed one makes has
    # been made once in every process (a size's first call can hold an allocation or a first launch's
    # setup), so the two rows' timed calls start from the same state.
    warm_up = sweep(target)
    before = read_when_flushed(run_dir)
    hits_before = target.prefix_cache_hits()
    sent = sweep(target, first_index=warm_up["requests"])
    sent["warm_up"] = {k: warm_up[k] for k in ("requests", "posts", "seconds")}
    sent["requests"] += warm_up["requests"]  # prompts used, so the later senders continue after them
    sent["posts"] += warm_up["posts"]
    # Every timed row (the runner times only config.moe_timing rows), not only gated ones: a row and its
    # reference must send the same kinds of top-up.
    current = top_up(target, lambda: _read_since(run_dir, before), sent, eager_margin)
    hits_after = target.prefix_cache_hits()
    # Calls as sent: a prompt the prefix cache shortened made a smaller call than its range's (layer_sweep's
    # TokenPool keeps this 0); the speed gate compares rows only where their counts match
    # (checks.workload_identity).
    sent["prefix_cache_hit_tokens"] = (
        hits_after - hits_before if hits_before is not None and hits_after is not None else None
    )
    # The top-up's last reading, where nothing was sent after it, is already the whole workload's: a second
    # wait for the flushers would add a second of nothing to every row.
    return sent, current if current is not None else _read_since(run_dir, before)


def _read_since(run_dir: Path, before: list[moe_timing.ProcessTiming]) -> moe_timing.TimingSummary:
    after = read_when_flushed(run_dir, expected=(p.pid for p in before))
    return moe_timing.summarize(moe_timing.since(after, before))


def read_when_flushed(run_dir: Path, expected: Iterable[int] = ()) -> list[moe_timing.ProcessTiming]:
    """Every process's timing table once each has copied it after now (its file's `snapshot_at`, taken
    before the copy): every request that returned before this call is in it. The flushers tick every
    STATS_INTERVAL_SECONDS, so that is half an interval on average. A look counts only where every file in
    the folder was read and every process of `expected` (the pids of the reading before) is among them. A
    file without the stamp (a timer from before it) gets the fixed wait of two intervals this replaces; a
    stamped process that has not copied since (a loaded machine's flusher lags) PAUSE_WAIT_SECONDS, after
    which the tables are read as they are."""
    mark = time.time()
    started = time.monotonic()
    wanted = set(expected)
    while True:
        files = len(list((run_dir / MOE_TIMING_DIR).glob("*.json")))
        processes = moe_timing.read_folder(run_dir)
        whole = len(processes) == files and wanted <= {p.pid for p in processes}
        stamps = [p.snapshot_at for p in processes]
        if processes and whole and all(at is not None and at > mark for at in stamps):
            return processes
        unstamped = not processes or any(at is None for at in stamps)
        waited = time.monotonic() - started
        if waited >= (2 * STATS_INTERVAL_SECONDS if unstamped else PAUSE_WAIT_SECONDS):
            return processes
        time.sleep(STATS_INTERVAL_SECONDS / 10)


def top_up(
    target: SweepTarget,
    read: Callable[[], moe_timing.TimingSummary],
    sent: dict[str, Any],
    eager_margin: float | None = None,
) -> moe_timing.TimingSummary | None:
    """Round after round, units of the prefill ranges whose most-called size is still short of the calls it
    needs (`range_wants` of what `read` returns: every timed call so far; eager_margin: the config's
    speed_margin_eager where the row aims at EAGER_AIM, on GPUs), at most TOP_UP_ROUNDS; `sent["top_up"]`
    says what went (units summed per range, requests, rounds, what each range's last round wanted and why) and
    `sent["requests"]` counts them, so later prompts continue after. A unit's calls land at sizes the engine's
    scheduler picks (how many prompts one step packs), so one round can leave a range's most-called size
    short: on one H100 (2026-12-06) vLLM's canary row sent the one unit of M>=4096 asked for and ended with 8
    calls at 8192 tokens, FlashInfer's row beside it with 28, and the gate could not judge the range between
    them. Returns its last reading where nothing was sent after it (the timed calls as they stand), else
    None."""
    for _ in range(TOP_UP_ROUNDS):
        reading = read()
        wants = {name: want for name, want in range_wants(reading, eager_margin).items() if want.units}
        if not wants:
            return reading
        units = {name: want.units for name, want in wants.items()}
        now = send_units(target, units, first_index=sent["requests"])
        if not now["units"]:  # none of them reachable on this server: another round would send nothing too
            return reading
        total = sent.setdefault("top_up", {"units": {}, "requests": 0, "posts": 0, "rounds": 0})
        for name, count in now["units"].items():
            total["units"][name] = total["units"].get(name, 0) + count
        total["requests"] += now["requests"]
        total["posts"] += now["posts"]
        wanted = total.setdefault("wanted", {})  # each range's want as its last round read it
        wanted.update({name: want.as_dict() for name, want in wants.items() if name in now["units"]})
        sent["posts"] += now["posts"]
        total["rounds"] += 1
        sent["requests"] += now["requests"]  # the layer check's prompts continue after these
    return None  # the last round sent units after its reading


@dataclass(frozen=True)
class RangeWant:
    """What a prefill range's most-called size needs before the second reading: `calls` per rank (it has
    `called`), for `reason`: min_calls (the gate's MIN_CALLS, to be judged at all), share (to hold
    TOP_SIZE_SHARE of the range's time, so that the sizes two rows both make hold the gate's
    MIN_MATCHED_SHARE), aim (for its mean to be sharp enough to catch EAGER_AIM: calls_to_catch)."""

    size: int
    called: int
    calls: int
    reason: str

    @property
    def units(self) -> int:
        """More units of the range's workload: enough if a unit adds two thirds of what the sweep did there
        (two single prompts where the sweep sent three; a batched prefill adds about as many as the
        sweep's); 0 where it has enough, or made no call there (the server cannot reach the range)."""
        if not 0 < self.called < self.calls:
            return 0
        return min(MAX_TOP_UP_UNITS, math.ceil(1.5 * (self.calls - self.called) / self.called))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def range_wants(first: moe_timing.TimingSummary, eager_margin: float | None = None) -> dict[str, RangeWant]:
    """Per prefill-only range (above the sweep's decode batches) the sweep reached, what the size its units
    add to needs (RangeWant): a single-prompt range's unit length where the range has calls of it, else its
    most-called size. The gate matches calls size for size, so a range's calls spread over many sizes count
    as that size's: on one H100 the Qwen3 twin's M>=4096 made 16 calls over 2-5 chunk sizes, and 2 of 3 runs
    could not judge it (docs/perf.md). The aim is asked only where the row's eager calls were timed from the
    host's last launch (gated_eager): elsewhere the gate's floor grows with a call's spread, and no count
    catches the aim."""
    aim_margin = eager_margin if eager_margin is not None and gated_eager(first) else None
    wants = {}
    for r in first.ranges:
        if r.range not in PREFILL_ONLY_RANGES:
            continue
        if not r.sizes:  # timed per range only
            wants[r.range] = RangeWant(0, r.calls, MIN_CALLS, "min_calls")
            continue
        length = SINGLE_PROMPT_RANGES.get(r.range)
        own = [s for s in r.sizes if s.tokens == length]
        top = own[0] if own else max(r.sizes, key=lambda s: s.calls)
        needs = [(MIN_CALLS, "min_calls")]
        if length is not None and top.mean_us > 0:
            other_us = sum(s.calls * s.mean_us for s in r.sizes if s is not top)
            share_calls = TOP_SIZE_SHARE / (1 - TOP_SIZE_SHARE) * other_us / top.mean_us  # of (top + other)
            needs.append((min(math.ceil(share_calls), MAX_WANTED_CALLS), "share"))
        aim_calls = calls_to_catch(top, aim_margin) if aim_margin is not None else None
        if aim_calls is not None:
            needs.append((min(aim_calls, MAX_WANTED_CALLS), "aim"))
        calls, reason = max(needs, key=lambda need: need[0])  # the first of equals: min_calls
        wants[r.range] = RangeWant(top.tokens, top.calls, calls, reason)
    return wants


def end_to_end(sent: dict[str, Any]) -> dict[str, Any]:
    """The timed workload seen by the client (wall time per request: prefill tokens/s per prompt length, ms
    per decode step including the request's prefill and HTTP) and by the engine (vLLM's /metrics: the same
    without either; the view to compare between rows: server_metrics)."""
    decode = {
        batch: round(1e3 * seconds / DECODE_TOKENS, 2)
        for batch, seconds in (sent.get("decode_seconds") or {}).items()
    }
    engine_decode = {
        batch: round(1e3 * seconds, 3)
        for batch, seconds in (sent.get("engine_decode_step_seconds") or {}).items()
        if seconds
    }
    return {
        "prefill_tokens_per_s": _prefill_tokens_per_second(sent.get("prefill_seconds")),
        "decode_ms_per_step": decode,
        "engine_prefill_tokens_per_s": _prefill_tokens_per_second(sent.get("engine_prefill_seconds")),
        "engine_decode_ms_per_step": engine_decode,
    }


def _prefill_tokens_per_second(seconds_by_length: dict[str, list[float | None]] | None) -> dict[str, float]:
    """Per prompt length, its tokens over the median of its single prefills' seconds; a prefill with no time
    (the engine's /metrics did not say) is left out, and a length with none."""
    rates = {}
    for length, seconds in (seconds_by_length or {}).items():
        timed = [s for s in seconds if s]
        if timed:
            rates[length] = round(int(length) / statistics.median(timed), 1)
    return rates
