"""The run record: one config's results.json and the run's summary.json, as types.

The only module that reads and writes them. Each file is a flat JSON object (readers keep their keys); in
Python it is a set of sections, each a dataclass whose fields are those keys:

    identity     which config, as what file, under which mutation
    environment  where it ran: hardware, versions, the questions' source, the model, the server
    serving      what the server's log and counters said: the kernel that served, its calls, compilations
    evaluation   lm-eval's answers and scores
    captures     what was captured for the gates: log-probabilities, decode continuations, the layer sweep,
                 the golden reference used
    judged       each gate's section (moe_eval.gates.judge), keyed by the gate's `section` name: a mapping, so
                 that core knows no gate (the registry, moe_eval.gates.registry, does)
    verdict      the checks and the status
    bookkeeping  timings, attempts, progress, errors and cancellation

docs/results.schema.json and docs/summary.schema.json are generated from these types
(`python -m moe_eval.report.record_schema`), and a test holds the committed files to them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_eval.core.captures import TimingCapture, Workload
from moe_eval.core.check import STATUSES, VERDICTS, Check
from moe_eval.core.results import atomic_write_json

# results.json's layout; CHANGELOG.md says what each version added. A reader takes every version up to this
# one: a key a version added is absent from older records (the field's default), and Check reads a check
# written before `status` (10) from its `passed` and `ran`.
RESULTS_SCHEMA_VERSION = 11
RESULTS_FILE = "results.json"  # one per config run folder
SUMMARY_FILE = "summary.json"  # one per run folder

JsonObject = dict[str, Any]

# Field metadata, as pydantic's Field reads it (moe_eval.report.record_schema): `description` (the schema's),
# `pattern`, `json_schema_extra` (an enum), and for an optional field `exclude_if`: left out of the record
# while None, as a stage that never ran leaves its keys out; every other field is written on every record.


def key(
    doc: str,
    *,
    optional: bool = False,
    default: Any = None,
    factory: Any = None,
    enum: tuple[str, ...] | None = None,
    pattern: str | None = None,
) -> Any:
    """A record field: its JSON key is the field's name."""
    metadata: dict[str, Any] = {"description": doc}
    if optional:
        metadata["exclude_if"] = _is_none
    if enum is not None:
        metadata["json_schema_extra"] = {"enum": list(enum)}
    if pattern is not None:
        metadata["pattern"] = pattern
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _is_none(value: Any) -> bool:
    return value is None


# --- small typed objects -----------------------------------------------------------------------------


@dataclass
class LayoutInfo:
    kind: str = key("TP, TEP or DEP", enum=("TP", "TEP", "DEP"), default="TP")
    describe: str = key("as the table prints it, e.g. 'TEP (TP2, EP)'", default="")
    world_size: int = key("GPUs (or CPU ranks) one server uses", default=1)


@dataclass
class Hardware:
    selected: str = key("run --hw", default="")
    gpus: list[str] = key("the GPUs nvidia-smi named", factory=list)
    cpu: str = key("the CPU model", default="")
    gpu_uuids: list[str] | None = key(
        "the UUIDs (nvidia-smi) of the GPUs its server could use: which physical cards, so a speed reference "
        "from other cards of the same model is known as such (absent: the CPU, or a record from before "
        "2026-12-06)",
        optional=True,
    )


@dataclass
class ServerInfo:
    argv: list[str] = key("the vLLM command line", factory=list)
    port: int = key("its port", default=0)
    env: dict[str, str] = key("the environment it was given (allowlisted names only)", factory=dict)
    log: str = key("server.log's path", default="")
    devices: list[int] | None = key("the GPUs it ran on (CUDA_VISIBLE_DEVICES), null on the CPU")


@dataclass
class RunError:
    type: str = key("the exception's type (Cancelled for a signal)", default="")
    message: str = key("what went wrong, naming the file, key and value where there is one", default="")
    exit_code: int | None = key("the exit code it maps to; absent for an internal error", optional=True)


@dataclass
class EvalProgress:
    answered: int = key("questions answered when the config ended", default=0)
    total: int = key("questions asked", default=0)
    strict_match_so_far: float | None = key("strict-match accuracy over the answered ones")


@dataclass
class Attempt:
    attempt: int = key("1 for the first", default=1)
    status: str = key("how it ended", default="error")
    error: str | None = key("its error message")
    folder: str = key("where its files are kept, relative to the config's folder", default="")


# --- the sections of results.json -----------------------------------------------------------------------


