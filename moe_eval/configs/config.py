"""Per-model eval configs: a strict superset of the YAML that vLLM's GSM8K harness reads.

The YAML is one flat mapping. The keys of the run (what it serves and measures) are EvalConfig's fields; the
keys of how a gate judges are that gate's own (its module's `@gate_keys` class, the registry row's `keys`),
read as `config.keys(SpeedKeys)`: a gate's key is added in the gate's module alone. Each key has its type,
range, default and doc; an unknown key, a wrong type or an out-of-range value is a ConfigError naming the
file, the key and the value. Usage:

    config = load_config(Path("configs/moe-refactor/Qwen3-30B-A3B-BF16-triton.yaml"))
"""

from __future__ import annotations

import dataclasses
import hashlib
import shlex
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, TypeVar, cast

import yaml
from pydantic import AfterValidator, ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from moe_eval.core.errors import ConfigError
from moe_eval.core.layout import Layout, layout_from_server_args
from moe_eval.gates import registry
from moe_eval.gates.gate import GateConfig

GSM8K_TEST_QUESTIONS = 1319
# The golden gate's paired test over texts: below this many texts its p-value and its power analysis are
# too coarse to decide (docs/logprob-gate.md); such a config sets more logprob_texts or golden: false.
MIN_GOLDEN_TEXTS = 8


class NamedBackend(NamedTuple):
    """The MoE kernel a config's file name says it runs (STYLE: names agree with content)."""

    bundled: str | None  # the bundled backend a config may ask for (moe_backend)
    vllm: str | None  # vLLM's name for that kernel in its selection log line (a config leaving it to vLLM)


# File-name suffix -> the kernel it names; "-torch" has no vLLM counterpart.
NAME_SUFFIX_BACKEND = {
    "-triton": NamedBackend("triton", "TRITON"),
    "-fi-cutlass": NamedBackend("flashinfer_cutlass", "FlashInfer CUTLASS"),
    "-torch": NamedBackend("torch", None),
}


def backend_named_by(stem: str) -> NamedBackend:
    """The kernel a config file's stem names by its suffix; both fields None when it names none."""
    return next(
        (b for suffix, b in NAME_SUFFIX_BACKEND.items() if stem.endswith(suffix)), NamedBackend(None, None)
    )


# moe-eval sets these itself (the model it resolved, a free port on loopback, the config's seed key).
RESERVED_SERVER_FLAGS = ("--model", "--port", "--host", "--seed")


def _shell_splittable(v: str) -> str:
    try:
        words = shlex.split(v)
    except ValueError as exc:
        raise ValueError(f"is not a valid shell-quoted argument string ({exc})") from None
    for flag in (word.split("=", 1)[0] for word in words):
        if flag in RESERVED_SERVER_FLAGS:
            raise ValueError(f"sets {flag}, which moe-eval sets itself (use model_name, --port or seed)")
    return v


def _single_spaced(v: str) -> str:
    return " ".join(v.split())  # folded YAML strings keep their newlines; vLLM wants words


def _str_values(v: dict[Any, Any]) -> dict[str, str]:
    for key, value in v.items():
        if not isinstance(key, str) or not isinstance(value, (str, int, float, bool)):
            raise ValueError(f"must map strings to strings (entry {key!r}: {value!r})")
    return {k: str(val) for k, val in v.items()}


ServerArgs = Annotated[str, AfterValidator(_shell_splittable), AfterValidator(_single_spaced)]
Env = Annotated[dict[Any, Any], AfterValidator(_str_values)]  # YAML scalars, kept as strings
# A YAML list; lax (not strict) so that the list becomes a tuple, a frozen config's value. The names are the
# registry's gates (parse_config checks them).
GateNames = Annotated[tuple[str, ...], Field(strict=False)]


