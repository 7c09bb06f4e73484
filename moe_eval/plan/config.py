"""Per-model eval configs: a strict superset of the YAML that vLLM's GSM8K harness reads.

Every key is declared in CONFIG_KEYS with its type, range and default; an unknown key, a wrong
type or an out-of-range value is a ConfigError naming the file, the key and the value. Usage:

    config = load_config(Path("configs/moe-refactor/Qwen3-30B-A3B-BF16-triton.yaml"))
"""

from __future__ import annotations

import dataclasses
import hashlib
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from moe_eval.core.errors import ConfigError
from moe_eval.core.layout import Layout, layout_from_server_args
from moe_eval.plan.gate_names import GATE_NAMES

# Backends a config may ask the server to use; absent means vLLM's own MoE path.
MOE_BACKENDS = ("triton", "flashinfer_cutlass", "torch")
TASKS = ("gsm8k", "canary")
GSM8K_TEST_QUESTIONS = 1319
# The golden gate's paired test over texts: below this many texts its p-value and its power analysis are
# too coarse to decide (docs/logprob-gate.md); such a config sets more logprob_texts or golden: false.
MIN_GOLDEN_TEXTS = 8
REQUIRED = object()


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


@dataclass(frozen=True)
class KeySpec:
    types: tuple[type, ...]
    default: Any = REQUIRED
    check: Callable[[Any], str | None] | None = None  # returns a reason when the value is bad
    doc: str = ""
    normalize: Callable[[Any], Any] | None = None  # applied to a value that passed type and check


def _between(lo: float, hi: float) -> Callable[[Any], str | None]:
    return lambda v: None if lo <= v <= hi else f"must be between {lo} and {hi}"


def _positive(v: Any) -> str | None:
    return None if v > 0 else "must be > 0"


def _non_negative(v: Any) -> str | None:
    return None if v >= 0 else "must be >= 0"


def _gate_names(v: Any) -> str | None:
    bad = [name for name in v if name not in GATE_NAMES]
    return f"names no gate: {', '.join(map(str, bad))} (gates: {', '.join(GATE_NAMES)})" if bad else None


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}"


# moe-eval sets these itself (the model it resolved, a free port on loopback, the config's seed key).
RESERVED_SERVER_FLAGS = ("--model", "--port", "--host", "--seed")


def _shell_splittable(v: str) -> str | None:
    try:
        words = shlex.split(v)
    except ValueError as exc:
        return f"is not a valid shell-quoted argument string ({exc})"
    for word in words:
        if word.split("=", 1)[0] in RESERVED_SERVER_FLAGS:
            return (
                f"sets {word.split('=', 1)[0]}, which moe-eval sets itself (use model_name, --port or seed)"
            )
    return None


def _str_to_str(v: dict) -> str | None:
    for key, value in v.items():
        if not isinstance(key, str) or not isinstance(value, (str, int, float, bool)):
            return f"must map strings to strings (entry {key!r}: {value!r})"
    return None


def _str_values(v: dict) -> dict[str, str]:
    return {str(k): str(val) for k, val in v.items()}


def _single_spaced(v: str) -> str:
    return " ".join(v.split())  # folded YAML strings keep their newlines; vLLM wants words