@dataclass
class Identity:
    config_path: str = key("the config file", default="")
    config_sha256: str = key("sha256 of the config file's text", default="", pattern="^[0-9a-f]{64}$")
    config_name: str = key("the config file's stem", default="")
    config: JsonObject = key("every config key with its effective value", factory=dict)
    layout: LayoutInfo = key("the parallel layout of its server_args", factory=LayoutInfo)
    mutation: str | None = key("run --mutate: the bug put into the bundled kernel (vLLM's is never mutated)")


@dataclass
class Environment:
    hardware: Hardware = key("the machine", factory=Hardware)
    versions: dict[str, str | None] = key(
        "installed versions (moe-eval, vllm, torch, triton, ...)", factory=dict
    )
    rules: str | None = key(
        "sha256 (16 hex digits) of the code that judged the row (moe_eval/gates and moe_eval/core): "
        "run --resume keeps a row only under the same; absent before schema 9",
        optional=True,
    )
    gsm8k: JsonObject = key(
        "where the questions came from: hub, local (with sha256) or generated", factory=dict
    )
    model_path: str | None = key("the model served (a folder or a hub name)", optional=True)
    server: ServerInfo | None = key("the vLLM server as launched", optional=True)


@dataclass
class Serving:
    moe_backend_requested: str | None = key("the config's moe_backend (null: vLLM's own kernel)")
    moe_backend_used: str | None = key(
        "what the server's log said served, e.g. 'bundled:triton', 'vllm:TRITON'"
    )
    vllm_moe_backends_logged: list[str] = key("vLLM's own MoE backend lines", factory=list)
    bundled_kernel_logged: list[JsonObject] = key(
        "the plugin's line per process and layer kind", factory=list
    )
    bundled_kernel_calls: JsonObject = key(
        "the bundled kernel's own call counters, summed over processes (read_unflushed: the counter and "
        "layer-check files read before their process had copied them after the last request)",
        factory=dict,
    )
    jit_while_serving: JsonObject = key("kernel compilations after the server was ready", factory=dict)
    speed_warnings_logged: list[str] | None = key(
        "the server's warnings that bear on its kernels' speed (FlashInfer's autotune fell back to default "
        "tactics), each with how many times it was logged; absent from records before version 7",
        optional=True,
    )
    gpu_memory_logged: JsonObject = key(
        "GiB for weights, KV cache and CUDA graphs, per process", factory=dict
    )


@dataclass
class Evaluation:
    scores: dict[str, dict[str, float | None]] | None = key(
        "per lm-eval filter: accuracy and stderr", optional=True
    )
    num_questions_evaluated: int | None = key("questions lm-eval scored", optional=True)
    answers: JsonObject | None = key("empty, invalid, truncated answer counts", optional=True)
    lm_eval: JsonObject | None = key("the lm-eval model and generation arguments", optional=True)
    samples: str | None = key("the per-question samples file, beside results.json", optional=True)


@dataclass
class Captures:
    logprobs: JsonObject | None = key("the scored texts' file and counts, or {skipped: why}", optional=True)
    decode: JsonObject | None = key("the greedy continuations' file and counts", optional=True)
    layer_sweep: Workload | None = key("the requests sent to reach every dispatch range", optional=True)
    golden: JsonObject | None = key(
        "the golden reference used: its digest, key, made now or cached", optional=True
    )
    timing: TimingCapture | None = key(
        "the timed workload: per dispatch range the served MoE calls' time (moe), the client's end-to-end "
        "view (end_to_end), the requests (workload), the GSM8K eval's output tokens per second",
        optional=True,
    )


@dataclass
class Verdict:
    checks: list[Check] = key(
        "every check made; ran false: a gate called for that could not run", factory=list
    )
    status: str = key("how the config ended", default="error", enum=STATUSES)


@dataclass
class Bookkeeping:
    started_at: str = key("local time, %Y-%m-%dT%H:%M:%S%z", default="")
    finished_at: str = key("local time, %Y-%m-%dT%H:%M:%S%z", default="")
    attempt: int = key("this attempt (run --retries)", default=1)
    attempts: list[Attempt] | None = key("earlier attempts, oldest first", optional=True)
    timings: dict[str, float] = key(
        "seconds per stage: startup, eval, logprob, decode, golden, total ...", factory=dict
    )
    progress: EvalProgress | None = key("how far the evaluation got", optional=True)
    error: RunError | None = key("why the config ended without a verdict", optional=True)
    cancelled_by: str | None = key("the signal that stopped the run (SIGTERM, SIGINT)", optional=True)