# Strict: a string "0.5" is not a number and a bool not an integer (an integer is a number); a key that is not
# a field is an error. kw_only lets a required key follow one with a default (the keys keep their order).
@dataclass(frozen=True, kw_only=True, config=ConfigDict(strict=True, extra="forbid"))
class EvalConfig:
    path: Path
    sha256: str
    # --- vLLM's GSM8K harness keys ---
    model_name: str = Field(
        description="hub id, local checkpoint dir, or builtin:<name> (built on first use)"
    )
    accuracy_threshold: float | None = Field(  # None only with random_weights (parse_config checks)
        None, ge=0.0, le=1.0, description="expected strict-match accuracy (required unless random_weights)"
    )
    num_questions: int = Field(ge=1, le=GSM8K_TEST_QUESTIONS, description="GSM8K test questions")
    num_fewshot: int = Field(ge=0, le=20, description="few-shot examples from the train split")
    server_args: ServerArgs = Field("", description="extra `vllm serve` arguments, shell-split")
    env: Env = Field(
        default_factory=dict, description="environment for the server only, merged over os.environ"
    )
    tolerance: float = Field(0.08, ge=0.0, le=1.0, description="pass iff accuracy >= threshold - tolerance")
    startup_max_wait_seconds: float = Field(1200, gt=0, description="server must be ready within this")
    max_tokens: int = Field(256, gt=0, description="generation limit per answer")
    temperature: float = Field(0.0, ge=0, description="sampling temperature")
    seed: int = Field(42, ge=0, description="server and sampling seed")
    # None: from the run's hardware (effective_config): DEFAULT_CONCURRENCY.
    max_concurrency: int | None = Field(
        None,
        gt=0,
        description="concurrent requests from lm-eval; absent: 16 for --hw cpu, 256 on GPUs (docs/perf.md, "
        '"The eval\'s concurrency")',
    )
    request_timeout_seconds: float = Field(600, gt=0, description="per-request timeout")
    # --- moe-eval keys ---
    # absent: vLLM's own MoE path
    moe_backend: Literal["triton", "flashinfer_cutlass", "torch"] | None = Field(
        None, description="bundled MoE kernel the server must use"
    )
    task: Literal["gsm8k", "canary"] = Field(
        "gsm8k", description="gsm8k, or canary (the canary model's generated task)"
    )
    max_retries: int = Field(
        3, ge=0, description="retries of a failed request before the run is an infra error"
    )
    # --- what the row measures beyond its answers (moe_eval.steps); how each gate judges it is the gate's
    # own keys (moe_eval.gates.<gate>.*Keys, read as config.keys(...)) ---
    logprob_texts: int = Field(
        64,
        ge=0,
        le=GSM8K_TEST_QUESTIONS,
        description="texts scored for log-probabilities after the evaluation (few-shot block + the "
        "reference answer of the first N questions); 0: none",
    )
    baseline_config: str | None = Field(
        None,
        description="a config (path relative to this file) run first in the same run; "
        "its answers and log-probabilities are this config's baseline",
    )
    # the golden reference (moe_eval.evaluate.golden; docs/logprob-gate.md)
    golden: bool = Field(
        True,
        description="a bundled-kernel config with a baseline and logprob_texts > 0: compare its error "
        "against an exact golden reference with the incumbent's (the baseline's); false: off",
    )
    golden_server_args: ServerArgs | None = Field(
        None,
        description="server arguments of the golden (default: server_args without its parallel "
        "flags, TP=1); e.g. --pipeline-parallel-size 2 where one GPU cannot hold the model",
    )
    decode_texts: int = Field(
        8,
        ge=0,
        le=GSM8K_TEST_QUESTIONS,
        description="prompts whose greedy continuation is compared with the golden's (the decode path); "
        "0: none",
    )
    decode_tokens: int = Field(32, ge=1, le=4096, description="tokens generated per decode prompt")
    random_weights: bool = Field(
        False,
        description="the model's weights are random (a shape twin, models/twins.py): its answers mean "
        "nothing, so no accuracy, paired or garbage gate; accuracy is reported as n/a",
    )
    # the layer check's sums (moe_eval.kernels.layer_check; docs/logprob-gate.md)
    layer_check: bool = Field(
        True,
        description="a bundled-kernel config: compare the MoE calls the server makes (every dispatch "
        "range, every rank) with the exact MoE of the same inputs, after a sweep that reaches each range; "
        "false: off",
    )
    layer_check_slots: int = Field(
        32,
        ge=1,
        le=100000,
        description="layer check: slots each (layer, range, expert) cell collects before the server stops "
        "picking rows for it (rows are still compared now and then)",
    )
    layer_check_sweep_seconds: float = Field(
        120.0,
        ge=0.0,
        le=86400.0,
        description="layer check: the most time the sweep spends driving calls until every range's cells "
        "have their slots (it stops sooner when they have, or when a round adds none)",
    )
    optional_gates: GateNames = Field(
        (),
        description="gates that may end 'not run' without making the verdict incomplete (exit 6): names of "
        "`moe-eval list`'s gates column (e.g. [golden, divergence] where the scoring texts may be "
        "unavailable)",
    )
    moe_timing: bool = Field(
        True,
        description="time the server's MoE calls per dispatch range on the layer sweep's workload (every "
        "row, vLLM's own kernel's too; the speed gate's input and the table's MoE time)",
    )
    # Each registered gate's keys (moe_eval.gates.registry: the gate's `keys` type), parsed from the same
    # mapping; config.keys(Type) reads them.
    gate_keys: tuple[Any, ...] = ()
    # The file's text as parsed: what travels to the worker process (moe_eval.worker), which parses the
    # same bytes instead of reading the file again (an edit meanwhile cannot split a run's configs).
    text: str = dataclasses.field(default="", repr=False, compare=False)
    # Set by effective_config from the run's --hw (None: not known): what an absent speed_gate follows.
    on_gpu: bool | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def layer_checked(self) -> bool:
        """The layer check applies: a bundled kernel (the plugin runs it inside the server), and on."""
        return self.layer_check and self.moe_backend is not None

    def keys(self, kind: type[K]) -> K:
        """A gate's keys (`kind`: its keys type) as this config set them; the defaults where none was parsed
        (a config built in code)."""
        found = next((keys for keys in self.gate_keys if type(keys) is kind), None)
        return found if found is not None else kind()

    def key(self, name: str) -> Any:
        """One key's effective value by name, the run's or a gate's."""
        if name in RUN_KEYS:
            return getattr(self, name)
        for keys in self.gate_keys:
            if name in keys.__pydantic_fields__:
                return getattr(keys, name)
        owner = _key_owners().get(name)
        if owner is None:
            raise KeyError(name)
        return getattr(owner(), name)

    def with_keys(self, **changes: Any) -> EvalConfig:
        """This config with some keys changed, the run's or a gate's (each revalidated)."""
        run = {k: v for k, v in changes.items() if k in RUN_KEYS}
        rest = {k: v for k, v in changes.items() if k not in RUN_KEYS}
        owners = _key_owners()
        unknown = [k for k in rest if k not in owners]
        if unknown:
            raise KeyError(", ".join(unknown))
        gate_keys = list(self.gate_keys)
        for kind in {owners[k] for k in rest}:
            mine = {k: v for k, v in rest.items() if owners[k] is kind}
            current: Any = self.keys(kind)  # a @gate_keys class, as gate_keys holds them
            gate_keys = [k for k in gate_keys if type(k) is not kind]
            gate_keys.append(dataclasses.replace(current, **mine))
        return dataclasses.replace(self, **run, gate_keys=tuple(gate_keys))

    @property
    def answers_gated(self) -> bool:
        """The answers are gated (accuracy, paired McNemar, garbage): the model is trained, not a random
        twin."""
        return not self.random_weights

    @property
    def golden_gated(self) -> bool:
        """The golden gate applies: a bundled kernel (vLLM's own is the incumbent), texts to score, and on."""
        return self.golden and self.moe_backend is not None and self.logprob_texts > 0

    @property
    def name(self) -> str:
        """Test-case name, as in vLLM's harness: the file's stem."""
        return self.path.stem

    @property
    def server_argv(self) -> list[str]:
        return shlex.split(self.server_args)

    @property
    def layout(self) -> Layout:
        return layout_from_server_args(self.server_argv)

    @property
    def baseline_config_path(self) -> Path | None:
        """baseline_config, resolved against this config's folder."""
        return (self.path.parent / self.baseline_config).resolve() if self.baseline_config else None

    def resolved(self) -> dict[str, Any]:
        """Every key with its effective value (defaults filled in), for results.json."""
        return {key: self.key(key) for key in config_keys()}


