"""`run --jobs`: configs packed onto the machine's devices (here: the CPU's cores, one TP1 server per core),
with results exactly those of a sequential run. Real vLLM CPU servers and real lm-eval."""

from __future__ import annotations

import re
import signal
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.conftest import results_json, run_args, run_cli, tiny_config
from tests.harness.running import evaluating, left_running, result_record, start_run, wait_for

pytestmark = [pytest.mark.server, pytest.mark.slow]


def _junit_without_times(path: Path) -> str:
    """The JUnit file with what legitimately differs between two runs removed: times, dates, host, and
    the run folder's name in paths."""
    root = ET.parse(path).getroot()
    for element in root.iter():
        for key in ("time", "timestamp", "hostname"):
            element.attrib.pop(key, None)
        if element.tag == "property" and element.get("name") == "gpus":
            element.set("value", "")
    text = ET.tostring(root, encoding="unicode")
    return re.sub(r"/out-jobs\d/\d{8}-\d{6}(\.\d+)?", "/RUN", text)


def test_jobs_2_gives_the_verdicts_and_junit_of_jobs_1(tmp_path, gsm8k_dir):
    passing = tiny_config(tmp_path, "Tiny-BF16-pass")
    failing = tiny_config(tmp_path, "Tiny-BF16-fail", threshold=1.0)
    results = {}
    for jobs in (1, 2):
        out = tmp_path / f"out-jobs{jobs}"
        args = run_args(
            tmp_path,
            gsm8k_dir,
            passing,
            failing,
            out=out,
            extra=("--jobs", str(jobs), "--junit", str(tmp_path / f"junit-{jobs}.xml")),
        )
        result = run_cli(args, timeout=900)
        records = {p.parent.name: results_json(p) for p in out.rglob("results.json")}
        results[jobs] = (result, records)
    (one, one_records), (two, two_records) = results[1], results[2]
    assert one.returncode == two.returncode == 1, two.stderr[-3000:]
    assert (
        {k: r["status"] for k, r in one_records.items()}
        == {k: r["status"] for k, r in two_records.items()}
        == {"Tiny-BF16-pass": "passed", "Tiny-BF16-fail": "failed"}
    )
    assert _junit_without_times(tmp_path / "junit-1.xml") == _junit_without_times(tmp_path / "junit-2.xml")
    # The table lists configs in the list's order, whichever finished first.
    assert one.stdout.index("Tiny-BF16-pass") < one.stdout.index("Tiny-BF16-fail")
    assert two.stdout.index("Tiny-BF16-pass") < two.stdout.index("Tiny-BF16-fail")
    # Packed: the two servers ran at the same time, each bound to a core of its own.
    binds = sorted(r["server"]["env"]["VLLM_CPU_OMP_THREADS_BIND"] for r in two_records.values())
    assert binds == ["0", "1"] and sorted(r["server"]["devices"][0] for r in two_records.values()) == [0, 1]
    windows = [(r["started_at"], r["finished_at"]) for r in two_records.values()]
    assert max(w[0] for w in windows) < min(w[1] for w in windows), f"the servers did not overlap: {windows}"
    assert all(
        r["server"]["devices"] is None for r in one_records.values()
    )  # jobs 1: the whole machine, as before


@pytest.mark.extended  # extended tier: beyond what CI's 90 minutes hold on 2 cores (tests/conftest.py)
def test_a_crashed_config_leaves_the_others_result_intact(tmp_path, gsm8k_dir):
    crashing = tiny_config(tmp_path, "Tiny-BF16-crash")
    crashing.write_text(crashing.read_text().replace("--enforce-eager", "--no-such-vllm-flag"))
    healthy = tiny_config(tmp_path, "Tiny-BF16-healthy")
    result = run_cli(run_args(tmp_path, gsm8k_dir, crashing, healthy, extra=("--jobs", "2")), timeout=900)
    assert result.returncode == 3, result.stderr[-3000:]
    assert result_record(tmp_path, crashing.stem)["status"] == "error"
    healthy_record = result_record(tmp_path, healthy.stem)
    assert healthy_record["status"] == "passed" and healthy_record["num_questions_evaluated"] == 8
    assert "--no-such-vllm-flag" in result.stderr  # the crash's own log lines travel with its error
    assert not left_running(tmp_path), left_running(tmp_path)


@pytest.mark.extended  # extended tier: beyond what CI's 90 minutes hold on 2 cores (tests/conftest.py)
def test_sigterm_during_a_packed_run_is_130_with_nothing_left(tmp_path, gsm8k_dir):
    first = tiny_config(tmp_path, "Tiny-BF16-one", questions=200, concurrency=1)
    second = tiny_config(tmp_path, "Tiny-BF16-two", questions=200, concurrency=1)
    proc = start_run(run_args(tmp_path, gsm8k_dir, first, second, extra=("--jobs", "2")))
    try:
        wait_for(
            lambda: evaluating(tmp_path, first.stem)() and evaluating(tmp_path, second.stem)(),
            proc,
            400,
            "both packed configs were evaluating",
        )
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert time.monotonic() - started < 60
    assert {result_record(tmp_path, c.stem)["status"] for c in (first, second)} == {"cancelled"}
    assert not left_running(tmp_path), left_running(tmp_path)
