"""Config schema: a strict superset of vLLM's GSM8K YAML; every problem names file, key and value."""

from pathlib import Path

import pytest

from moe_eval.configs.config import RUN_KEYS, config_keys, load_config, parse_config
from moe_eval.core.errors import ConfigError, ExitCode
from moe_eval.core.layout import LayoutKind

P = Path("configs/x/Model-BF16-triton.yaml")
MINIMAL = "model_name: m\naccuracy_threshold: 0.5\nnum_questions: 10\nnum_fewshot: 5\n"


def test_minimal_config_gets_vllm_defaults():
    c = parse_config(P, MINIMAL)
    assert (c.tolerance, c.startup_max_wait_seconds, c.max_tokens, c.temperature, c.seed) == (
        0.08,
        1200,
        256,
        0.0,
        42,
    )
    assert c.request_timeout_seconds == 600 and c.moe_backend is None and c.server_args == "" and c.env == {}
    assert c.name == "Model-BF16-triton"
    assert set(c.resolved()) == set(config_keys())


def test_vllm_harness_yaml_runs_unchanged():
    # The shape of vLLM's own tests/evals/gsm8k configs, folded server_args included.
    text = (
        'model_name: "Qwen/Qwen3-30B-A3B"\naccuracy_threshold: 0.88\nnum_questions: 1319\nnum_fewshot: 5\n'
        "server_args: >-\n  --enforce-eager\n  --max-model-len 8192\n  --tensor-parallel-size 2\n"
        'env:\n  VLLM_USE_DEEP_GEMM: "0"\n  SOME_INT: 1\n'
    )
    c = parse_config(P, text)
    assert c.server_argv == ["--enforce-eager", "--max-model-len", "8192", "--tensor-parallel-size", "2"]
    assert c.env == {"VLLM_USE_DEEP_GEMM": "0", "SOME_INT": "1"}
    assert c.layout.kind is LayoutKind.TP and c.layout.world_size == 2


@pytest.mark.parametrize(
    "extra, key, value_text",
    [
        ("bogus_key: 3\n", "bogus_key", "3"),  # unknown keys are errors, never ignored
        ("tolerance: high\n", "tolerance", "'high'"),  # wrong type
        ("max_tokens: true\n", "max_tokens", "True"),  # YAML bool is not an integer
        ("moe_backend: cuda_magic\n", "moe_backend", "'cuda_magic'"),  # not a bundled backend
        ("env: [a, b]\n", "env", "['a', 'b']"),  # env must be a mapping
        ('server_args: "--x \'unterminated"\n', "server_args", "--x 'unterminated"),  # not shell-splittable
        ("server_args: --tensor-parallel-size zero\n", "server_args", "zero"),  # layout cannot be derived
        ("server_args: --port=9000\n", "server_args", "--port=9000"),  # moe-eval picks the port itself
    ],
)
def test_bad_values_name_file_key_and_value(extra, key, value_text):
    with pytest.raises(ConfigError) as err:
        parse_config(P, MINIMAL + extra)
    message = str(err.value)
    assert str(P) in message and f"'{key}'" in message and value_text in message
    assert err.value.exit_code == ExitCode.CONFIG


@pytest.mark.parametrize(
    "extra, key, value_text, reason",
    [
        ("max_tokenz: 128\n", "max_tokenz", "128", "unknown key"),  # a typo is not silently ignored
        ('tolerance: "0.5"\n', "tolerance", "'0.5'", "must be a number"),  # strict: a string is no number
        ("seed: false\n", "seed", "False", "must be an integer"),  # a bool is not an int
        ("max_retries: 2.0\n", "max_retries", "2.0", "must be an integer"),  # nor is a float
        ("paired_alpha: 0.6\n", "paired_alpha", "0.6", "must be between 1e-09 and 0.5"),  # out of range
        ("max_jit_while_serving: -1\n", "max_jit_while_serving", "-1", "must be >= 0"),  # optional, negative
        ("task: mmlu\n", "task", "'mmlu'", "must be 'gsm8k' or 'canary'"),
        ("env: {A: [1]}\n", "env", "{'A': [1]}", "must map strings to strings"),
    ],
)
def test_each_problem_names_file_key_value_and_reason(extra, key, value_text, reason):
    with pytest.raises(ConfigError) as err:
        parse_config(P, MINIMAL + extra)
    message = str(err.value)
    assert str(P) in message and f"'{key}'" in message and value_text in message and reason in message