NUMBER = (int, float)
CONFIG_KEYS: dict[str, KeySpec] = {
    # --- vLLM's GSM8K harness keys ---
    "model_name": KeySpec((str,), doc="hub id, local checkpoint dir, or builtin:<name> (built on first use)"),
    "accuracy_threshold": KeySpec(
        NUMBER, None, _between(0.0, 1.0), "expected strict-match accuracy (required unless random_weights)"
    ),
    "num_questions": KeySpec((int,), check=_between(1, GSM8K_TEST_QUESTIONS), doc="GSM8K test questions"),
    "num_fewshot": KeySpec((int,), check=_between(0, 20), doc="few-shot examples from the train split"),
    "server_args": KeySpec(
        (str,), "", _shell_splittable, "extra `vllm serve` arguments, shell-split", normalize=_single_spaced
    ),
    "env": KeySpec(
        (dict,),
        {},
        _str_to_str,
        "environment for the server only, merged over os.environ",
        normalize=_str_values,
    ),
    "tolerance": KeySpec(NUMBER, 0.08, _between(0.0, 1.0), "pass iff accuracy >= threshold - tolerance"),
    "startup_max_wait_seconds": KeySpec(NUMBER, 1200, _positive, "server must be ready within this"),
    "max_tokens": KeySpec((int,), 256, _positive, "generation limit per answer"),
    "temperature": KeySpec(NUMBER, 0.0, _non_negative, "sampling temperature"),
    "seed": KeySpec((int,), 42, _non_negative, "server and sampling seed"),
    "max_concurrency": KeySpec((int,), 16, _positive, "concurrent requests from lm-eval"),
    "request_timeout_seconds": KeySpec(NUMBER, 600, _positive, "per-request timeout"),
    # --- moe-eval keys ---
    "moe_backend": KeySpec((str,), None, _one_of(MOE_BACKENDS), "bundled MoE kernel the server must use"),
    "task": KeySpec((str,), "gsm8k", _one_of(TASKS), "gsm8k, or canary (the canary model's generated task)"),
    "max_retries": KeySpec(
        (int,), 3, _non_negative, "retries of a failed request before the run is an infra error"
    ),
    "stderr_gate_k": KeySpec(NUMBER, None, _non_negative, "also require accuracy >= threshold - k * stderr"),
    "paired_alpha": KeySpec(
        NUMBER, 0.05, _between(1e-9, 0.5), "paired gate: fail when McNemar p(worse) < this"
    ),
    "max_empty_rate": KeySpec(NUMBER, None, _between(0.0, 1.0), "fail when more answers than this are empty"),
    "max_truncated_rate": KeySpec(
        NUMBER, None, _between(0.0, 1.0), "fail when more answers than this hit max_tokens"
    ),
    "max_invalid_rate": KeySpec(
        NUMBER, None, _between(0.0, 1.0), "fail when more answers than this hold no number at all"
    ),
    # --- the log-probability divergence gate (moe_eval.evaluate.logprobs; docs/logprob-gate.md) ---
    "logprob_texts": KeySpec(
        (int,),
        64,
        _between(0, GSM8K_TEST_QUESTIONS),
        "texts scored for log-probabilities after the evaluation (few-shot block + the "
        "reference answer of the first N questions); 0: none",
    ),
    "baseline_config": KeySpec(
        (str,),
        None,
        None,
        "a config (path relative to this file) run first in the same run; "
        "its answers and log-probabilities are this config's baseline",
    ),
    "max_logprob_mean_abs_diff": KeySpec(
        NUMBER,
        None,
        _non_negative,
        "with a baseline: fail when the mean |Δ log p| of the reference tokens "
        "is above this (unset: the default for the kind of baseline)",
    ),
    "max_logprob_p99_abs_diff": KeySpec(
        NUMBER,
        None,
        _non_negative,
        "with a baseline: fail when the 99th percentile of |Δ log p| is above this",
    ),
    "max_top1_flip_rate": KeySpec(
        NUMBER,
        None,
        _between(0.0, 1.0),
        "with a baseline: fail when more positions than this change their top-1 token "
        "(unset: the default for the kind of baseline)",
    ),
    "max_logprob_kl": KeySpec(
        NUMBER,
        None,
        _non_negative,
        "with a baseline: fail when the mean KL over the shared top-k is above this",
    ),
    # --- the golden gate (moe_eval.evaluate.golden, moe_eval.gates.golden_gate; docs/logprob-gate.md) ---
    "golden": KeySpec(
        (bool,),
        True,
        None,
        "a bundled-kernel config with a baseline and logprob_texts > 0: compare its error against an "
        "exact golden reference with the incumbent's (the baseline's); false: off",
    ),
    "golden_margin": KeySpec(
        NUMBER,
        0.10,
        _between(0.0, 10.0),
        "golden gate: fail when error / incumbent's error > 1 + this and the paired test agrees",
    ),
    "golden_alpha": KeySpec(
        NUMBER, 0.01, _between(1e-9, 0.5), "golden gate: the one-sided paired t-test's significance level"
    ),
    "golden_server_args": KeySpec(
        (str,),
        None,
        _shell_splittable,
        "server arguments of the golden (default: server_args without its parallel "
        "flags, TP=1); e.g. --pipeline-parallel-size 2 where one GPU cannot hold the model",
        normalize=_single_spaced,
    ),
    "decode_texts": KeySpec(
        (int,),
        8,
        _between(0, GSM8K_TEST_QUESTIONS),
        "prompts whose greedy continuation is compared with the golden's (the decode path); 0: none",
    ),
    "decode_tokens": KeySpec((int,), 32, _between(1, 4096), "tokens generated per decode prompt"),
    "random_weights": KeySpec(
        (bool,),
        False,
        None,
        "the model's weights are random (a shape twin, models/twins.py): its answers mean nothing, so "
        "no accuracy, paired or garbage gate; accuracy is reported as n/a",
    ),
    # --- the layer check (moe_eval.kernels.layer_check, moe_eval.gates.layer_gate; docs/logprob-gate.md) ---
    "layer_check": KeySpec(
        (bool,),
        True,
        None,
        "a bundled-kernel config: compare the MoE calls the server makes (every dispatch range, every rank) "
        "with the exact MoE of the same inputs, after a sweep that reaches each range; false: off",
    ),
    "layer_check_margin": KeySpec(
        NUMBER,
        0.5,
        _between(0.0, 10.0),
        "layer check: fail a dispatch range whose error against the exact MoE / the incumbent's > 1 + this",
    ),
    "layer_check_scale_bound": KeySpec(
        NUMBER,
        0.005,
        _between(0.0, 1.0),
        "layer check: fail an expert whose output scale in one range is off by more than this (z agreeing)",
    ),
    "layer_check_z": KeySpec(
        NUMBER,
        5.0,
        _positive,
        "layer check: an error must be this many standard errors (the normal quantile; a cell whose variance "
        "estimate has few degrees of freedom needs the Student t quantile of the same tail)",
    ),
    "layer_check_activation_bound": KeySpec(
        NUMBER,
        0.002,
        _between(0.0, 1.0),
        "layer check: fail a layer or range whose SiLU slope error (the served output along the direction a "
        "slope change of every expert's activation moves it) is beyond this (z agreeing)",
    ),
    "layer_check_power": KeySpec(
        NUMBER,
        0.01,
        _between(0.0, 1.0),
        "layer check: a (range, expert) cell is judged when it resolves a one-expert scale error of this "
        "size with 80% probability",
    ),
    "layer_check_min_judged": KeySpec(
        NUMBER,
        0.95,
        _between(0.0, 1.0),
        "layer check: each reachable range needs this share of its (range, expert) cells judged on every "
        "rank; less ends the row not passed (incomplete, exit 6), the unjudged cells named",
    ),
    "layer_check_slots": KeySpec(
        (int,),
        32,
        _between(1, 100000),
        "layer check: slots each (layer, range, expert) cell collects before the server stops picking rows "
        "for it (rows are still compared now and then)",
    ),
    "layer_check_sweep_seconds": KeySpec(
        NUMBER,
        120.0,
        _between(0.0, 86400.0),
        "layer check: the most time the sweep spends driving calls until every range's cells have their "
        "slots (it stops sooner when they have, or when a round adds none)",
    ),
    "optional_gates": KeySpec(
        (list,),
        [],
        _gate_names,
        "gates that may end 'not run' without making the verdict incomplete (exit 6): names of `moe-eval "
        "list`'s gates column (e.g. [golden, divergence] where the scoring texts may be unavailable)",
        normalize=tuple,
    ),
    "max_jit_while_serving": KeySpec(
        (int,),
        None,
        _non_negative,
        "fail when more kernel compilations than this happen while serving (vLLM's JIT monitor, GPU servers)",
    ),
}

