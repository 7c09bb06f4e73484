"""benchmarks/eval_concurrency.py's comparisons: answers changed and the paired gate between passes of one
server, and the paired gate between two rows at each concurrency (the stored H200 study is read back)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import eval_concurrency as study  # noqa: E402


def _pass(concurrency: int, correct: list[bool], texts: list[str]) -> dict:
    return {
        "concurrency": concurrency,
        "correct": {str(i): c for i, c in enumerate(correct)},
        "answer_sha1": {str(i): t for i, t in enumerate(texts)},
    }


def test_a_pass_that_loses_answers_is_counted_and_fails_the_paired_test():
    first = _pass(16, [True] * 10, list("abcdefghij"))
    same = _pass(64, [True] * 10, list("abcdefghij"))
    worse = _pass(256, [False] * 8 + [True] * 2, list("ABCDEFGHij"))
    unchanged = study.against(first, same)
    assert unchanged["answers_changed"] == 0 and unchanged["paired"]["passed"]
    lost = study.against(first, worse)
    assert lost["answers_changed"] == 8
    assert lost["paired"]["baseline_only_right"] == 8 and not lost["paired"]["passed"]


def test_rows_pair_at_each_concurrency_on_its_first_pass():
    incumbent = {"passes": [_pass(16, [True, True], ["a", "b"]), _pass(64, [True, False], ["a", "x"])]}
    candidate = {
        "passes": [
            _pass(16, [True, True], ["a", "b"]),
            _pass(64, [True, True], ["a", "b"]),
            _pass(16, [False, False], ["y", "z"]),  # the repeat: not the row's pass at 16
        ]
    }
    rows = {r["concurrency"]: r for r in study.pair(incumbent, candidate)}
    assert set(rows) == {16, 64}
    assert rows[16]["answers_changed"] == 0
    assert rows[64]["answers_changed"] == 1 and rows[64]["paired"]["new_only_right"] == 1


def test_the_stored_h200_canary_study_changed_no_answer(repo_root):
    folder = repo_root / "docs/data/speed_h200/eval-concurrency"
    vllm = json.loads((folder / "Canary-Qwen3-MoE-BF16-vllm-triton.json").read_text())
    bundled = json.loads((folder / "Canary-Qwen3-MoE-BF16-triton.json").read_text())
    for row in (vllm, bundled):
        assert [p["concurrency"] for p in row["passes"]] == [16, 64, 200, 16]
        assert all(p["vs_first"]["answers_changed"] == 0 for p in row["passes"][1:])
    assert all(r["answers_changed"] == 0 and r["paired"]["passed"] for r in study.pair(vllm, bundled))
