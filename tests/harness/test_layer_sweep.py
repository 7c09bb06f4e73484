"""The layer check's sweep rounds (evaluate/layer_sweep.fill_cells): which ranges each round drives and when
it stops. The requests are recorded, not sent (the real path runs in the CPU runs of test_run_cpu.py)."""

from __future__ import annotations

import time

import pytest

from moe_eval.evaluate import layer_sweep


@pytest.fixture
def sent(monkeypatch):
    posted: list[list[dict]] = []
    monkeypatch.setattr(
        layer_sweep, "_post", lambda url, payloads, concurrency, timeout, retries: posted.append(payloads)
    )
    monkeypatch.setattr(layer_sweep, "STATS_INTERVAL_SECONDS", 0.0)
    return posted


def _fill(owed_sequence, deadline=1e9, max_tokens=8192, model_len=8192):
    answers = iter(owed_sequence)
    return layer_sweep.fill_cells(
        "http://x",
        "m",
        list(range(5000)),
        lambda: next(answers),
        deadline=time.monotonic() + deadline,
        max_tokens_per_call=max_tokens,
        model_len=model_len,
        timeout=1.0,
        retries=1,
        first_index=0,
    )


def test_rounds_drive_the_ranges_that_owe_cells_until_none_does(sent):
    rounds = _fill([{"M=1": 3, "M>=4096": 1}, {"M=1": 1}, {}])
    assert [r["sent"] for r in rounds] == [["M=1", "M>=4096"], ["M=1"]]
    assert [r["requests"] for r in rounds] == [8 + 7, 8]
    assert rounds[-1]["owed_after"] == {}
    one, big, again = sent
    # One sequence at a time (calls of one token), each prompt its own: routing that does not repeat itself.
    assert len(one) == 8 and all(p["max_tokens"] == 12 for p in one)
    # Enough 1500-token prompts at once to fill a step at the 8192-token limit.
    assert len(big) == 7 and all(len(p["prompt"]) == 1500 and p["max_tokens"] == 1 for p in big)
    assert len({tuple(p["prompt"][:8]) for p in big}) == 7  # each from its own offset: no prefix caching


def test_three_rounds_that_judge_nothing_more_end_the_sweep(sent):
    rounds = _fill([{"M=1": 2}] * 10)
    assert len(rounds) == 3


def test_the_deadline_ends_the_sweep(sent):
    assert _fill([{"M=1": 2}] * 10, deadline=-1) == [] and sent == []


def test_a_range_the_server_cannot_make_is_not_sent(sent):
    # Calls stop at 2048 tokens: the >= 4096 unit has no prompts, and with nothing sent the rounds end.
    rounds = _fill([{"M>=4096": 1}] * 5, max_tokens=2048)
    assert rounds == [{"owed": {"M>=4096": 1}, "sent": [], "requests": 0}] and sent == []
