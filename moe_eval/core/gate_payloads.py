"""What results.json holds inside a judged section and a timing capture, as types: each gate's payload with
its fields (moe_eval.gates writes them; moe_eval.runner the captures).

They describe plain dicts: the record keeps each section as the JSON object it is, and callers index it as
one. docs/results.schema.json is generated from them (moe_eval.core.record_schema: each field's docstring is
its description). A key that is sometimes absent is NotRequired; a float may be null, as NaN and infinities
are written.
"""

from __future__ import annotations

from typing import Literal

from typing_extensions import NotRequired, TypedDict  # pydantic reads typing's TypedDict from 3.12 only

from moe_eval.core.check import CHECK_STATUSES


class Skipped(TypedDict):
    """A gate, or part of one, that measured nothing."""

    skipped: str
    """why"""


class EvidenceRecord(TypedDict):
    """core/evidence.py Evidence: what a check judged from."""

    unit: str
    """what one unit is: dispatch range, (range, expert) cell, question, text"""
    judged: int
    """units judged"""
    total: int
    """units given (judged or named not judged)"""
    required: int | None
    """the units a verdict needed (null: one judged unit)"""
    would_catch: str | None
    """the smallest effect failed with 80 % probability, in the gate's terms"""


class CheckRecord(TypedDict):
    """A check as results.json and summary.json write it (moe_eval.core.check.Check.as_dict)."""

    name: str
    """the check's name, e.g. accuracy_gate, golden_gate_decode, <gate>_not_run"""
    passed: bool
    """did not stand in the way of a pass (a skipped check did not either)"""
    detail: str
    """its numbers and rule, as the table prints them"""
    status: NotRequired[Literal[CHECK_STATUSES]]
    """passed, failed, not_run (required, could not measure), skipped (optional); absent in older records"""
    ran: NotRequired[Literal[False]]
    """present only for a gate called for that could not run"""
    evidence: NotRequired[EvidenceRecord]
    """what it judged from, where its gate counts it (absent before schema 9)"""


# --- the judged sections (moe_eval.gates.rules) -----------------------------------------------------------


class AccuracyGate(TypedDict):
    """gates/accuracy.py GateResult and the gate's power (gates/stats.py)."""

    metric: str
    """the lm-eval score gated: exact_match,strict-match"""
    accuracy: float
    """strict-match accuracy"""
    stderr: float
    """its standard error (lm-eval's)"""
    threshold: float
    """the config's accuracy_threshold"""
    tolerance: float
    """the config's tolerance"""
    tolerance_floor: float
    """threshold - tolerance"""
    stderr_k: float | None
    """the config's stderr_gate_k (null: not set)"""
    stderr_floor: float | None
    """threshold - stderr_k x stderr (null: stderr_k not set or stderr unknown)"""
    floor: float
    """the stricter of the two floors: the accuracy needed to pass"""
    margin: float
    """accuracy - floor"""
    margin_in_stderr: float | None
    """the margin in standard errors (null: stderr 0 or unknown)"""
    passed: bool
    """accuracy >= floor"""
    power: NotRequired[float]
    """the probability at which detectable_drop is caught (this and the next two: results.json only)"""
    detectable_drop: NotRequired[float | None]
    """the smallest drop of true accuracy the gate catches with that probability (null: it cannot fail)"""
    power_n: NotRequired[int]
    """questions the power was computed for"""


class PairedFlips(TypedDict):
    """gates/stats.py PairedResult: per-question flips against the incumbent, exact McNemar test."""

    n: int
    """questions both runs answered"""
    both_right: int
    """questions both runs answered right"""
    baseline_only_right: int
    """the incumbent right, this run wrong"""
    new_only_right: int
    """the incumbent wrong, this run right"""
    both_wrong: int
    """questions both runs answered wrong"""
    p_worse: float
    """one-sided p for 'this run is worse'"""
    p_two_sided: float
    """two-sided p (reported, not gated)"""
    alpha: float
    """the config's paired_alpha: fails when p_worse is below it and more flipped right -> wrong"""
    passed: bool
    """not (more flipped right -> wrong and p_worse < alpha)"""
    baseline: str
    """the incumbent's results.json"""


class DivergenceLimits(TypedDict):
    """Upper bounds (gates/divergence.py); null leaves the metric ungated."""

    max_mean_abs_dlogp: float | None
    """bound of mean_abs_dlogp"""
    max_p99_abs_dlogp: float | None
    """bound of p99_abs_dlogp"""
    max_top1_flip_rate: float | None
    """bound of top1_flip_rate"""
    max_kl_topk: float | None
    """bound of kl_topk"""


