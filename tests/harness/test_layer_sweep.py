"""The layer check's sweep rounds (evaluate/layer_sweep.fill_cells): which ranges each round drives and when
it stops. The requests are recorded, not sent (the real path runs in the CPU runs of test_run_cpu.py)."""

from __future__ import annotations

import time

import pytest

from moe_eval.evaluate import layer_sweep, server_metrics


@pytest.fixture
def sent(monkeypatch):
    posted: list[list[dict]] = []
    monkeypatch.setattr(
        layer_sweep.SweepTarget,
        "post",
        lambda target, payloads, concurrency: (
            posted.append(payloads) or len(layer_sweep.together(payloads, concurrency))
        ),
    )
    monkeypatch.setattr(layer_sweep.SweepTarget, "server_totals", lambda target: None)  # no /metrics here
    return posted


def target(pool=range(5000), max_tokens=8192, model_len=8192) -> layer_sweep.SweepTarget:
    return layer_sweep.SweepTarget(
        "http://x", "m", layer_sweep.TokenPool(list(pool)), model_len, max_tokens, timeout=1.0, retries=1
    )


def _fill(owed_sequence, deadline=1e9, max_tokens=8192, model_len=8192):
    answers = iter(owed_sequence)
    return layer_sweep.fill_cells(
        target(max_tokens=max_tokens, model_len=model_len),
        lambda: next(answers),
        deadline=time.monotonic() + deadline,
        first_index=0,
    )


def test_rounds_drive_the_ranges_that_owe_cells_until_none_does(sent):
    rounds = _fill([{"M=1": 3, "M>=4096": 1}, {"M=1": 1}, {}])
    assert [r["sent"] for r in rounds] == [["M=1", "M>=4096"], ["M=1"]]
    assert [r["requests"] for r in rounds] == [8 + 12, 8]
    assert [r["posts"] for r in rounds] == [8 + 1, 8]  # one at a time; the 12 long prompts in one request
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
    assert rounds == [{"owed": {"M>=4096": 1}, "sent": [], "requests": 0, "posts": 0}] and sent == []


def test_the_largest_range_unit_fills_a_step_even_when_the_first_prompt_runs_alone():
    """A call of M >= 4096 is a step filled to the server's batched-token limit. On the CPU TEP server (limit
    4096) a unit of one limit's worth plus a prompt made no such step in three rounds (the first prompt to
    arrive ran alone) and the row ended incomplete (2026-12-04): the unit now carries twice the limit and a
    prompt, so what follows the first prompt still fills a step."""
    from moe_eval.evaluate.layer_sweep import _unit

    payloads, concurrent = _unit(target(max_tokens=4096, model_len=2048), "M>=4096", 0)
    lengths = [len(p["prompt"]) for p in payloads]
    assert concurrent == len(payloads) and all(p["max_tokens"] == 1 for p in payloads)
    assert sum(lengths) - max(lengths) >= 2 * 4096
    assert _unit(target(max_tokens=2048, model_len=2048), "M>=4096", 0) == ([], 0)  # calls stop below it


def _few_shot_pool(copies: int = 16, block: int = 900, question: int = 40, spread: int = 0) -> list[int]:
    """Like the scoring texts' pool: every text the same few-shot block, then a question of its own (of
    question + spread * c ids: questions differ in length)."""
    ids, next_id = [], 10_000
    for c in range(copies):
        length = question + spread * c
        ids += list(range(block)) + list(range(next_id, next_id + length))
        next_id += length
    return ids


def test_no_two_prompts_of_a_server_share_a_first_cached_block(sent):
    """The pool repeats its few-shot block in every text, so two windows can start at the same place of two
    copies and share their first 16 ids: vLLM's prefix cache would then shorten the second call (and move a
    16-token decode prompt's prefill out of its range). Every prompt of the sweep and of its rounds starts at
    an offset of its own whose first block no other prompt shares."""
    served = target(pool=_few_shot_pool(spread=7))
    swept = layer_sweep.sweep(served)
    layer_sweep.send_units(served, {"M=1": 3, "M=2-16": 2, "M=17-64": 1}, first_index=swept["requests"])
    prompts = [p["prompt"] for payloads in sent for p in payloads]
    assert len(prompts) > 300
    firsts = [tuple(p[: layer_sweep.PREFIX_BLOCK]) for p in prompts]
    assert len(set(firsts)) == len(firsts)