SECTION_TYPES = {
    "identity": Identity,
    "environment": Environment,
    "serving": Serving,
    "evaluation": Evaluation,
    "captures": Captures,
    "verdict": Verdict,
    "bookkeeping": Bookkeeping,
}
_FIELD_NAMES = [f.name for kind in SECTION_TYPES.values() for f in dataclasses.fields(kind)]
# The sections share one JSON object: two fields of one name would write one key and lose a value (seen: a
# capture and a judged section both named "speed", the judged one overwrote the capture on the H200).
assert len(_FIELD_NAMES) == len(set(_FIELD_NAMES)), "results.json sections must not share a field name"


_KNOWN_KEYS = {*_FIELD_NAMES, "schema_version"}


class UnreadableRecord(ValueError):
    """A results.json that is missing, not JSON, not an object, or of a schema newer than this moe-eval's."""


# --- JSON <-> types ------------------------------------------------------------------------------------


def to_json(obj: Any) -> Any:
    """A typed object as JSON values: dataclass fields by name, optional ones left out while None."""
    if isinstance(obj, Check):
        return obj.as_dict()
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if "exclude_if" in f.metadata and f.metadata["exclude_if"](value):
                continue
            out[f.name] = to_json(value)
        return out
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    return obj


def _from_json(cls: type, data: dict[str, Any]) -> Any:
    """A dataclass from its JSON object: a key missing takes the field's default (records of older writers
    and partial ones); nested typed objects are built by their own type."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        values[f.name] = _typed(_NESTED.get((cls, f.name)), data[f.name])
    return cls(**values)


def _typed(kind: Any, value: Any) -> Any:
    """A typed field's JSON value as its type; TypeError (UnreadableRecord at `read`) for JSON of another
    shape, so that a bad file is refused where it is read, not later where a property meets it."""
    if kind is None or value is None:
        return value
    if isinstance(kind, list):  # [Type]: a list of it
        if not isinstance(value, list):
            raise TypeError(f"a list expected, got {type(value).__name__}")
        return [_typed(kind[0], v) for v in value]
    if not isinstance(value, dict):
        raise TypeError(
            f"an object expected for {getattr(kind, '__name__', kind)}, got {type(value).__name__}"
        )
    return Check.from_dict(value) if kind is Check else _from_json(kind, value)


# Which fields hold typed objects (the rest are JSON values as they are).
_NESTED: dict[tuple[type, str], Any] = {
    (Identity, "layout"): LayoutInfo,
    (Environment, "hardware"): Hardware,
    (Environment, "server"): ServerInfo,
    (Verdict, "checks"): [Check],
    (Bookkeeping, "attempts"): [Attempt],
    (Bookkeeping, "progress"): EvalProgress,
    (Bookkeeping, "error"): RunError,
}


@dataclass
class RunRecord:
    """One config's results.json: loaded and checked by `read`, written whole and atomically by `write`."""

    identity: Identity = field(default_factory=Identity)
    environment: Environment = field(default_factory=Environment)
    serving: Serving = field(default_factory=Serving)
    evaluation: Evaluation = field(default_factory=Evaluation)
    captures: Captures = field(default_factory=Captures)
    # Each gate's section by its key ("gate", "layer_check", "speed", ...): every top-level key that is not a
    # field of the other sections (a newer writer's too, kept as it was on a rewrite; inside a typed object,
    # such as an attempt or a check, an unknown key is not kept).
    judged: JsonObject = field(default_factory=dict)
    verdict: Verdict = field(default_factory=Verdict)
    bookkeeping: Bookkeeping = field(default_factory=Bookkeeping)
    schema_version: int = RESULTS_SCHEMA_VERSION
    path: Path | None = None  # where it was read from or is written to; not part of the file

    # --- the file ---

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema_version": self.schema_version}
        for name in SECTION_TYPES:
            out.update(to_json(getattr(self, name)))
        judged: dict[str, Any] = to_json(self.judged)
        return out | judged

    @classmethod
    def from_json(cls, data: dict[str, Any], path: Path | None = None) -> RunRecord:
        sections = {name: _from_json(kind, data) for name, kind in SECTION_TYPES.items()}
        judged = {k: v for k, v in data.items() if k not in _KNOWN_KEYS}
        return cls(**sections, judged=judged, schema_version=data.get("schema_version", 1), path=path)

    @classmethod
    def read(cls, path: Path) -> RunRecord:
        """UnreadableRecord (naming the file) when the file cannot be read as a record of a known schema."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UnreadableRecord(f"{path}: cannot read a results record ({exc})") from None
        if not isinstance(data, dict):
            raise UnreadableRecord(f"{path}: not a results record (a JSON {type(data).__name__})")
        version = data.get("schema_version", 1)
        if not isinstance(version, int) or version > RESULTS_SCHEMA_VERSION:
            raise UnreadableRecord(
                f"{path}: results schema version {version!r}; this moe-eval reads up to "
                f"{RESULTS_SCHEMA_VERSION}"
            )
        try:
            return cls.from_json(data, path)
        except (TypeError, AttributeError, KeyError) as exc:  # a section of the wrong JSON type
            raise UnreadableRecord(f"{path}: not a results record ({exc})") from None

    @classmethod
    def read_if_any(cls, path: Path) -> RunRecord | None:
        """The record, or None where the file is missing or unreadable (a config that never got to write)."""
        try:
            return cls.read(path)
        except UnreadableRecord:
            return None

    def write(self, path: Path | None = None) -> None:
        target = path or self.path
        if target is None:
            raise ValueError("RunRecord.write: no path")
        atomic_write_json(target, self.to_json())

    # --- the questions its readers ask ---

    @property
    def status(self) -> str:
        return self.verdict.status

    @property
    def has_verdict(self) -> bool:
        """The config ran to its gates (what --baseline, --resume and compare can use)."""
        return self.status in VERDICTS

    @property
    def config(self) -> JsonObject:
        return self.identity.config

    @property
    def layout(self) -> str | None:
        return self.identity.layout.describe or None

    @property
    def mutation(self) -> str | None:
        return self.identity.mutation

    @property
    def attempt(self) -> int:
        return self.bookkeeping.attempt

    @property
    def error_message(self) -> str:
        return self.bookkeeping.error.message if self.bookkeeping.error else ""

    @property
    def accuracy(self) -> float | None:
        """strict-match accuracy, where the config was evaluated."""
        return ((self.evaluation.scores or {}).get("strict-match") or {}).get("accuracy")

    def check(self, name: str) -> Check | None:
        return next((c for c in self.verdict.checks if c.name == name), None)


def result_files(root: Path) -> list[Path]:
    """Every config's results.json under a run folder, leaving out earlier attempts (attempts/<n>/)."""
    return sorted(p for p in root.rglob(RESULTS_FILE) if "attempts" not in p.relative_to(root).parts[:-1])


