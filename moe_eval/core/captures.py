"""What results.json's captures hold beside the gates' sections, as types (docs/results.schema.json is
generated from them): the timed workload (moe_eval.runner, evaluate/moe_speed.py) and the requests the sweeps
sent (evaluate/layer_sweep.py). The MoE timing itself is core/moe_timing.TimingSummary, its own schema.
A key that is sometimes absent is NotRequired; a float may be null, as NaN and infinities are written.
"""

from __future__ import annotations

from typing_extensions import NotRequired, TypedDict  # pydantic reads typing's TypedDict from 3.12 only

from moe_eval.core.moe_timing import TimingSummary


class EndToEnd(TypedDict):
    """The timed workload end to end (evaluate/moe_speed.py end_to_end): the client's wall time, and the
    engine's own (vLLM's /metrics: evaluate/server_metrics.py)."""

    prefill_tokens_per_s: dict[str, float]
    """per prompt length, the median of its single prefills, the client's wall time"""
    decode_ms_per_step: dict[str, float]
    """per decode batch size, the client's wall time of the group over its tokens (its prefill and HTTP
    included)"""
    engine_prefill_tokens_per_s: NotRequired[dict[str, float]]
    """per prompt length, over the median of its single prefills' engine time (scheduled to first token);
    lengths the server's /metrics did not time are left out (absent: a record before the engine's view)"""
    engine_decode_ms_per_step: NotRequired[dict[str, float]]
    """per decode batch size, the engine's mean time between a sequence's consecutive tokens"""


class BatchedPrefill(TypedDict):
    prompts: int
    """prompts sent at once"""
    tokens_each: int
    """their length"""
    seconds: NotRequired[float]
    """wall seconds (absent before the timing)"""


class SweepRound(TypedDict):
    """One round of requests for the cells the layer check could not judge yet (evaluate/layer_sweep.py)."""

    owed: dict[str, int]
    """per range, the cells owed before the round"""
    sent: list[str]
    """the ranges it sent requests for"""
    requests: NotRequired[int]
    """prompts it sent (absent in the first records of the rounds)"""
    posts: NotRequired[int]
    """HTTP requests they went in: prompts sent at once are one (absent before 2026-12-07: one a prompt)"""
    owed_after: NotRequired[dict[str, int]]
    """per range, the cells still owed after it"""


class TopUp(TypedDict):
    """More units of the ranges the sweep called too few times for the speed gate (evaluate/moe_speed.py)."""

    units: dict[str, int]
    """per range, the units sent"""
    requests: int
    """prompts they took"""
    posts: NotRequired[int]
    """HTTP requests they went in (absent before 2026-12-07: one a prompt)"""
    rounds: NotRequired[int]
    """rounds sent, each after reading the calls so far anew (absent before 2026-12-06: one)"""
    wanted: NotRequired[dict[str, TopUpWant]]
    """per range topped up, what its size needed as its last round read it (absent before 2026-12-07)"""


class TopUpWant(TypedDict):
    """What a range's most-called size needed before the second reading (evaluate/moe_speed.py RangeWant)."""

    size: int
    """the size its units add to, tokens a call: a single-prompt range's prompt length, else the top one"""
    called: int
    """its calls per rank when the round read them"""
    calls: int
    """the calls it needed"""
    reason: str
    """min_calls: the speed gate's MIN_CALLS, to be judged at all; share: to hold two thirds of the range's
    time, so that the sizes two rows both make hold half; aim: for its mean to catch a 10 % eager slowdown
    with 80 % probability at the config's speed_margin_eager (GPU runs)"""


class WarmUp(TypedDict):
    requests: int
    """prompts it sent"""
    posts: NotRequired[int]
    """HTTP requests they went in (absent before 2026-12-07: one a prompt)"""
    seconds: float
    """wall seconds"""