K = TypeVar("K")

# The run's own keys: EvalConfig's fields less what parse_config adds; a FieldInfo's description is its doc.
RUN_KEYS: dict[str, FieldInfo] = {
    key: info
    # pydantic sets __pydantic_fields__ on a pydantic dataclass; its types declare it on BaseModel only.
    for key, info in cast("dict[str, FieldInfo]", getattr(EvalConfig, "__pydantic_fields__")).items()
    if key not in ("path", "sha256", "gate_keys", "text", "on_gpu")
}


def _gate_key_types() -> list[type]:
    # Read at each call, not at import: a test registers a gate of its own for its duration.
    return [gate.keys for gate in registry.GATES if gate.keys is not None]


def _gate_names() -> tuple[str, ...]:
    return registry.gate_names()


def _key_owners() -> dict[str, type]:
    """Each gate key's name -> the gate keys type that holds it."""
    return {key: kind for kind in _gate_key_types() for key in kind.__pydantic_fields__}  # type: ignore[attr-defined]


def config_keys() -> dict[str, FieldInfo]:
    """Every key a config may set: the run's, then each registered gate's, in the registry's order."""
    keys = dict(RUN_KEYS)
    for kind in _gate_key_types():
        keys.update(kind.__pydantic_fields__)  # type: ignore[attr-defined]
    return keys