_TYPE_NAMES = {
    bool: "true or false",
    str: "a string",
    int: "an integer",
    float: "a number",
    dict: "a mapping",
    list: "a list",
}


@dataclass(frozen=True)
class EvalConfig:
    path: Path
    sha256: str
    model_name: str
    num_questions: int
    num_fewshot: int
    accuracy_threshold: float | None = None  # None only with random_weights (parse_config checks)
    server_args: str = ""
    env: dict[str, str] = field(default_factory=dict)
    tolerance: float = 0.08
    startup_max_wait_seconds: float = 1200
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int = 42
    max_concurrency: int = 16
    request_timeout_seconds: float = 600
    moe_backend: str | None = None
    task: str = "gsm8k"
    max_retries: int = 3
    stderr_gate_k: float | None = None
    paired_alpha: float = 0.05
    max_empty_rate: float | None = None
    max_truncated_rate: float | None = None
    max_invalid_rate: float | None = None
    logprob_texts: int = 64
    baseline_config: str | None = None
    max_logprob_mean_abs_diff: float | None = None
    max_logprob_p99_abs_diff: float | None = None
    max_top1_flip_rate: float | None = None
    max_logprob_kl: float | None = None
    max_jit_while_serving: int | None = None
    golden: bool = True
    golden_margin: float = 0.10
    golden_alpha: float = 0.01
    golden_server_args: str | None = None
    decode_texts: int = 8
    decode_tokens: int = 32
    random_weights: bool = False
    layer_check: bool = True
    # 1.5: a legitimate kernel that rounds once more than the incumbent, as finely, adds up to sqrt(2) = 1.41
    # times its error (FlashInfer CUTLASS reads 1.17-1.26 per layer on the H200 canary); the bugs of
    # docs/logprob-gate.md read 1.8 and up here, and the expert and activation checks resolve smaller ones.
    layer_check_margin: float = 0.5
    layer_check_scale_bound: float = 0.005
    layer_check_z: float = 5.0
    layer_check_activation_bound: float = 0.002
    layer_check_power: float = 0.01
    layer_check_min_judged: float = 0.95
    layer_check_slots: int = 32
    layer_check_sweep_seconds: float = 120.0
    optional_gates: tuple[str, ...] = ()
    # The file's text as parsed: what travels to the worker process (moe_eval.worker), which parses the
    # same bytes instead of reading the file again (an edit meanwhile cannot split a run's configs).
    text: str = dataclasses.field(default="", repr=False, compare=False)

    @property
    def layer_checked(self) -> bool:
        """The layer check applies: a bundled kernel (the plugin runs it inside the server), and on."""
        return self.layer_check and self.moe_backend is not None

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
        return {key: getattr(self, key) for key in CONFIG_KEYS}


