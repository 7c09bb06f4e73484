"""A run as a CI step must behave: cancelled at any stage it stops at once (130) and leaves nothing
behind; killed outright its servers die with it; a config that hit an infrastructure error can be
retried; an interrupted run can be resumed. Real vLLM CPU servers and real lm-eval throughout; the
fake server only where a real one cannot be made to misbehave (a server that ignores SIGTERM).

"Nothing left" is checked by the MOE_EVAL_RUN_DIR marker that every worker and server process of a
run carries in its environment.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import results_json, run_args, summary_json, tiny_config
from tests.harness.running import (
    evaluating,
    left_running,
    result_record,
    run_root,
    server_log,
    start_run,
    wait_for,
)

pytestmark = [pytest.mark.server, pytest.mark.slow]


# SIGTERM is what CI systems send on cancel; SIGINT (Ctrl-C) at the same moment is the extended tier's (the
# slow tier's Ctrl-C test in test_run_cpu.py sends it during the evaluation too).
@pytest.mark.parametrize(
    "sig",
    [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.extended)],
    ids=["SIGTERM", "SIGINT"],
)
def test_cancel_during_evaluation_is_130_and_the_next_config_never_starts(tmp_path, gsm8k_dir, sig):
    """What Buildkite and GitHub Actions send on cancel (SIGTERM), and Ctrl-C: the same."""
    first = tiny_config(tmp_path, "Tiny-BF16-first", questions=200, concurrency=2)
    second = tiny_config(tmp_path, "Tiny-BF16-second")
    proc = start_run(run_args(tmp_path, gsm8k_dir, first, second))
    try:
        wait_for(evaluating(tmp_path, first.stem), proc, 300, "the evaluation was under way")
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert f"cancelled by {sig.name}" in stderr
    record = result_record(tmp_path, first.stem)
    assert record["status"] == "cancelled" and record["cancelled_by"] == sig.name
    assert record["error"]["exit_code"] == 130 and record["progress"]["answered"] >= 4  # partial results kept
    assert server_log(tmp_path, second.stem) is None, "a config started after the cancel"
    summary = summary_json(run_root(tmp_path) / "summary.json")
    assert summary["cancelled_by"] == sig.name and summary["complete"] is False
    assert [c["status"] for c in summary["configs"]] == ["cancelled", "not_started"]
    assert not left_running(tmp_path), left_running(tmp_path)


def test_sigterm_during_server_start_is_130_with_nothing_left(tmp_path, gsm8k_dir):
    config = tiny_config(tmp_path, "Tiny-BF16-starting")
    proc = start_run(run_args(tmp_path, gsm8k_dir, config))
    try:
        wait_for(lambda: server_log(tmp_path, config.stem), proc, 120, "the server started")
        time.sleep(3)  # the API server and its engine process exist
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert result_record(tmp_path, config.stem)["status"] == "cancelled"
    assert not left_running(tmp_path), left_running(tmp_path)


def test_a_second_signal_during_teardown_kills_the_server_at_once(tmp_path, gsm8k_dir):
    """A wedged server ignores SIGTERM: the first cancel waits out the grace period, a second one does not."""
    from moe_eval.launch import TEARDOWN_GRACE_SECONDS

    config = tiny_config(tmp_path, "Fake-stubborn", questions=2, extra="request_timeout_seconds: 300\n")
    proc = start_run(
        run_args(tmp_path, gsm8k_dir, config),
        env={"MOE_EVAL_SERVER_MODULE": "tests.fakes.misbehaving_server", "FAKE_SERVER_MODE": "stubborn"},
    )
    try:
        wait_for(
            lambda: (
                (log := server_log(tmp_path, config.stem))
                and "holding an evaluation request" in log.read_text()
            ),
            proc,
            180,
            "the fake server held a request",
        )
        proc.send_signal(signal.SIGTERM)
        time.sleep(2)  # the teardown has begun; the server ignores its SIGTERM
        assert proc.poll() is None, (
            "moe-eval ended before the grace period although the server ignored SIGTERM"
        )
        second = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        after_second = time.monotonic() - second
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert after_second < TEARDOWN_GRACE_SECONDS / 2, f"{after_second:.1f} s after the second signal"
    assert not left_running(tmp_path), left_running(tmp_path)


def test_sigkill_of_moe_eval_takes_every_server_process_with_it(tmp_path, gsm8k_dir):
    """What CI sends once its cancel grace period is over, and what the OOM killer sends: no handler runs."""
    config = tiny_config(tmp_path, "Tiny-BF16-orphaned", questions=200, concurrency=2)
    proc = start_run(run_args(tmp_path, gsm8k_dir, config))
    try:
        log = wait_for(evaluating(tmp_path, config.stem), proc, 300, "the evaluation was under way")
        api_pid = int(re.search(r"\(APIServer pid=(\d+)\)", log.read_text()).group(1))
        proc.kill()
        proc.communicate(timeout=30)
        deadline = time.monotonic() + 15
        while left_running(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not left_running(tmp_path), f"15 s after SIGKILL of moe-eval: {left_running(tmp_path)}"
    status = Path(f"/proc/{api_pid}/status")
    assert not status.exists() or "zombie" in status.read_text(), "vLLM's API server outlived moe-eval"


def test_retry_after_the_server_was_killed_mid_evaluation_passes(tmp_path, gsm8k_dir):
    config = tiny_config(tmp_path, "Tiny-BF16-retried", questions=30, concurrency=1)
    proc = start_run(run_args(tmp_path, gsm8k_dir, config, extra=("--retries", "1")))
    try:
        log = wait_for(
            evaluating(tmp_path, config.stem), proc, 300, "the first attempt's evaluation was under way"
        )
        api_pid = int(re.search(r"\(APIServer pid=(\d+)\)", log.read_text()).group(1))
        os.killpg(os.getpgid(api_pid), signal.SIGKILL)  # the whole server, as a crash or an OOM kill would
        _, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    record = result_record(tmp_path, config.stem)
    assert record["status"] == "passed" and record["attempt"] == 2
    assert [a["status"] for a in record["attempts"]] == ["error"] and "exited with code -9" in record[
        "attempts"
    ][0]["error"]
    first = Path(record["server"]["log"]).parent / record["attempts"][0]["folder"]
    assert (first / "server.log").exists() and results_json(first / "results.json")["status"] == "error"
    assert "retrying with a fresh server" in stderr
    assert not left_running(tmp_path), left_running(tmp_path)


# Three server starts: the extended tier. --resume of a kept run is in the default tier (subtle_mutation_run).
@pytest.mark.extended
def test_resume_after_an_interrupted_run_finishes_only_the_rest(tmp_path, gsm8k_dir):
    done = tiny_config(tmp_path, "Tiny-BF16-done")
    rest = tiny_config(tmp_path, "Tiny-BF16-rest", questions=30, concurrency=1)
    proc = start_run(run_args(tmp_path, gsm8k_dir, done, rest))
    try:
        wait_for(evaluating(tmp_path, rest.stem), proc, 400, "the second config's evaluation was under way")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    interrupted = run_root(tmp_path)
    first_record = result_record(tmp_path, done.stem)
    assert first_record["status"] == "passed" and result_record(tmp_path, rest.stem)["status"] == "cancelled"

    proc = start_run(run_args(tmp_path, gsm8k_dir, done, rest, extra=("--resume", str(interrupted))))
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert result_record(tmp_path, done.stem) == first_record, "the finished config ran again"
    assert result_record(tmp_path, rest.stem)["status"] == "passed"
    summary = summary_json(interrupted / "summary.json")
    assert [(c["status"], c["resumed"]) for c in summary["configs"]] == [("passed", True), ("passed", False)]
    assert summary["complete"] is True
    assert (
        interrupted / "cpu" / rest.stem / "attempts" / "1" / "server.log"
    ).exists()  # the cancelled attempt, kept
    assert "1 kept from the earlier run" in stderr
    assert f"--resume: runs {rest.stem}: it ended cancelled" in stderr  # why it runs again, said
    assert not left_running(tmp_path), left_running(tmp_path)
