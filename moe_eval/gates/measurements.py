"""What the judge reads and writes: a config's measurements (the runner fills them; no file, no server here)
and the judgement they give (checks, verdict, results.json sections)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_eval.core.check import Check
from moe_eval.core.logprob_texts import TextLogprobs
from moe_eval.core.moe_timing import TimingSummary
from moe_eval.core.repeated_scoring import RepeatSection

if TYPE_CHECKING:
    from moe_eval.gates.layer_summary import LayerSummary


@dataclass(frozen=True)
class IncumbentRow:
    """The incumbent a row is compared with (evaluate/incumbent.py reads it from a finished run): its
    per-question correctness (the paired gate), where it scored them its log-probabilities and greedy
    continuations (divergence, golden), its MoE timing and where it was timed (speed)."""

    results_path: Path
    correctness: dict[int, bool]
    logprobs_path: Path | None = None
    moe_backend_used: str | None = None  # what its server's log said served ("bundled:torch", "vllm:CPU")
    layout: str | None = None  # Layout.describe() of its config
    decode_path: Path | None = None  # its greedy continuations (DECODE_FILE), where it made them
    speed: TimingSummary | None = None  # its MoE calls' time per range (captures.timing), where timed
    machine: str | None = None  # the GPUs (or CPU) it ran on: a speed reference holds on that machine only
    workload: str | None = None  # what its timed sweep computed (speed.workload_identity): must match
    speed_warnings: tuple[str, ...] = ()  # its server's (serving.speed_warnings_logged)
    world_size: int = 1  # the ranks of its layout: the processes its timing must come from
    cards: str | None = None  # its GPUs' UUIDs (speed.cards_of): other cards of one model differ by a few %


@dataclass(frozen=True)
class Answers:
    """The evaluation: lm-eval's scores, the answers' counts (checks.answer_stats), per-question
    strict-match correctness."""

    scores: dict[str, dict[str, float]]
    num_questions: int  # the questions lm-eval scored (distinct questions in its samples)
    stats: dict[str, Any]
    correctness: dict[int, bool]
    asked: int | None = None  # questions asked of lm-eval: the config's, at most the task's (None: unknown)


@dataclass(frozen=True)
class GoldenRecord:
    """The golden reference's captures (moe_eval.evaluate.golden.Golden) as the judge needs them."""

    digest: str
    path: str
    prefill: list[TextLogprobs]
    decode: list[TextLogprobs]
    probe: list[TextLogprobs]
    # The probe's one-expert scale error (its captures were made with expert 0's output this much short):
    # the golden record says it, so the judge needs nothing of the code that made it.
    probe_scale_error: float


@dataclass
class Measurements:
    """Everything a config's run measured; None where it measured nothing of that kind."""

    moe_backend_used: str | None = None
    answers: Answers | None = None
    jit: dict[str, Any] | None = None  # server_log.jit_while_serving
    kernel_calls: dict[str, Any] | None = None  # kernels.call_counter counts
    layer: LayerSummary | None = None
    logprobs: list[TextLogprobs] | None = None  # the scored texts (prefill)
    decode: list[TextLogprobs] | None = None  # the greedy continuations
    logprobs_skipped: str | None = None  # why the texts were not scored (results.json logprobs.skipped)
    incumbent: IncumbentRow | None = None
    incumbent_logprobs: list[TextLogprobs] | None = None
    incumbent_decode: list[TextLogprobs] | None = None
    golden: GoldenRecord | None = None
    speed: TimingSummary | None = None  # the timed workload's MoE calls per range (evaluate/moe_speed.py)
    machine: str | None = None  # where they ran (checks.machine_of): a speed reference must match it
    workload: str | None = None  # what the timed sweep computed (checks.workload_identity)
    cards: str | None = None  # the GPUs' UUIDs (speed.cards_of): is the speed reference from these cards?
    repeat: RepeatSection | None = None  # the scored texts against their second scoring (gates/repeat.py)
    speed_warnings: list[str] = field(default_factory=list)  # server_log.speed_warnings: named with its speed
    not_measured: dict[str, str] = field(default_factory=dict)  # gate name -> why nothing was measured


@dataclass
class Judgement:
    checks: list[Check]
    verdict: str
    sections: dict[str, Any]  # results.json sections: gate, paired, divergence, layer_check, golden_gate