def test_the_pool_offers_each_first_block_once():
    pool = layer_sweep.TokenPool(_few_shot_pool(copies=4, block=100, question=10))
    # The few-shot block's own 85 windows once; the 15 that run into each copy's question, and the question's
    # 10, once per copy.
    assert len(pool.starts) == 85 + 4 * (15 + 10)
    blocks = {tuple(pool.prompt(16, i)) for i in range(len(pool.starts))}
    assert len(blocks) == len(pool.starts)  # every offset reached once before any repeats


@pytest.mark.parametrize(
    "n",
    [
        1,  # a pool of one distinct window
        831,  # 9973 % 831 == 1: a fixed prime stride would have stepped one offset at a time
        997,  # 9973 % 997 == 3
        1477,  # the canary task's pool
        8052,  # GSM8K's five-shot pool by the tiny MoE's tokenizer
        9973,  # a fixed stride of 9973 would have stood still
    ],
)
def test_consecutive_prompts_start_far_apart_and_every_offset_comes_once(n):
    """Neighbouring prompts (one decode batch) must come from distant text, or they route alike: each start
    is at least an eighth of the pool's starts away from the one before; the first n prompts use n offsets."""
    pool = layer_sweep.TokenPool(list(range(n)))  # distinct ids: n starts
    assert len(pool.starts) == n
    order = [pool.prompt(1, i)[0] for i in range(n)]  # the ids are the offsets
    assert len(set(order)) == n
    if n > 8:
        assert all(min(abs(a - b), n - abs(a - b)) >= n / 8 for a, b in zip(order, order[1:], strict=False))


def test_a_pool_shorter_than_a_block_offers_each_distinct_window_once():
    assert layer_sweep.TokenPool([5, 5, 5]).starts == [0]  # every window is 5, 5, 5, ...
    assert layer_sweep.TokenPool([1, 2] * 5).starts == [0, 1]


def test_the_prefix_cache_counter_is_read_from_the_servers_metrics_text():
    text = "\n".join(
        [
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.",
            "# TYPE vllm:prefix_cache_hits_total counter",
            'vllm:prefix_cache_hits_total{engine="0",model_name="/m/a b"} 1.6e+02',
            'vllm:prefix_cache_hits_total{engine="1",model_name="/m/a b"} 32.0',
            'vllm:prefix_cache_hits_created{engine="0",model_name="/m/a b"} 1.7e+09',
            'vllm:prefix_cache_hits_total_by_source{engine="0"} 999.0',  # another metric: not counted
            'vllm:prefix_cache_queries_total{engine="0",model_name="/m/a b"} 4000.0',
        ]
    )
    assert server_metrics.prefix_cache_hits(server_metrics.totals_in(text)) == 192  # both engines
    assert (
        server_metrics.prefix_cache_hits(server_metrics.totals_in("vllm:num_requests_running 0.0")) is None
    )  # stats off
    assert (
        server_metrics.prefix_cache_hits(
            server_metrics.totals_in('vllm:prefix_cache_hits_total{engine="0"} nan?')
        )
        is None
    )


def test_the_engines_decode_step_and_prefill_time_are_read_between_two_metrics_texts():
    """vLLM's histograms (0.26 and 0.32: vllm:inter_token_latency_seconds, vllm:request_prefill_time_seconds),
    one per engine: the mean of what they gained between two readings, bucket lines ignored."""

    def text(itl_sum, itl_count, prefill_sum, prefill_count):
        return "\n".join(
            [
                "# TYPE vllm:inter_token_latency_seconds histogram",
                'vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="/m/a b"} 5.0',
                f'vllm:inter_token_latency_seconds_sum{{engine="0",model_name="/m/a b"}} {itl_sum}',
                f'vllm:inter_token_latency_seconds_count{{engine="0",model_name="/m/a b"}} {itl_count}',
                'vllm:inter_token_latency_seconds_sum{engine="1",model_name="/m/a b"} 1.0',
                'vllm:inter_token_latency_seconds_count{engine="1",model_name="/m/a b"} 100.0',
                f'vllm:request_prefill_time_seconds_sum{{engine="0",model_name="/m/a b"}} {prefill_sum}',
                f'vllm:request_prefill_time_seconds_count{{engine="0",model_name="/m/a b"}} {prefill_count}',
            ]
        )

    before = server_metrics.totals_in(text(0.5, 50.0, 0.2, 4.0))
    after = server_metrics.totals_in(text(0.533, 61.0, 0.26, 7.0))
    itl = server_metrics.mean_between(before, after, server_metrics.INTER_TOKEN_LATENCY)
    assert itl == pytest.approx(0.003)  # 11 steps of 3 ms
    prefill = server_metrics.mean_between(before, after, server_metrics.PREFILL_TIME)
    assert prefill == pytest.approx(0.02)
    # nothing gained, a reading missing, a server without the histograms (stats off): no number, never 0
    assert server_metrics.mean_between(after, after, server_metrics.INTER_TOKEN_LATENCY) is None
    assert server_metrics.mean_between(None, after, server_metrics.INTER_TOKEN_LATENCY) is None
    stats_off = server_metrics.totals_in("vllm:num_requests_running 0.0")
    assert server_metrics.mean_between(stats_off, after, server_metrics.PREFILL_TIME) is None


