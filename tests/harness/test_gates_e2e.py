"""Every gate on the user's default path, and none skipped in silence (issue 33), through real runs:

- GSM8K from the hub (no --gsm8k-dir), offline, from a `datasets` cache laid from the local copy: the
  scoring texts come from the same source as the evaluation, so the golden gate runs;
- a gate the config calls for that cannot run (the incumbent scored no log-probabilities) ends the run
  "incomplete", exit 6, unless `--optional-gate` declares it optional.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from junitparser import Failure, JUnitXml

from tests.conftest import REPO_ROOT, CliResult, results_json, run_cli

TINY_TP = REPO_ROOT / "configs" / "embedded-cpu-tp"


def lay_hub_cache(hf_home: Path, gsm8k_dir: Path) -> None:
    """A `datasets` cache of the hub's openai/gsm8k (main) as a first online load would leave it, laid from
    the local copy: built by datasets' json builder, then placed under the hub dataset's name and config."""
    import datasets

    build = hf_home / "build"
    built = datasets.load_dataset(
        "json", data_files={s: str(gsm8k_dir / f"{s}.jsonl") for s in ("train", "test")}, cache_dir=str(build)
    )
    folder = Path(built["test"].cache_files[0]["filename"]).parent
    target = hf_home / "datasets" / "openai___gsm8k" / "main" / "0.0.0" / "laid-from-local-copy"
    target.mkdir(parents=True)
    for arrow in folder.glob("json-*.arrow"):
        shutil.copy(arrow, target / arrow.name.replace("json-", "gsm8k-", 1))
    info = json.loads((folder / "dataset_info.json").read_text())
    (target / "dataset_info.json").write_text(
        json.dumps(info | {"config_name": "main", "dataset_name": "gsm8k"})
    )
    shutil.rmtree(build)


def run_offline_from_hub(args: list[str], hf_home: Path, timeout: float = 1500) -> CliResult:
    """`moe-eval` with no local GSM8K folder at all (MOE_EVAL_GSM8K_DIR removed) and the hub switched off."""
    offline = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return run_cli(args, env=offline, timeout=timeout, unset=("MOE_EVAL_GSM8K_DIR",))


def _record(run_root: Path, family: str, name: str) -> dict:
    return results_json(run_root / family / name / "results.json")


@pytest.mark.extended  # two rows and a golden: beyond what CI's 90 minutes hold (tests/conftest.py)
def test_the_default_hub_path_scores_texts_and_runs_the_golden_gate(tmp_path, gsm8k_dir):
    if gsm8k_dir is None:
        pytest.skip("no local GSM8K copy to lay the hub's dataset cache from")
    hf_home = tmp_path / "hf"
    lay_hub_cache(hf_home, Path(gsm8k_dir))
    out = tmp_path / "out"
    args = ["run", "--hw", "cpu", "--output-dir", str(out), "--golden-cache", str(tmp_path / "goldens")]
    result = run_offline_from_hub(
        args
        + [str(TINY_TP / "Tiny-Qwen3-MoE-BF16-vllm.yaml"), str(TINY_TP / "Tiny-Qwen3-MoE-BF16-torch.yaml")],
        hf_home,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_root = next(out.iterdir())
    record = _record(run_root, "embedded-cpu-tp", "Tiny-Qwen3-MoE-BF16-torch")
    assert record["gsm8k"]["source"] == "hub"
    assert record["logprobs"]["texts"] == 64 and record["decode"]["prompts"] == 8, record["logprobs"]
    checks = {c["name"]: c for c in record["checks"]}
    assert checks["golden_gate"]["passed"] and checks["golden_gate"].get("ran", True)
    assert "divergence_not_run" not in checks and "golden_not_run" not in checks
    assert record["golden_gate"]["ratio"] > 0 and record["status"] == "passed"


@pytest.mark.extended  # extended tier: beyond what CI's 90 minutes hold on 2 cores (tests/conftest.py)
def test_a_gate_that_cannot_run_is_exit_6_unless_declared_optional(embedded_default_run, tmp_path):
    """The canary's TP1 row against an incumbent that scored no log-probabilities (an older run's folder,
    as `--baseline`): its golden and divergence gates cannot run. Without a word from the user that is not a
    pass: status incomplete, exit 6, named in the table, results.json, JUnit and the step summary. With both
    gates declared optional (`--optional-gate`), the same run passes, the gates still shown as not run."""
    assert embedded_default_run.result.returncode == 0, embedded_default_run.result.stderr[-3000:]
    incumbent = tmp_path / "incumbent"
    shutil.copytree(embedded_default_run.folder / "canary-tp" / "Canary-Qwen3-MoE-BF16-vllm", incumbent)
    for name in ("logprobs.jsonl", "decode.jsonl"):
        (incumbent / name).unlink()
    config = REPO_ROOT / "configs" / "canary-tp" / "Canary-Qwen3-MoE-BF16-torch.yaml"
    base = ["run", "--hw", "cpu", "--baseline", str(incumbent / "results.json")]
    base += ["--golden-cache", str(embedded_default_run.goldens)]

    out, junit, summary = tmp_path / "strict", tmp_path / "strict.xml", tmp_path / "summary.md"
    strict = run_cli(
        base + ["--output-dir", str(out), "--junit", str(junit), str(config)],
        env={"GITHUB_STEP_SUMMARY": str(summary)},
        timeout=1200,
    )
    assert strict.returncode == 6, strict.stderr[-3000:]
    record = _record(next(out.iterdir()), "canary-tp", "Canary-Qwen3-MoE-BF16-torch")
    assert record["status"] == "incomplete"
    not_run = {c["name"]: c for c in record["checks"] if c.get("ran") is False}
    assert set(not_run) == {"divergence_not_run", "golden_not_run"}, record["checks"]
    assert all(not c["passed"] and "scored no log-probabilities" in c["detail"] for c in not_run.values())
    assert all(c["passed"] for c in record["checks"] if c.get("ran", True))  # what ran passed
    cell = "INCOMPLETE (divergence_not_run, golden_not_run)"
    assert cell in summary.read_text() and cell in strict.stdout
    (case,) = [c for suite in JUnitXml.fromfile(str(junit)) for c in suite]
    assert isinstance(case.result[0], Failure) and "golden_not_run" in case.result[0].type

    out = tmp_path / "optional"
    optional = run_cli(
        base
        + [
            "--output-dir",
            str(out),
            "--optional-gate",
            "golden",
            "--optional-gate",
            "divergence",
            str(config),
        ],
        timeout=1200,
    )
    assert optional.returncode == 0, optional.stderr[-3000:]
    record = _record(next(out.iterdir()), "canary-tp", "Canary-Qwen3-MoE-BF16-torch")
    assert record["status"] == "passed"
    shown = [c for c in record["checks"] if c.get("ran") is False]
    assert {c["name"] for c in shown} == {"divergence_not_run", "golden_not_run"}
    assert all(c["passed"] and c["detail"].startswith("not run (optional here)") for c in shown)