def test_optional_gates_must_name_registered_gates():
    """The names are the registry's (moe_eval.gates.registry), naming file, key and value."""
    with pytest.raises(ConfigError) as err:
        parse_config(P, MINIMAL + "optional_gates: [golden, nope]\n")
    problem = str(err.value)
    assert str(P) in problem and "'optional_gates'" in problem and "['golden', 'nope']" in problem
    assert "names no gate: nope" in problem
    assert parse_config(P, MINIMAL + "optional_gates: [golden]\n").optional_gates == ("golden",)


def test_an_int_is_a_number_and_null_leaves_an_optional_key_unset():
    c = parse_config(P, MINIMAL + "tolerance: 0\ntemperature: 1\nstderr_gate_k: null\nmoe_backend: null\n")
    assert (c.tolerance, c.temperature, c.key("stderr_gate_k"), c.moe_backend) == (0, 1, None, None)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        parse_config(P, MINIMAL + "tolerance: high\nmax_tokens: 0\n")
    assert "key 'tolerance'" in str(err.value) and "key 'max_tokens'" in str(err.value)


def test_normalizers_and_docs():
    c = parse_config(P, MINIMAL + 'optional_gates: [golden]\nenv: {A: true}\nserver_args: "--a\\n  --b"\n')
    assert (c.optional_gates, c.env, c.server_args) == (("golden",), {"A": "True"}, "--a --b")
    assert all(info.description for info in config_keys().values())  # each key keeps its doc


def test_a_gates_keys_are_its_own_and_flat_in_the_yaml():
    """A gate's keys are its module's (the registry row's `keys`), validated by their own type with the run's
    keys in one pass; no gate's key shadows a run key or another gate's."""
    from moe_eval.gates import registry
    from moe_eval.gates.layer_gate import LayerCheckKeys
    from moe_eval.gates.speed import SpeedKeys

    owners: dict[str, str] = dict.fromkeys(RUN_KEYS, "run")
    for gate in registry.GATES:
        for key in gate.keys.__pydantic_fields__ if gate.keys else ():
            assert key not in owners, f"{gate.name}'s key {key} is {owners[key]}'s too"
            owners[key] = gate.name
    c = parse_config(P, MINIMAL + "speed_margin: 0.02\nlayer_check_z: 4\n")
    assert c.keys(SpeedKeys).speed_margin == 0.02 and c.keys(LayerCheckKeys).layer_check_z == 4
    assert c.resolved()["speed_margin"] == 0.02 and c.resolved()["paired_alpha"] == 0.05  # a default
    changed = c.with_keys(speed_gate=True, num_questions=3)
    assert (
        changed.keys(SpeedKeys).speed_gate
        and changed.num_questions == 3
        and changed.key("speed_margin") == 0.02
    )
    with pytest.raises(ConfigError) as err:  # a gate's key and a run key wrong at once: both named
        parse_config(P, MINIMAL + 'speed_margin: "0.02"\nmax_tokens: 0\n')
    assert "key 'speed_margin': value '0.02' must be a number" in str(err.value)
    assert "key 'max_tokens'" in str(err.value)


@pytest.mark.parametrize(
    "key, value",
    [
        ("accuracy_threshold", "1.5"),
        ("accuracy_threshold", "-0.1"),
        ("num_questions", "0"),
        ("num_questions", "1320"),
        ("num_fewshot", "-1"),
        ("startup_max_wait_seconds", "0"),
    ],
)
def test_out_of_range_values_are_errors(key, value):
    text = (
        "\n".join(line for line in MINIMAL.splitlines() if not line.startswith(key)) + f"\n{key}: {value}\n"
    )
    with pytest.raises(ConfigError, match=f"'{key}'.*{value}.*between|'{key}'.*{value}.*> 0"):
        parse_config(P, text)


def test_missing_required_key():
    with pytest.raises(ConfigError, match="missing required key 'num_fewshot'"):
        parse_config(P, MINIMAL.replace("num_fewshot: 5\n", ""))


@pytest.mark.parametrize("text", ["model_name: [unclosed\n", "- a\n- b\n", ""])
def test_malformed_or_non_mapping_yaml(text):
    with pytest.raises(ConfigError, match=str(P)):
        parse_config(P, text)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_sha256_tracks_content():
    a, b = parse_config(P, MINIMAL), parse_config(P, MINIMAL + "seed: 7\n")
    assert a.sha256 != b.sha256 and len(a.sha256) == 64