# pydantic's error types -> the words these messages have always used (tests quote them).
_MUST_BE = {
    "bool_type": "true or false",
    "string_type": "a string",
    "int_type": "an integer",
    "float_type": "a number",
    "dict_type": "a mapping",
    "tuple_type": "a list",
}


def _problem(path: Path, data: dict[str, Any], error: ErrorDetails, fields: dict[str, FieldInfo]) -> str:
    """One pydantic error as a line naming the file, the key and the value (`fields`: the keys validated)."""
    key, kind = str(error["loc"][0]), error["type"]
    if kind == "missing":
        return f"{path}: missing required key '{key}'"
    if kind == "value_error":  # raised by this module's validators, in their own words
        reason = str(error["ctx"]["error"])
    elif kind in _MUST_BE:
        reason = f"must be {_MUST_BE[kind]}"
    elif kind in ("greater_than", "greater_than_equal", "less_than_equal"):
        bound = {b: getattr(m, b) for m in fields[key].metadata for b in ("gt", "ge", "le") if hasattr(m, b)}
        if "le" in bound:
            low = f"above {bound['gt']}" if "gt" in bound else f"between {bound['ge']}"
            reason = (
                f"must be {low} and {bound['le']}"
                if "ge" in bound
                else f"must be {low} and at most {bound['le']}"
            )
        else:
            reason = f"must be > {bound['gt']}" if "gt" in bound else f"must be >= {bound['ge']}"
    else:  # e.g. literal_error: "must be 'gsm8k' or 'canary'"
        reason = error["msg"].replace("Input should be", "must be", 1)
    return f"{path}: key '{key}': value {data[key]!r} {reason}"