def records(root: Path) -> list[RunRecord]:
    """Every config's record under a run folder (a file that cannot be read: UnreadableRecord)."""
    return [RunRecord.read(p) for p in result_files(root)]


# --- summary.json --------------------------------------------------------------------------------------


@dataclass
class SummaryEntry:
    config: str = key("the config file", default="")
    status: str = key(
        "how it ended; not_started: the run stopped first",
        default="not_started",
        enum=(*STATUSES, "not_started"),
    )
    run_dir: str | None = key("its folder in the run")
    error: str | None = key("its error message")
    gate: JsonObject | None = key(
        "the accuracy gate's section (results.json `gate`; null: not judged, or random weights)"
    )
    checks: list[Check] = key("its checks", factory=list)
    moe_backend_used: str | None = key("the kernel that served")
    attempts: int = key("attempts made (run --retries); 0: not started", default=0)
    resumed: bool = key("kept from the folder given to run --resume", default=False)


@dataclass
class RunSummary:
    """The run's summary.json: one entry per config selected."""

    hw: str = key("run --hw", default="")
    source: str = key("where the configs came from", default="")
    run_root: str = key("the run folder", default="")
    complete: bool = key("every config ran to its end, none cancelled", default=False)
    cancelled_by: str | None = key("the signal that stopped the run")
    configs: list[SummaryEntry] = key("one entry per config", factory=list)

    def write(self, run_root: Path) -> None:
        atomic_write_json(run_root / SUMMARY_FILE, to_json(self))

    @classmethod
    def read(cls, path: Path) -> RunSummary:
        """ValueError (naming the file) when it is not a summary."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            summary: RunSummary = _from_json(cls, data)
            return summary
        except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
            raise ValueError(f"{path}: cannot read a run summary ({exc})") from None


_NESTED[(RunSummary, "configs")] = [SummaryEntry]
_NESTED[(SummaryEntry, "checks")] = [Check]