class LogprobDivergence(TypedDict):
    """gates/divergence.py Divergence: the scored texts' log-probabilities against the incumbent's."""

    texts: int
    """texts compared"""
    positions: int
    """positions compared, each text's first left out"""
    mean_abs_dlogp: float
    """mean |log p - log p_incumbent| of the text's own token"""
    p99_abs_dlogp: float
    """its 99th percentile"""
    max_abs_dlogp: float
    """its largest"""
    kl_topk: float
    """mean KL(incumbent || this run) on the shared top-k, renormalised"""
    kl_positions_skipped: int
    """positions with fewer than 2 shared top-k tokens, counted as KL 0"""
    top1_flips: int
    """positions whose most likely token differs"""
    top1_flip_rate: float
    """top1_flips / positions"""
    baseline: str
    """the incumbent's log-probabilities file"""
    limits: DivergenceLimits
    """the limits gated (the config's, else the defaults for the comparison)"""
    comparison: str
    """which limits applied: same kernel and layout, or another kernel or layout"""


class LayerCheckLimits(TypedDict):
    """gates/layer_gate.py LayerCheckLimits, from the config's layer_check_* keys."""

    margin: float
    """error / incumbent's error may reach 1 + margin"""
    scale_bound: float
    """an expert's |scale error| above this fails (beyond z too)"""
    z: float
    """standard normal errors whose tail gives the t quantile a cell must pass to fail"""
    activation_bound: float
    """the SiLU slope error's bound"""
    power: float
    """a cell is judged when it resolves a one-expert error this large"""
    min_judged: float
    """share of each reachable range's cells judged on every rank"""


class LayerRange(TypedDict):
    """One dispatch range (layer null: pooled over the layers) on one rank ('all': pooled over ranks)."""

    range: str
    """the dispatch range, e.g. M=17-64 (tokens per call)"""
    rank: str
    """e.g. TP0/2, EP1/2; all: pooled over the ranks"""
    layer: int | None
    """null: pooled over the layers"""
    calls_seen: int
    """MoE calls of the range"""
    calls_sampled: int
    """... of which compared with the exact MoE"""
    rows: int
    """token rows compared"""
    error: float | None
    """RMS |served - exact| / RMS |exact|"""
    incumbent_error: float | None
    """the same for the incumbent's arithmetic on the same rows"""
    ratio: float | None
    """error / incumbent_error"""
    nonfinite: int
    """served output elements NaN or inf where the exact MoE was finite"""


class ScaleCell(TypedDict):
    """A scale estimate against the exact MoE per (layer, range) and rank: an expert's or the SiLU slope's."""

    expert: NotRequired[int]
    """the expert, in an expert cell (absent in the activation's)"""
    range: str
    """the dispatch range"""
    rank: str
    """the rank; all: pooled over the ranks"""
    layer: int | None
    """null: pooled over the layers"""
    slots: int
    """routed (token, expert) slots estimated from"""
    scale: float
    """the scale error s estimated (0: exact)"""
    stderr: float | None
    """its standard error"""
    incumbent_scale: float
    """the incumbent arithmetic's estimate on the same slots"""
    diff_stderr: float | None
    """the standard error of scale - incumbent_scale"""
    dof: float | None
    """degrees of freedom of that error (gates/layer_estimates.py)"""
    z: float | None
    """(scale - incumbent_scale) / diff_stderr"""
    threshold: float | None
    """the t quantile |scale - incumbent_scale| / diff_stderr must reach to fail"""
    detectable: float | None
    """the scale error caught with 80 % probability"""


class LayerPower(TypedDict):
    """How much of one range one rank's check could judge."""

    range: str
    """the dispatch range"""
    rank: str
    """the rank; all: pooled over the ranks"""
    cells: int
    """(range, expert) cells owed: experts this rank holds that were routed in the range"""
    judged: int
    """... resolving a `power` one-expert error"""
    detectable_95: float | None
    """the error 95 % of the cells resolve (null: fewer than 95 % resolve any)"""
    layer_cells: int
    """(layer, range, expert) cells owed"""
    layer_judged: int
    """... resolving a `power` one-expert error"""
    unjudged: list[int]
    """the routed experts not judged"""
    not_routed: list[int]
    """held, never routed in this range"""
    least_routed: list[int] | None
    """[expert, slots routed]: the rarest routed expert of the range"""


