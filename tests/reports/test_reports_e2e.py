"""Reports from a real run: two configs of the tiny model on two MoE kernels (bundled torch, vLLM's
own), JUnit with one pass and one failure, the GitHub step summary, compare, and the paired gate."""

from __future__ import annotations

import json

import jsonschema
import pytest
from junitparser import Failure, JUnitXml

from tests.conftest import REPO_ROOT, run_cli

pytestmark = pytest.mark.server

TINY = """model_name: "builtin:tiny-qwen3-moe"
accuracy_threshold: {threshold}
num_questions: 6
num_fewshot: 5
max_tokens: 32
stderr_gate_k: 3
max_empty_rate: 0.5
server_args: "--enforce-eager --max-model-len 4096"
"""


def test_run_junit_summary_compare_and_paired_gate(tmp_path, gsm8k_dir):
    family = tmp_path / "configs" / "cpu-tp"
    family.mkdir(parents=True)
    torch_cfg = family / "Tiny-BF16-torch.yaml"
    # golden: false: this test is about the reports; the golden gate's runs are in tests/harness/test_run_cpu.py.
    torch_cfg.write_text(TINY.format(threshold=0.0) + "moe_backend: torch\ngolden: false\n")
    vllm_cfg = family / "Tiny-BF16-vllm.yaml"
    vllm_cfg.write_text(TINY.format(threshold=1.0))
    data = ["--gsm8k-dir", gsm8k_dir] if gsm8k_dir else []
    summary = tmp_path / "step-summary.md"
    junit = tmp_path / "junit.xml"
    result = run_cli(["run", "--hw", "cpu", "--output-dir", str(tmp_path / "out"), "--junit", str(junit),
                      str(torch_cfg), str(vllm_cfg), *data], env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert result.returncode == 1, result.stderr[-3000:]

    schema = json.loads((REPO_ROOT / "docs" / "results.schema.json").read_text())
    records = {}
    for path in (tmp_path / "out").rglob("results.json"):
        record = json.loads(path.read_text())
        jsonschema.validate(record, schema)
        records[record["config_name"]] = record
    assert records["Tiny-BF16-torch"]["status"] == "passed" and records["Tiny-BF16-vllm"]["status"] == "failed"
    assert records["Tiny-BF16-torch"]["moe_backend_used"] == "bundled:torch"
    assert records["Tiny-BF16-vllm"]["moe_backend_used"] == "vllm:CPU"
    answers = records["Tiny-BF16-torch"]["answers"]
    assert answers["questions"] == 6 and answers["truncated"] is not None  # counted by the server's tokenizer

    cases = {case.name: case for suite in JUnitXml.fromfile(str(junit)) for case in suite}
    assert cases["Tiny-BF16-torch"].is_passed
    failure = cases["Tiny-BF16-vllm"].result[0]
    assert isinstance(failure, Failure) and "accuracy_gate" in failure.type and "vs floor 1.0000" in failure.message  # stderr 0: the k*stderr floor is the threshold
    assert "|Config|" in summary.read_text() and "Tiny-BF16-vllm" in summary.read_text()

    run_folder = next((tmp_path / "out").iterdir())
    compared = run_cli(["compare", "--format", "markdown", str(run_folder)])
    assert compared.returncode == 0, compared.stderr
    assert "bundled:torch TP (TP1)" in compared.stdout and "vllm:CPU TP (TP1)" in compared.stdout
    assert "### builtin:tiny-qwen3-moe: GSM8K, 6 questions, 5-shot" in compared.stdout

    # The paired gate against the first run: same model, questions and few-shot; the same config name
    # picks the torch run out of the two. Greedy decoding on the same kernel: no answer may flip.
    again = run_cli(["run", "--hw", "cpu", "--output-dir", str(tmp_path / "out2"), "--baseline", str(run_folder),
                     str(torch_cfg), *data])
    assert again.returncode == 0, again.stderr[-3000:]
    paired = json.loads(next((tmp_path / "out2").rglob("results.json")).read_text())["paired"]
    assert paired["n"] == 6 and paired["passed"] and paired["baseline"].endswith("Tiny-BF16-torch/results.json")
    assert "paired_gate: PASS" in again.stderr