def _check_value(path: Path, key: str, value: Any, spec: KeySpec) -> Any:
    # bool is a subclass of int in Python; a YAML `true` is never a valid number here.
    if (isinstance(value, bool) and bool not in spec.types) or not isinstance(value, spec.types):
        wanted = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in spec.types)
        raise ConfigError(f"{path}: key '{key}': value {value!r} must be {wanted}")
    if spec.check is not None:
        reason = spec.check(value)
        if reason:
            raise ConfigError(f"{path}: key '{key}': value {value!r} {reason}")
    if spec.normalize is not None:
        value = spec.normalize(value)
    return value


def parse_config(path: Path, text: str) -> EvalConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: malformed YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys to values, got {type(data).__name__}")
    unknown = sorted(set(map(str, data)) - set(CONFIG_KEYS))
    if unknown:
        raise ConfigError(
            f"{path}: unknown key '{unknown[0]}' (value {data[unknown[0]]!r}); "
            f"known keys: {', '.join(CONFIG_KEYS)}"
        )
    values: dict[str, Any] = {}
    for key, spec in CONFIG_KEYS.items():
        if key not in data:
            if spec.default is REQUIRED:
                raise ConfigError(f"{path}: missing required key '{key}'")
            continue
        if data[key] is None and spec.default is None:
            continue
        values[key] = _check_value(path, key, data[key], spec)
    if values.get("random_weights") and "accuracy_threshold" in values:
        raise ConfigError(
            f"{path}: key 'accuracy_threshold': value {values['accuracy_threshold']!r} cannot be met by "
            "a model with random weights (random_weights: true); leave it out"
        )
    if not values.get("random_weights") and "accuracy_threshold" not in values:
        raise ConfigError(f"{path}: missing required key 'accuracy_threshold'")
    config = EvalConfig(path=path, sha256=hashlib.sha256(text.encode()).hexdigest(), text=text, **values)
    try:
        _ = (
            config.layout
        )  # derived from server_args: an impossible layout is a config error now, not at launch
    except ValueError as exc:
        raise ConfigError(f"{path}: key 'server_args': value {config.server_args!r}: {exc}") from None
    if config.golden_gated and config.logprob_texts < MIN_GOLDEN_TEXTS:
        raise ConfigError(
            f"{path}: key 'logprob_texts': value {config.logprob_texts} is too few for the golden "
            f"gate's paired test (at least {MIN_GOLDEN_TEXTS}); raise it or set 'golden: false'"
        )
    return config


def load_config(path: Path) -> EvalConfig:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file does not exist") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from None
    return parse_config(path, text)


def effective_config(
    config: EvalConfig, limit: int | None, mutation: str | None
) -> tuple[EvalConfig, str | None]:
    """What one run does with a config: `--limit` caps its questions (results.json records the cap), and
    `--mutate` reaches bundled kernels only: vLLM's own kernel is never mutated (such configs are a mutation
    run's references, kept by --resume across mutations)."""
    if limit is not None:
        config = dataclasses.replace(config, num_questions=min(limit, config.num_questions))
    return config, (mutation if config.moe_backend is not None else None)