class LayerCheck(TypedDict):
    """gates/layer_gate.py summary_record: the served MoE calls against the exact MoE."""

    processes: int
    """table files read (a process writes one per expert count it served)"""
    ranks: NotRequired[int]
    """distinct ranks among them: what coverage counts (absent before schema 9)"""
    world_size: int
    """the ranks the layout has"""
    layers: int
    """MoE layers in the tables"""
    counted_on: list[str]
    """device or host, per process"""
    max_tokens_per_call: int
    """the server's batched-token limit: the ranges it can reach"""
    limits: LayerCheckLimits
    """the limits judged by"""
    min_rows: int
    """rows a range needs before its error ratio is judged"""
    problems: list[str]
    """files that could not be read, missing ranks"""
    ranges: list[LayerRange]
    """pooled over the layers, and the layers judged off"""
    power: list[LayerPower]
    """per reachable range and rank"""
    activation: list[ScaleCell]
    """pooled over the layers, and the layers judged off"""
    expert_cells_off: int
    """cells judged off"""
    expert_cells: list[ScaleCell]
    """the off cells, and each (range, rank)'s largest"""


class GoldenErrors(TypedDict):
    """gates/golden_gate.py GoldenErrors: one capture against the golden over the scored texts."""

    texts: int
    """texts compared"""
    positions: int
    """positions compared, each text's first left out"""
    mean_abs: float
    """pooled mean |log p - log p_golden| of the reference tokens: the error"""
    per_text: list[float]
    """each text's mean |log p - log p_golden|, in text-index order"""
    per_text_positions: list[int]
    """each text's positions"""
    signed_mean: float
    """pooled mean of log p - log p_golden (> 0: the reference text more likely)"""
    texts_more_likely: int
    """texts whose mean signed shift is > 0"""
    kl_topk: float
    """mean KL(golden || capture) on the shared top-k"""
    top1_agreement: float
    """share of positions whose top-1 token is the golden's"""


class GoldenRule(TypedDict):
    """gates/golden_gate.py GoldenRuleResult: fails iff ratio > 1 + margin and p < alpha."""

    ratio: float
    """this run's error / the incumbent's"""
    paired_mean_diff: float
    """mean over texts of (this run's error - the incumbent's)"""
    t: float
    """the paired t statistic over texts"""
    p: float
    """one-sided paired t-test"""
    texts_worse: int
    """texts where this run's error is above the incumbent's"""
    texts: int
    """texts compared"""
    margin: float
    """the config's golden_margin"""
    alpha: float
    """the config's golden_alpha"""
    failed: bool
    """ratio > 1 + margin and p < alpha"""


class GoldenIncumbent(TypedDict):
    """The run standing as the incumbent (gates/rules.py incumbent_description) and its errors."""

    results: str
    """its results.json"""
    moe_backend_used: str
    """the kernel that served it"""
    layout: str | None
    """its layout, e.g. TP (TP1)"""
    same_layout: bool
    """the same layout as this config's"""
    role: str
    """vLLM's own kernel at the same layout, a stand-in at another, or your --baseline run"""
    errors: GoldenErrors
    """its errors against the golden"""


class GoldenPower(TypedDict):
    probability: float
    """the probability the scale error is caught with"""
    scale_error: float | None
    """the per-expert scale error caught with that probability (0: fails as it is; null: none up to 50 %)"""
    expert: int
    """the expert the probe scaled"""
    method: str
    """how the power was computed"""


class DecodeErrors(TypedDict):
    """gates/golden_gate.py DecodeErrors: greedy continuations against the golden's, while they agree."""

    texts: int
    """continuations compared"""
    tokens_generated: int
    """by the golden, all texts"""
    positions: int
    """compared: before the first token where the two part"""
    mean_abs: float | None
    """pooled mean |log p - log p_golden| over the top-k both list (null: no position)"""
    per_text: list[float | None]
    """each text's (null: no position shared)"""
    per_text_positions: list[int]
    """each text's positions compared"""
    identical_texts: int
    """continuations identical to the golden's to the end"""
    first_difference: list[int | None]
    """per text, the first position whose token differs (null: identical)"""


class DecodeComparison(TypedDict):
    run: DecodeErrors
    """this run's continuations against the golden's"""
    incumbent: DecodeErrors
    """the incumbent's"""
    rule: GoldenRule | None
    """null: fewer than 2 continuations share a first token with the golden's"""
    failed: NotRequired[str]
    """rule null and this run shares fewer first tokens than the incumbent: why it failed"""
    skipped: NotRequired[str]
    """rule null otherwise: why it was not judged"""