def parse_config(path: Path, text: str) -> EvalConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: malformed YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys to values, got {type(data).__name__}")
    # Before pydantic (whose extra="forbid" would say the same): "path", "sha256" and "text" are fields but
    # not keys, and a key that is not a string cannot be a keyword argument.
    known = config_keys()
    unknown = [key for key in data if key not in known]
    if unknown:
        raise ConfigError(
            f"{path}: unknown key '{unknown[0]}' (value {data[unknown[0]]!r}); known keys: {', '.join(known)}"
        )
    # The run's keys and each gate's are validated apart (each by its own type) and every problem reported.
    problems: list[str] = []
    gate_keys = []
    for kind in _gate_key_types():
        fields: dict[str, FieldInfo] = kind.__pydantic_fields__  # type: ignore[attr-defined]
        try:
            gate_keys.append(kind(**{key: value for key, value in data.items() if key in fields}))
        except ValidationError as exc:
            problems += [_problem(path, data, error, fields) for error in exc.errors()]
    run = {key: value for key, value in data.items() if key in RUN_KEYS}
    sha256 = hashlib.sha256(text.encode()).hexdigest()
    try:
        config = EvalConfig(path=path, sha256=sha256, text=text, gate_keys=tuple(gate_keys), **run)
    except ValidationError as exc:
        problems = [_problem(path, data, error, RUN_KEYS) for error in exc.errors()] + problems
    if problems:
        raise ConfigError("\n".join(problems))
    unnamed = [name for name in config.optional_gates if name not in _gate_names()]
    if unnamed:
        raise ConfigError(
            f"{path}: key 'optional_gates': value {list(config.optional_gates)!r} names no gate: "
            f"{', '.join(unnamed)} (gates: {', '.join(_gate_names())})"
        )
    if config.random_weights and config.accuracy_threshold is not None:
        raise ConfigError(
            f"{path}: key 'accuracy_threshold': value {config.accuracy_threshold!r} cannot be met by "
            "a model with random weights (random_weights: true); leave it out"
        )
    if not config.random_weights and config.accuracy_threshold is None:
        raise ConfigError(f"{path}: missing required key 'accuracy_threshold'")
    try:
        # Derived from server_args: an impossible layout is a config error now, not at launch.
        _ = config.layout
    except ValueError as exc:
        raise ConfigError(f"{path}: key 'server_args': value {config.server_args!r}: {exc}") from None
    if config.accuracy_threshold is not None and config.accuracy_threshold - config.tolerance <= 0:
        # A floor at or below 0 is met by any accuracy: a gate that cannot fail.
        floor = config.accuracy_threshold - config.tolerance
        raise ConfigError(
            f"{path}: key 'tolerance': value {config.tolerance!r} leaves accuracy_threshold "
            f"{config.accuracy_threshold!r} a floor of {floor:g}, which every accuracy meets (the gate could "
            "not fail); make threshold - tolerance above 0"
        )
    if config.golden_gated and config.logprob_texts < MIN_GOLDEN_TEXTS:
        raise ConfigError(
            f"{path}: key 'logprob_texts': value {config.logprob_texts} is too few for the golden "
            f"gate's paired test (at least {MIN_GOLDEN_TEXTS}); raise it or set 'golden: false'"
        )
    return config


def load_config(path: Path) -> EvalConfig:
    return parse_config(path, read_text(path, "config file", "config"))


def read_text(path: Path, what: str, short: str) -> str:
    """A config or list file's text, or a ConfigError naming the file and why it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} does not exist") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read {short}: {exc.strerror or exc}") from None


# lm-eval's concurrent requests where a config names none. On the H200 the Qwen3-30B-A3B twin's 512-question
# eval took 39 s at 16, 27 at 64 and 23 at 256 (requests 25 -> 11 -> 7 s), and the canary's answers did not
# change from 16 to 200 (docs/perf.md, "The eval's concurrency"). The CPU stays at 16: a 2-core server gains
# nothing from wider batches, and the CPU KV cache (VLLM_CPU_KVCACHE_SPACE) is small.
DEFAULT_CONCURRENCY = {"cpu": 16, "gpu": 256}


def effective_config(
    config: EvalConfig, limit: int | None, mutation: str | None, hw: str | None = None
) -> tuple[EvalConfig, str | None]:
    """What one run does with a config: `--limit` caps its questions (results.json records the cap),
    `--mutate` reaches bundled kernels only: vLLM's own kernel is never mutated (such configs are a mutation
    run's references, kept by --resume across mutations), an absent speed_gate follows whether `hw` is a GPU,
    and an absent max_concurrency is DEFAULT_CONCURRENCY's for it (the CPU's where `hw` is not known)."""
    if limit is not None:
        config = dataclasses.replace(config, num_questions=min(limit, config.num_questions))
    if hw is not None:
        config = dataclasses.replace(config, on_gpu=hw != "cpu")
    if config.max_concurrency is None:
        on_gpu = hw is not None and hw != "cpu"
        config = dataclasses.replace(config, max_concurrency=DEFAULT_CONCURRENCY["gpu" if on_gpu else "cpu"])
    return config, (mutation if config.moe_backend is not None else None)


def _is_a_gate_config(config: EvalConfig) -> GateConfig:
    """Never called: mypy checks here that EvalConfig has everything a gate reads (gates.gate.GateConfig)."""
    return config