def test_the_sweeps_fingerprint_names_its_requests(sent):
    """The speed gate compares two rows only where their timed sweeps sent the same requests: the same
    target gives the same fingerprint; another pool (tokenizer, texts) or token limit gives another."""
    same = [layer_sweep.sweep(target())["fingerprint"] for _ in range(2)]
    assert same[0] == same[1] and len(same[0]) == 16
    assert layer_sweep.sweep(target(pool=range(1, 5001)))["fingerprint"] != same[0]
    assert layer_sweep.sweep(target(max_tokens=2048))["fingerprint"] != same[0]


def test_the_checks_own_sweep_and_rounds_continue_after_the_timed_prompts(sent, monkeypatch):
    """The speed measurement times prompts 1..n with the check paused; the check's own sweep and rounds then
    take n+1, n+2, ...: every prompt once (one sent again would be served from the prefix cache, a smaller
    call than its range's)."""
    from types import SimpleNamespace

    indices: list[int] = []
    payload = layer_sweep.SweepTarget.payload

    def recorded(self, length, tokens, index):
        indices.append(index)
        return payload(self, length, tokens, index)

    monkeypatch.setattr(layer_sweep.SweepTarget, "payload", recorded)
    timed = layer_sweep.sweep(target())["requests"]
    assert indices == list(range(1, timed + 1))
    answers = iter([{"M=1": 1}, {}])
    config = SimpleNamespace(layer_check_sweep_seconds=60)
    checked = layer_sweep.reach_every_range(config, target(), owed=lambda: next(answers), first_index=timed)
    assert [r["requests"] for r in checked["rounds"]] == [8]
    assert indices == list(range(1, timed + checked["requests"] + 1))  # contiguous, none twice


def test_prompts_sent_at_once_go_in_one_request_so_a_decode_batch_runs_at_its_size(monkeypatch):
    """A decode batch of 100 as 100 requests from a pool of threads reached an H100's server over longer
    than its 12 tokens took, and the batch ramped through sizes that differed from row to row: each group of
    `concurrency` prompts is now one request whose prompt is their list, the groups one after another."""
    requests: list[tuple[list[dict], int]] = []
    monkeypatch.setattr(
        layer_sweep, "post_completions", lambda url, payloads, parse, **kw: requests.append((payloads, kw))
    )
    t = target()
    payloads = [t.payload(16, 12, i) for i in range(1, 81)]
    t.post(payloads, 40)
    ((grouped, kw),) = requests
    assert kw["concurrency"] == 1 and len(grouped) == 2
    assert [len(g["prompt"]) for g in grouped] == [40, 40]
    assert grouped[1]["prompt"][0] == payloads[40]["prompt"]
    assert {k: v for k, v in grouped[0].items() if k != "prompt"} == {
        "model": "m", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True
    }  # fmt: skip
    # one at a time: as they were; a last group smaller than the rest; payloads that differ: not merged
    assert layer_sweep.together(payloads[:3], 1) == payloads[:3]
    assert [len(g["prompt"]) for g in layer_sweep.together(payloads[:10], 8)] == [8, 2]
    mixed = [t.payload(16, 12, 1), t.payload(16, 1, 2)]
    assert layer_sweep.together(mixed, 2) == mixed