class GoldenGate(TypedDict):
    """gates/rules.py judge_golden; the first four only where the incumbent's errors could not be computed."""

    golden: str
    """the golden reference's digest"""
    run: GoldenErrors
    """this run's errors against the golden"""
    margin: float
    """the config's golden_margin"""
    alpha: float
    """the config's golden_alpha"""
    incumbent: NotRequired[GoldenIncumbent]
    """the incumbent and its errors against the golden"""
    rule: NotRequired[GoldenRule]
    """the rule on this run's errors against the incumbent's"""
    ratio: NotRequired[float]
    """rule.ratio"""
    p: NotRequired[float]
    """rule.p"""
    passed: NotRequired[bool]
    """not rule.failed"""
    power: NotRequired[GoldenPower]
    """the smallest per-expert scale error the rule catches"""
    decode: NotRequired[DecodeComparison | Skipped]
    """the greedy continuations against the golden's, or {skipped}"""


class SpeedRange(TypedDict):
    """gates/speed.py RangeSpeed: one dispatch range's MoE calls against the reference's, size for size."""

    range: str
    """the dispatch range, e.g. M=17-64 (tokens per call)"""
    us: float | None
    """this row's mean call in the range, microseconds (null: this row made no call there)"""
    reference_us: float | None
    """the reference's (null: it made no call there)"""
    ratio: float | None
    """the matched sizes' ratio, weighted by the reference's time at each (null: not judged); in records
    before schema 9, us / reference_us"""
    calls: int
    """this row's calls at the matched sizes, on the slowest rank (before schema 9: every call timed)"""
    reference_calls: int
    """the reference's"""
    passed: bool | None
    """null: not judged"""
    why_not: str | None
    """why it was not judged"""
    z: NotRequired[float | None]
    """the excess over the margin in standard errors (fails beyond the section's z)"""
    fails_above: NotRequired[float | None]
    """the ratio above which this range fails at its errors: the slowdown it sees half the time"""
    would_catch: NotRequired[float | None]
    """the slowdown it fails with 80 % probability (absent before schema 9)"""
    replayed: NotRequired[bool]
    """a graph-replayed range (most of either row's time in CUDA-graph replays): a pass needs it judged"""
    margin: NotRequired[float | None]
    """the margin it was judged with: speed_margin (graph-replayed) or speed_margin_eager"""
    sizes_matched: NotRequired[int]
    """the call sizes compared"""
    sizes: NotRequired[int]
    """the call sizes either row made in the range"""
    matched_share: NotRequired[float | None]
    """the smaller of the two rows' shares of their time in the range held by the matched sizes"""
    unsteady: NotRequired[list[int]]
    """sizes left out: a mean whose standard error was over max_relative_error of it"""
    between_servers: NotRequired[float | None]
    """the floor: what a mean moves between two servers of one kernel, a log standard deviation per server,
    weighted over the matched sizes"""
    eager_share: NotRequired[float | None]
    """(records before schema 9) the larger of the two rows' shares of the range's time in eager calls"""


class SpeedGate(TypedDict):
    """gates/speed.py speed_check: per range, the matched call sizes' ratio against the reference's; a range
    fails beyond (1 + margin) and z standard errors (within-run errors and the between-server floor)."""

    reference: str
    """the reference row's results.json (the incumbent, or --baseline's row)"""
    rule: NotRequired[str]
    """matched call sizes (absent before schema 9: range means)"""
    margin: float
    """the config's speed_margin, for graph-replayed ranges"""
    margin_eager: NotRequired[float]
    """the config's speed_margin_eager, for eager ranges"""
    min_calls: int
    """matched calls per rank a range needs to be judged"""
    min_size_calls: NotRequired[int]
    """calls per rank a size needs in both rows to be matched"""
    min_matched_share: NotRequired[float]
    """the share of each row's range time the matched sizes must hold"""
    z: NotRequired[float]
    """standard errors beyond the margin a range fails at"""
    max_relative_error: NotRequired[float]
    """a size whose mean has a standard error above this share of it is left out"""
    between_servers: NotRequired[dict[str, float]]
    """the floor's constants: replayed and eager log standard deviations per server"""
    eager_between_servers: NotRequired[float]
    """(records before schema 9)"""
    timed_on: list[str]
    """device (every call, CUDA-graph replays included) or host"""
    ranges: list[SpeedRange]
    """every range either row timed, judged or not"""
    judged: NotRequired[int]
    """ranges judged"""
    required_not_judged: NotRequired[list[str]]
    """graph-replayed ranges either row reached that were not judged: no pass stands without them"""
    evidence: NotRequired[EvidenceRecord]
    """ranges judged of those given, and the least sensitive judged range's would_catch"""
    gated: NotRequired[bool]
    """false: reported only (the CPU), no check made"""
    worst_ratio: NotRequired[float | None]
    """the largest failing ratio where a range failed, else the largest judged one; absent when no range was
    judged"""
    worst_range: NotRequired[str]
    """the range of worst_ratio"""


