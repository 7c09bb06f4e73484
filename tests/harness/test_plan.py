"""One plan for `list` and `run` (issue 41): on every shipped list, under each combination of the options
they share, `moe-eval list` and the planning step of `moe-eval run` (`--dry-run`) print the same plan, and a
run writes that plan beside its results."""

from __future__ import annotations

import itertools

import pytest
from click.testing import CliRunner

from moe_eval.cli import cli
from tests.conftest import REPO_ROOT

LISTS = sorted(p.name for p in REPO_ROOT.glob("config-*.txt"))
HW = {"config-cpu.txt": "cpu", "config-h100.txt": "h100"}  # the GPU lists plan as b200 (their gates alike)
OPTION_SETS = [
    [],
    ["--optional-gate", "golden"],
    ["--optional-gate", "golden", "--optional-gate", "layer_check"],
]


def _invoke(args: list[str]) -> tuple[int, str, str]:
    # HF_HUB_OFFLINE: the hub's availability is decided at once (and alike in both commands).
    result = CliRunner().invoke(cli, args, env={"HF_HUB_OFFLINE": "1"}, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize(
    ("list_name", "options", "with_data"),
    list(itertools.product(LISTS, OPTION_SETS, (False, True))),
)
def test_list_and_the_run_plan_agree_on_every_shipped_list(list_name, options, with_data, gsm8k_dir):
    if with_data and gsm8k_dir is None:
        pytest.skip("no local GSM8K folder: the --gsm8k-dir combination needs one")
    common = ["--hw", HW.get(list_name, "b200"), "--list", str(REPO_ROOT / list_name), *options]
    common += ["--gsm8k-dir", gsm8k_dir] if with_data else []
    listed = _invoke(["list", *common])
    planned = _invoke(["run", "--dry-run", *common])
    assert listed[0] == planned[0] == 0
    assert listed == planned
    lines = listed[1].splitlines()
    assert lines[0] == f"# {REPO_ROOT / list_name}" and lines[1].startswith("config\t")
    if with_data or "cpu" in list_name:
        assert "cannot be had" not in listed[2]  # the data is there (the CPU list needs none)
    if "golden" in options:
        assert "golden(not run" not in listed[1]  # optional here: skipped, never "not run"


def test_a_run_writes_the_plan_it_follows(embedded_default_run):
    """The embedded default's run folder holds plan.tsv: `list`'s lines for the same options."""
    plan = (embedded_default_run.folder / "plan.tsv").read_text().splitlines()
    code, listed, _ = _invoke(["list", "--hw", "cpu", "--list", str(REPO_ROOT / "config-cpu.txt")])
    assert code == 0 and plan[1:] == listed.splitlines()[1:]
    assert any("layer_check" in line for line in plan)


def test_the_baseline_option_plans_alike(embedded_default_run):
    """--baseline: an earlier run stands as every config's incumbent, in both commands."""
    common = ["--hw", "cpu", "--list", str(REPO_ROOT / "config-cpu.txt"), "--baseline"]
    common.append(str(embedded_default_run.folder))
    listed, planned = _invoke(["list", *common]), _invoke(["run", "--dry-run", *common])
    assert listed == planned and listed[0] == 0
    assert "(not run: no incumbent)" not in listed[1]


def test_the_run_plan_shows_the_configs_as_they_will_run():
    """--limit is part of run's plan (the questions column, the baseline check): at 4813b0f's successor the
    plan checked baselines against the unlimited counts and `run --limit N --baseline RUN` was refused."""
    common = ["--hw", "cpu", "--list", str(REPO_ROOT / "config-cpu.txt")]
    code, planned, _ = _invoke(["run", "--dry-run", "--limit", "5", *common])
    rows = [line.split("\t") for line in planned.splitlines() if not line.startswith(("#", "config\t"))]
    assert code == 0 and rows and all(row[6] == "5" for row in rows)
    from moe_eval.core.errors import ConfigError

    vllm_only = str(REPO_ROOT / "configs/canary-tp/Canary-Qwen3-MoE-BF16-vllm.yaml")
    with pytest.raises(ConfigError, match="no selected config runs a bundled kernel"):  # exit 4 in main()
        _invoke(["run", "--dry-run", "--mutate", "scale_one_expert", "--hw", "cpu", vllm_only])


@pytest.mark.parametrize(
    "mutation, message",
    [
        ("no_such", "'no_such' is not one of"),
        ("scale_expert:expert=8", "expert 8 is not one of builtin:canary-qwen3-moe's 8 experts"),
        ("scale_expert:layer=99", "layer 99 is not one of builtin:canary-qwen3-moe's 4 layers"),
        ("small_batch_bypassed", "the tile choice it changes is the bundled Triton kernel's"),  # a torch row
    ],
)
def test_the_plan_refuses_a_mutation_the_run_would_refuse_or_that_would_mutate_nothing(mutation, message):
    """`run --dry-run --mutate no_such` exited 0 where the run exits 4 (e49cc3c); a target the model lacks
    passed both and mutated nothing. The plan (list's twin) refuses both, naming the model's counts."""
    from moe_eval.core.errors import ConfigError

    torch_row = str(REPO_ROOT / "configs/canary-tp/Canary-Qwen3-MoE-BF16-torch.yaml")
    with pytest.raises(ConfigError, match=message):
        _invoke(["run", "--dry-run", "--mutate", mutation, "--hw", "cpu", torch_row])
    code, _, _ = _invoke(
        ["run", "--dry-run", "--mutate", "scale_expert:layer=3,expert=7", "--hw", "cpu", torch_row]
    )
    assert code == 0
