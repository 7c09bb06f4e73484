"""Live progress: the status a worker writes as answers arrive, and the lines the scheduler prints from it."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from moe_eval.core.status import StatusWriter, read_status, reference_answers
from moe_eval.report.progress_view import PLAIN_INTERVAL_SECONDS, ProgressView, describe

ROWS = [
    {"question": "Ava has 3 pens. How many now?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "Ben has 1,200 coins. How many now?", "answer": "1200 * 1 = 1200\n#### 1,200"},
]


def _prompt(question: str) -> str:
    return f"Question: an earlier shot\nAnswer: 1\n#### 1\n\nQuestion: {question}\nAnswer:"


def test_answers_are_scored_with_gsm8k_strict_match_as_they_arrive(tmp_path: Path):
    writer = StatusWriter(
        tmp_path / "status.json", config="c.yaml", total=2, references=reference_answers(ROWS)
    )
    writer.stage("evaluating")
    writer.answered(_prompt(ROWS[0]["question"]), " 3 + 4 = 7\n#### 7")
    writer.answered(
        _prompt(ROWS[1]["question"]), " it is 1200\n#### 1200."
    )  # "," and a final "." are ignored
    writer.write()
    status = read_status(tmp_path / "status.json")
    assert (status.answered, status.scored, status.correct) == (2, 2, 2) and status.accuracy_so_far == 1.0
    writer.answered(_prompt("a question the references do not hold"), "#### 5")
    writer.answered(_prompt(ROWS[0]["question"]), "The answer is 7")  # no "#### n": strict-match misses it
    assert (writer.status.answered, writer.status.scored, writer.status.correct) == (4, 3, 2)


def test_eta_is_paced_from_the_first_answer_not_from_lm_evals_set_up(tmp_path: Path):
    writer = StatusWriter(tmp_path / "status.json", config="c.yaml", total=101)
    writer.stage("evaluating")
    status = writer.status
    status.stage_started_at = 1000.0  # 30 s of lm-eval set-up before the first answer
    status.answered, status.first_answer_at = 51, 1030.0
    assert status.eta_seconds(1040.0) == 10.0  # 50 answers in 10 s: 50 left, 10 s
    assert "ETA 10 s" in describe("Canary", [1], "cpu", status, 1040.0)
    assert "[cpu 1] evaluating 51/101" in describe("Canary", [1], "cpu", status, 1040.0)


def test_plain_lines_come_on_stage_changes_and_every_interval(tmp_path: Path):
    printed: list[str] = []
    view = ProgressView(total=1, device_kind="cpu", live=False, echo=printed.append)
    planned = SimpleNamespace(index=0, config=SimpleNamespace(name="Canary", path=Path("c.yaml")))
    writer = StatusWriter(tmp_path / "status.json", config="c.yaml", total=10)
    view.tick([(planned, None, None)])  # no status yet: nothing to say
    writer.stage("starting the server")
    view.tick([(planned, None, writer.status)])
    view.tick([(planned, None, writer.status)])  # same stage, no time passed: quiet
    writer.stage("evaluating")
    view.tick([(planned, None, writer.status)])
    view._last_plain[0] = ("evaluating", time.time() - PLAIN_INTERVAL_SECONDS - 1)
    view.tick([(planned, None, writer.status)])
    writer.stage("passed")
    view.tick([(planned, None, writer.status)])  # the end is finished()'s to report
    assert [line.split("] ", 1)[1] for line in printed] == [
        "Canary starting the server (0 s)",
        "Canary evaluating 0/10, 0 s",
        "Canary evaluating 0/10, 0 s",
    ]
