"""The scheduler's dependency rule without servers: a baseline row kept by --resume is never waited for."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from moe_eval.configs.devices import DevicePool
from moe_eval.scheduler import Planned, Scheduler, SchedulerOptions
from moe_eval.worker import Job


class _Recorder(Scheduler):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.launched: list[int] = []

    def _launch(self, planned: Planned, devices: list[int] | None) -> None:
        self.launched.append(planned.index)


def _scheduler(planned: list[Planned]) -> _Recorder:
    job = Job(config_path="", run_root=str(Path("/nonexistent")), hw="cpu", parent_pid=0)
    return _Recorder(planned, SchedulerOptions(job=job, pool=DevicePool("cpu", (0, 1)), jobs=None), object())


def test_a_dependency_kept_by_resume_does_not_hold_its_dependent_back():
    # Index 0 (the baseline) was kept from the earlier run: only index 1 is scheduled.
    scheduler = _scheduler([Planned(1, None, 1, depends_on=0)])
    scheduler._start_what_fits()
    assert scheduler.launched == [1]


def test_a_scheduled_dependency_is_still_waited_for():
    scheduler = _scheduler([Planned(0, None, 1), Planned(1, None, 1, depends_on=0)])
    scheduler._start_what_fits()
    assert scheduler.launched == [0]


def test_resume_reruns_a_row_whose_baseline_runs_again(tmp_path):
    """--resume keeps a finished row only when its baseline_config is kept too: a verdict against a baseline
    that runs again would compare with numbers that no longer exist."""
    import json

    from moe_eval.cli import resumable_outcomes
    from moe_eval.configs.config import parse_config
    from moe_eval.core.results import rules_digest, versions
    from moe_eval.evaluate.gsm8k import Gsm8kData
    from moe_eval.runner import config_run_dir, task_data

    family = tmp_path / "configs" / "fam"
    text = "model_name: m\naccuracy_threshold: 0.5\nnum_questions: 4\nnum_fewshot: 5\n"
    base = parse_config(family / "M-BF16-vllm.yaml", text)
    user = parse_config(
        family / "M-BF16-torch.yaml", text + "moe_backend: torch\nbaseline_config: M-BF16-vllm.yaml\n"
    )
    data, run_root = Gsm8kData(None), tmp_path / "run"

    def finished(config, status):
        run_dir = config_run_dir(run_root, config)
        run_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "status": status,
            "config_sha256": config.sha256,
            "versions": versions(),
            "rules": rules_digest(),
            "num_questions_evaluated": 4,
            "gsm8k": task_data(config, data).describe(),
            "mutation": None,
        }
        (run_dir / "results.json").write_text(json.dumps(record))

    finished(base, "passed")
    finished(user, "passed")
    assert sorted(resumable_outcomes(run_root, [base, user], data, None, {1: 0}).kept) == [0, 1]
    finished(base, "error")  # the baseline ended in an infrastructure error: it runs again, so does its user
    resumed = resumable_outcomes(run_root, [base, user], data, None, {1: 0})
    assert resumed.kept == {}
    assert resumed.rerun == {0: "it ended error", 1: "its baseline_config M-BF16-vllm runs again"}
    assert (config_run_dir(run_root, user) / "attempts" / "1" / "results.json").is_file()  # kept, aside


def test_resume_keeps_a_row_whose_questions_were_read_from_another_folder(tmp_path):
    """The questions are their files' hashes, not where the files lie: a run resumed on a machine whose
    generated canary task (or --gsm8k-dir) sits in another folder keeps its finished rows (seen on the H200:
    another HOME made vLLM's row run again)."""
    import json

    from moe_eval.cli import resumable_outcomes
    from moe_eval.configs.config import parse_config
    from moe_eval.core.results import rules_digest, versions
    from moe_eval.evaluate.gsm8k import Gsm8kData, questions_difference
    from moe_eval.runner import config_run_dir

    for name in ("train.jsonl", "test.jsonl"):
        for folder in ("a", "b"):
            (tmp_path / folder).mkdir(exist_ok=True)
            (tmp_path / folder / name).write_text('{"question": "1+1", "answer": "#### 2"}\n')
    here, there = Gsm8kData(tmp_path / "a"), Gsm8kData(tmp_path / "b")
    assert questions_difference(there.describe(), here.describe()) is None
    assert (
        questions_difference(None, here.describe())
        == "the earlier run recorded no description of its questions"
    )
    (tmp_path / "b" / "test.jsonl").write_text('{"question": "1+2", "answer": "#### 3"}\n')
    assert questions_difference(there.describe(), here.describe()) == "other questions: test.jsonl differs"
    hub = Gsm8kData(None).describe()
    assert questions_difference(hub, here.describe()) == "questions from hub then, from local now"
    (tmp_path / "b" / "test.jsonl").write_text('{"question": "1+1", "answer": "#### 2"}\n')

    config = parse_config(
        tmp_path / "configs" / "fam" / "M-BF16-vllm.yaml",
        "model_name: m\naccuracy_threshold: 0.5\nnum_questions: 4\nnum_fewshot: 5\n",
    )
    run_dir = config_run_dir(tmp_path / "run", config)
    run_dir.mkdir(parents=True)
    record = {
        "status": "passed",
        "config_sha256": config.sha256,
        "versions": versions(),
        "rules": rules_digest(),
        "num_questions_evaluated": 4,
        "gsm8k": there.describe(),
        "mutation": None,
    }
    (run_dir / "results.json").write_text(json.dumps(record))
    assert list(resumable_outcomes(tmp_path / "run", [config], here, None, {}).kept) == [0]


def test_resume_says_why_a_row_runs_again(tmp_path):
    """A resumed run that runs a finished row again says why, naming what changed: on the H200 a resume
    after FlashInfer became importable ran both finished rows again, silently, for a version the rows do
    not use (the earlier files are kept under attempts/)."""
    import json

    from moe_eval.cli import resumable_outcomes
    from moe_eval.configs.config import parse_config
    from moe_eval.core.results import rules_digest, versions
    from moe_eval.evaluate.gsm8k import Gsm8kData
    from moe_eval.runner import config_run_dir, task_data

    config = parse_config(
        tmp_path / "configs" / "fam" / "M-BF16-vllm.yaml",
        "model_name: m\naccuracy_threshold: 0.5\nnum_questions: 4\nnum_fewshot: 5\n",
    )
    data, run_root = Gsm8kData(None), tmp_path / "run"
    run_dir = config_run_dir(run_root, config)
    run_dir.mkdir(parents=True)
    record = {
        "status": "passed",
        "config_sha256": config.sha256,
        "versions": {**versions(), "flashinfer": "0.0.test"},
        "num_questions_evaluated": 4,
        "gsm8k": task_data(config, data).describe(),
        "mutation": None,
    }
    (run_dir / "results.json").write_text(json.dumps(record))
    resumed = resumable_outcomes(run_root, [config], data, None, {})
    assert resumed.kept == {}
    assert resumed.rerun == {0: f"versions differ: flashinfer 0.0.test -> {versions().get('flashinfer')}"}
    assert (run_dir / "attempts" / "1" / "results.json").is_file()

    other = parse_config(
        config.path.with_name("N-BF16-vllm.yaml"),
        "model_name: m\naccuracy_threshold: 0.5\nnum_questions: 4\nnum_fewshot: 5\n",
    )
    assert resumable_outcomes(run_root, [other], data, None, {}).rerun == {
        0: "the earlier run has no results of it"
    }

    # Judged by other rules (moe-eval's version is 0.1.0 whatever the gates are: e49cc3c kept such rows).
    record |= {"versions": versions()}
    (run_dir / "results.json").write_text(json.dumps(record))
    assert resumable_outcomes(run_root, [config], data, None, {}).rerun == {
        0: f"judged by other rules (the judging code's digest not recorded then, {rules_digest()} now)"
    }
    record |= {"rules": "0123456789abcdef"}
    (run_dir / "results.json").write_text(json.dumps(record))
    assert "digest 0123456789abcdef then" in resumable_outcomes(run_root, [config], data, None, {}).rerun[0]

    # The same file where the default concurrency moved (16 -> 256 on GPUs): its rows pair other batches.
    gpu = dataclasses.replace(config, max_concurrency=256)
    record |= {"versions": versions(), "rules": rules_digest(), "config": {"max_concurrency": 16}}
    (run_dir / "results.json").write_text(json.dumps(record))
    assert resumable_outcomes(run_root, [gpu], data, None, {}).rerun == {
        0: "max_concurrency 16 then, 256 now"
    }
    (run_dir / "results.json").write_text(json.dumps(record))
    same = dataclasses.replace(config, max_concurrency=16)
    assert list(resumable_outcomes(run_root, [same], data, None, {}).kept) == [0]