# --- the captures the speed gate and the layer check are fed by (moe_eval.runner) -------------------------


class SizeTiming(TypedDict):
    """core/moe_timing.py SizeTiming: the calls of one size on the rank whose mean there was slowest."""

    tokens: int
    """the call size M (the timer's last cell holds every larger call)"""
    calls: int
    """that rank's calls of this size"""
    mean_us: float
    """their mean, microseconds"""
    spread_us: float
    """one call's standard deviation"""
    replayed: int
    """of them, CUDA-graph replays"""
    experts: NotRequired[float | None]
    """the mean distinct experts the calls' routing hit (null: not counted)"""
    experts_spread: NotRequired[float | None]
    """their standard deviation"""
    slope_us: NotRequired[float | None]
    """the calls' line of time against the experts hit: us per expert"""
    residual_us: NotRequired[float | None]
    """one call's standard deviation about that line (the speed gate's error where counted)"""


class RangeTiming(TypedDict):
    """core/moe_timing.py RangeTiming: one dispatch range's MoE calls in the timed workload."""

    range: str
    """the dispatch range, e.g. M=17-64 (tokens per call)"""
    calls: int
    """over every process"""
    tokens: int
    """tokens over every process"""
    mean_us: float
    """per call: the slowest process's mean"""
    spread_us: float
    """that process's standard deviation of one call"""
    us_per_token: float
    """every process's time / tokens"""
    replayed: NotRequired[int | None]
    """calls that were CUDA-graph replays, over every process (the rest ran eagerly); null or absent in
    records before it was counted"""
    eager_share: NotRequired[float | None]
    """the share of the slowest process's time in calls that were not CUDA-graph replays; null or absent in
    records before it was counted"""
    sizes: NotRequired[list[SizeTiming] | None]
    """per call size in the range, the slowest rank's calls (absent or null before schema 9)"""
    rank_calls: NotRequired[int | None]
    """the fewest calls one rank made in the range (0: a rank made none)"""


class MoeTiming(TypedDict):
    """core/moe_timing.py TimingSummary."""

    processes: int
    """server processes whose timer was read"""
    timed_on: list[str]
    """device (every call, CUDA-graph replays included) or host"""
    scopes: list[str]
    """what the timer bracketed, per process"""
    backends: list[str]
    """the MoE kernels timed"""
    ranges: list[RangeTiming]
    """the ranges the workload reached"""
    problems: list[str]
    """why a process could not time on the device"""


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
    """requests it sent (absent in the first records of the rounds)"""
    owed_after: NotRequired[dict[str, int]]
    """per range, the cells still owed after it"""


class TopUp(TypedDict):
    """More units of the ranges the sweep called too few times for the speed gate (evaluate/moe_speed.py)."""

    units: dict[str, int]
    """per range, the units sent"""
    requests: int
    """requests they took"""


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
    """requests sent"""
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
    layer_check_paused: NotRequired[bool | str]
    """a layer-checked row's timed requests: true where every process of the check said it paused before
    them; else why not (the check may then have sampled some of them); absent: no check on the row, or a
    record made before commit 36f5692 (the check sampled them all)"""
    layer_check_resumed: NotRequired[str]
    """why not every process of the check said it resumed after the timed requests (absent: they all did):
    the check's own sweep may have started with one still paused"""
    prefix_cache_hit_tokens: NotRequired[int | None]
    """prompt tokens of the timed requests (the sweep and its top-up, not the layer check's rounds) that the
    server's prefix cache served (0: every call as sent; null: its /metrics did not say; absent: not timed);
    the speed gate compares rows whose counts match"""


class TimingCapture(TypedDict):
    """The timed workload (runner.py): the MoE calls' time per range, the client's view, the requests."""

    moe: MoeTiming
    """the served MoE calls' time per dispatch range"""
    end_to_end: EndToEnd
    """the client's view"""
    eval_output_tokens_per_s: float | None
    """the GSM8K eval's generated tokens per wall second (null: not counted)"""
    workload: Workload
    """the requests timed"""