class Workload(TypedDict):
    """The requests sent to reach every dispatch range (evaluate/layer_sweep.py sweep, reach_every_range)."""

    prefill_lengths: list[int]
    """single prompts' lengths, tokens"""
    batched_prefill: BatchedPrefill | None
    """the prefill batched to the server's token limit (null: not sent)"""
    decode_batches: list[int]
    """decode batch sizes sent"""
    prefill_seconds: NotRequired[dict[str, list[float]]]
    """per prompt length, each single prefill's wall seconds (this and the next: absent before the timing)"""
    decode_seconds: NotRequired[dict[str, float]]
    """per decode batch size, its wall seconds"""
    engine_prefill_seconds: NotRequired[dict[str, list[float | None]]]
    """per prompt length, each single prefill's seconds by the engine (vLLM's /metrics; null: not said)"""
    engine_decode_step_seconds: NotRequired[dict[str, float | None]]
    """per decode batch size, the engine's mean seconds between a sequence's consecutive tokens"""
    requests: int
    """prompts sent (each one completion); the prompts of later senders continue after them"""
    posts: NotRequired[int]
    """HTTP requests they went in: each group of prompts sent at once is one request with a list of prompts,
    so that they run together (layer_sweep.together; absent before 2026-12-07, when each prompt was one)"""
    seconds: float
    """wall seconds"""
    ranges_targeted: list[int]
    """the dispatch ranges' lower edges (tokens) the sweep aimed at"""
    fingerprint: NotRequired[str]
    """the sweep's requests (prompt ids, tokens to generate, concurrency; not the top-up's or the rounds')
    hashed: sha256, 16 hex digits; the speed gate compares two rows' times only where they are the same
    (absent: before moe-eval recorded it)"""
    rounds: NotRequired[list[SweepRound]]
    """the layer check's extra rounds"""
    top_up: NotRequired[TopUp]
    """a speed-gated row's more units of the ranges the sweep called under the gate's MIN_CALLS times"""
    warm_up: NotRequired[WarmUp]
    """the same workload sent once untimed before the timed one (schema 9)"""
    layer_check_paused: NotRequired[bool | str]
    """a layer-checked row's timed requests: true where every process of the check said it paused before
    them; else why not (the check may then have sampled some of them); absent: no check on the row, or a
    record made before commit 36f5692 (the check sampled them all)"""
    layer_check_resumed: NotRequired[str]
    """why not every process of the check said it resumed after the timed requests (absent: they all did):
    the check's own sweep may have started with one still paused"""
    read_unflushed: NotRequired[list[str]]
    """the layer check's tables (paths in the run folder) read before their process had copied them after
    the requests before: its flusher lagged past core/flushes.FLUSH_WAIT_SECONDS (absent: none)"""
    prefix_cache_hit_tokens: NotRequired[int | None]
    """prompt tokens of the timed requests (the sweep and its top-up, not the layer check's rounds) that the
    server's prefix cache served (0: every call as sent; null: its /metrics did not say; absent: not timed);
    the speed gate compares rows whose counts match"""


class GpuClocks(TypedDict):
    """The SM clock while the timed requests ran, sampled by nvidia-smi (evaluate/gpu_clocks.py)."""

    sm_mhz_min: NotRequired[float]
    """the lowest sample, MHz"""
    sm_mhz_median: NotRequired[float]
    """the median sample, MHz"""
    sm_mhz_max: NotRequired[float]
    """the highest sample, MHz"""
    samples: NotRequired[int]
    """samples taken (one per GPU per interval)"""
    interval_ms: NotRequired[int]
    """nvidia-smi's sampling interval"""
    devices: NotRequired[list[int] | None]
    """the row's GPUs sampled (nvidia-smi indices); null: the run handed it none, so CUDA_VISIBLE_DEVICES's
    or every GPU"""
    error: NotRequired[str]
    """why no sample was taken (the other fields are then absent)"""


class TimingCapture(TypedDict):
    """The timed workload (runner.py): the MoE calls' time per range, the client's view, the requests."""

    moe: TimingSummary
    """the served MoE calls' time per dispatch range"""
    end_to_end: EndToEnd
    """the client's view"""
    eval_output_tokens_per_s: float | None
    """the GSM8K eval's generated tokens per wall second (null: not counted)"""
    workload: Workload
    """the requests timed"""
    gpu_clocks: NotRequired[GpuClocks | None]
    """the SM clock while they ran (null: no nvidia-smi, the CPU; absent: a record before 2026-12-06)"""
