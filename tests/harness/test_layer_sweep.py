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
    assert [r["requests"] for r in rounds] == [8 + 12, 8]
    assert rounds[-1]["owed_after"] == {}
    one, big, again = sent
    # One sequence at a time (calls of one token), each prompt its own: routing that does not repeat itself.
    assert len(one) == 8 and all(p["max_tokens"] == 12 for p in one)
    # Enough 1500-token prompts at once to fill two steps at the 8192-token limit, and one more.
    assert len(big) == 12 and all(len(p["prompt"]) == 1500 and p["max_tokens"] == 1 for p in big)
    assert len({tuple(p["prompt"][:8]) for p in big}) == 12  # each from its own offset: no prefix caching


def test_three_rounds_that_judge_nothing_more_end_the_sweep(sent):
    rounds = _fill([{"M=1": 2}] * 10)
    assert len(rounds) == 3


def test_the_deadline_ends_the_sweep(sent):
    assert _fill([{"M=1": 2}] * 10, deadline=-1) == [] and sent == []


def test_a_range_the_server_cannot_make_is_not_sent(sent):
    # Calls stop at 2048 tokens: the >= 4096 unit has no prompts, and with nothing sent the rounds end.
    rounds = _fill([{"M>=4096": 1}] * 5, max_tokens=2048)
    assert rounds == [{"owed": {"M>=4096": 1}, "sent": [], "requests": 0}] and sent == []


def test_the_largest_range_unit_fills_a_step_even_when_the_first_prompt_runs_alone():
    """A call of M >= 4096 is a step filled to the server's batched-token limit. On the CPU TEP server (limit
    4096) a unit of one limit's worth plus a prompt made no such step in three rounds (the first prompt to
    arrive ran alone) and the row ended incomplete (2026-12-04): the unit now carries twice the limit and a
    prompt, so what follows the first prompt still fills a step."""
    from moe_eval.evaluate.layer_sweep import _unit

    pool = list(range(5000))
    payloads, concurrent = _unit("M>=4096", pool, 0, "m", 4096, 2048)
    lengths = [len(p["prompt"]) for p in payloads]
    assert concurrent == len(payloads) and all(p["max_tokens"] == 1 for p in payloads)
    assert sum(lengths) - max(lengths) >= 2 * 4096
    assert _unit("M>=4096", pool, 0, "m", 2048, 2048) == ([], 0)  # a server whose calls stop below it