def test_seed_configs_match_the_issue(repo_root):
    expected = {
        "moe-refactor/Qwen3-30B-A3B-BF16-triton.yaml": ("Qwen/Qwen3-30B-A3B", 0.88, LayoutKind.TP, "triton"),
        "moe-refactor/Qwen3-30B-A3B-BF16-fi-cutlass.yaml": (
            "Qwen/Qwen3-30B-A3B",
            0.88,
            LayoutKind.TEP,
            "flashinfer_cutlass",
        ),
        "moe-refactor/Mixtral-8x7B-BF16-triton.yaml": (
            "mistralai/Mixtral-8x7B-v0.1",
            0.58,
            LayoutKind.TP,
            "triton",
        ),
        "moe-refactor/Mixtral-8x7B-BF16-fi-cutlass.yaml": (
            "mistralai/Mixtral-8x7B-v0.1",
            0.58,
            LayoutKind.TEP,
            "flashinfer_cutlass",
        ),
        "moe-refactor/Llama-4-Scout-BF16-triton.yaml": (
            "meta-llama/Llama-4-Scout-17B-16E-Instruct",
            0.92,
            LayoutKind.TP,
            "triton",
        ),
        "moe-refactor/Llama-4-Scout-BF16-fi-cutlass.yaml": (
            "meta-llama/Llama-4-Scout-17B-16E-Instruct",
            0.92,
            LayoutKind.TEP,
            "flashinfer_cutlass",
        ),
        "moe-refactor-dp-ep/Qwen3-30B-A3B-BF16-triton.yaml": (
            "Qwen/Qwen3-30B-A3B",
            0.88,
            LayoutKind.DEP,
            "triton",
        ),
    }
    for rel, (model, threshold, kind, backend) in expected.items():
        c = load_config(repo_root / "configs" / rel)
        assert (c.model_name, c.accuracy_threshold, c.layout.kind, c.moe_backend) == (
            model,
            threshold,
            kind,
            backend,
        )
        assert (c.num_questions, c.num_fewshot, c.layout.world_size) == (1319, 5, 2)
        assert "--enforce-eager" in c.server_argv and "8192" in c.server_argv


def test_random_weights_drop_the_accuracy_threshold():
    """A shape twin (random weights) answers nothing: it has no threshold, and says so if given one."""
    twin = parse_config(
        P, "model_name: builtin:twin-qwen3-30b-a3b\nrandom_weights: true\nnum_questions: 8\nnum_fewshot: 5\n"
    )
    assert twin.accuracy_threshold is None and not twin.answers_gated
    with pytest.raises(
        ConfigError, match="key 'accuracy_threshold': value 0.5 cannot be met by a model with random"
    ):
        parse_config(P, MINIMAL + "random_weights: true\n")
    with pytest.raises(ConfigError, match="missing required key 'accuracy_threshold'"):
        parse_config(P, "model_name: m\nnum_questions: 10\nnum_fewshot: 5\n")


def test_an_absent_max_concurrency_comes_from_the_hardware_and_a_set_one_stays():
    from moe_eval.configs.config import DEFAULT_CONCURRENCY, effective_config

    absent = parse_config(P, MINIMAL)
    assert absent.max_concurrency is None
    assert effective_config(absent, None, None, "cpu")[0].max_concurrency == DEFAULT_CONCURRENCY["cpu"] == 16
    assert effective_config(absent, None, None, None)[0].max_concurrency == 16  # unknown hardware: the CPU's
    assert DEFAULT_CONCURRENCY["gpu"] == 256
    for gpu in ("h200", "b200", "h100"):
        assert effective_config(absent, None, None, gpu)[0].max_concurrency == 256
    named = parse_config(P, MINIMAL + "max_concurrency: 32\n")
    assert effective_config(named, None, None, "h200")[0].max_concurrency == 32
    with pytest.raises(ConfigError, match="max_concurrency"):
        parse_config(P, MINIMAL + "max_concurrency: 0\n")


@pytest.mark.parametrize(
    "extra, message",
    [
        # e49cc3c accepted both: a floor of 0 (or below) every accuracy meets, and a layer check that needed
        # no cell judged
        ("tolerance: 0.5\n", "key 'tolerance': value 0.5 leaves accuracy_threshold 0.5 a floor of 0,"),
        ("tolerance: 0.6\n", "a floor of -0.1, which every accuracy meets"),
        ("layer_check_min_judged: 0\n", "'layer_check_min_judged': value 0 must be above 0.0 and at most 1"),
    ],
)
def test_values_that_leave_a_check_unable_to_fail_are_refused(extra, message):
    text = MINIMAL + extra
    with pytest.raises(ConfigError, match=message):
        parse_config(P, text)
