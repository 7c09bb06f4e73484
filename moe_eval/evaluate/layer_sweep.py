"""The layer check's workload: requests that make the server's MoE calls reach every dispatch range.

The evaluation and the scoring leave ranges out (scoring sends one text at a time: calls of ~100-1000
tokens; lm-eval's decode batches stop at its concurrency), so after them the harness sends, on the same
server:

1. single prompts of PREFILL_LENGTHS tokens, one at a time (max_tokens 1): one prefill call of about that
   size each (mid and large calls);
2. when the server's calls can carry more than one prompt fits (its batched-token limit above
   max_model_len), enough long prompts at once to fill steps at that limit (chunked prefill's largest calls);
3. DECODE_BATCHES concurrent short prompts, each generating DECODE_TOKENS tokens (ignore_eos), each batch in
   one request (together()): decode calls of that many tokens (with CUDA graphs, the captured size at or
   above it);
4. then rounds: the layer check's own reading of the processes' tables (the runner's `owed`: per range, the
   (range, expert) cells it cannot judge yet where the config asks for them) says which ranges still lack
   evidence, and each round sends one more unit of each such range's workload (RANGE_UNITS), until none
   lacks any, three rounds in a row judged nothing more (the experts left are not routed there often enough),
   or the config's layer_check_sweep_seconds are spent. The server picks the rows that fill the cells still
   short of slots (kernels/layer_check.py), so a round costs what the missing evidence costs.

Prompts are token ids cut from a pool (the tokenized scoring texts; `TokenPool`). Every scoring text starts
with the same few-shot block, so two windows can start at the same place of two copies of it; a prompt
starts only where its first PREFIX_BLOCK ids occur nowhere earlier in the pool, and each prompt of a server
at another such place, so prefix caching never shortens a call. One `SweepTarget` (the server, its pool and
the limits that shape the requests) is built per row and handed to every sender. What was sent is returned
for results.json.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import requests

from moe_eval.configs.config import EvalConfig
from moe_eval.core.errors import InfraError
from moe_eval.core.plugin_protocol import (
    DEFAULT_MAX_TOKENS,
    LAYER_RANGE_EDGES,
    layer_range_names,
)
from moe_eval.evaluate import server_metrics
from moe_eval.evaluate.gsm8k import Gsm8kData
from moe_eval.evaluate.logprobs import post_completions, scoring_texts

PREFILL_LENGTHS = (24, 120, 600, 1500)  # one prompt each, 3 times: M=17-64, 65-256, 257-1023, >= 1024
PREFILL_REPEATS = 3
DECODE_BATCHES = (1, 8, 40, 100)  # concurrent sequences: M=1, 2-16, 17-64, 65-256 when decoding together
DECODE_TOKENS = 12
DECODE_PROMPT_TOKENS = 16
# One unit of each range's workload, for the rounds: (prompts, sent at once, prompt tokens, tokens generated).
# Decode units make calls of about their concurrency, each prompt from its own offset and only a few tokens
# long: greedy decoding of random weights repeats its tokens, so one long continuation keeps routing to the
# same experts (seen on the Qwen3 twin: 96 tokens of one prompt left 36 of 128 experts unrouted at M = 1).
# Prefill units make one call of about their prompt length each.
RANGE_UNITS = (
    (8, 1, DECODE_PROMPT_TOKENS, DECODE_TOKENS),  # M=1: one sequence at a time
    (32, 8, DECODE_PROMPT_TOKENS, DECODE_TOKENS),  # M=2-16
    (80, 40, DECODE_PROMPT_TOKENS, DECODE_TOKENS),  # M=17-64
    (100, 100, DECODE_PROMPT_TOKENS, DECODE_TOKENS),  # M=65-256 (and the 100 short prompts' prefill)
    (2, 1, 600, 1),  # M=257-1023
    (2, 1, 1500, 1),  # M=1024-4095
    (0, 0, 0, 0),  # M>=4096: long prompts sent together, packed into steps at the batched-token limit
)
MAX_ROUNDS = 64
STALLED_ROUNDS = 3
# vLLM's prefix cache matches a prompt block by block from its start, in blocks of 16 tokens (CacheConfig's
# default; some attention backends ask for larger ones): two prompts whose first 16 ids differ share none.
PREFIX_BLOCK = 16
# Consecutive prompts start about this fraction of the pool's offsets apart (the golden ratio's: the k-th
# prompt lands in the largest gap the earlier ones left), so a decode batch's prompts come from distant text
# and route unlike each other.
PROMPT_SPREAD = (math.sqrt(5) - 1) / 2
FALLBACK_TEXT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Weng earns $12 an hour for babysitting. "
)


class TokenPool:
    """Token ids that prompts are cut from, and the offsets a prompt may start at: the first offset of each
    distinct PREFIX_BLOCK-id window (wrapping around), so no two starts share a cached first block. Prompt
    `index` starts at starts[index * stride mod len(starts)], stride coprime to len(starts): indices that
    differ modulo len(starts) start at different offsets (one index space per server: the timed sweep and its
    top-up, then the check's own sweep and rounds, a few hundred prompts; pools hold thousands of starts, the
    repeating fallback text far fewer)."""

    def __init__(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("a token pool needs at least one id")
        self.ids = ids
        seen: set[tuple[int, ...]] = set()
        self.starts: list[int] = []
        for offset in range(len(ids)):
            block = tuple(ids[(offset + i) % len(ids)] for i in range(PREFIX_BLOCK))
            if block not in seen:
                seen.add(block)
                self.starts.append(offset)
        self.stride = spread_stride(len(self.starts))

    def prompt(self, length: int, index: int) -> list[int]:
        """`length` ids from the pool (wrapping around), from prompt `index`'s own offset."""
        start = self.starts[(index * self.stride) % len(self.starts)]
        return [self.ids[(start + i) % len(self.ids)] for i in range(length)]


def spread_stride(n: int) -> int:
    """The step nearest PROMPT_SPREAD * n that is coprime to n (1 for n <= 2): every index below n its own."""
    if n <= 2:
        return 1
    near = round(PROMPT_SPREAD * n)
    return min(
        (step for step in range(1, n) if math.gcd(step, n) == 1), key=lambda step: (abs(step - near), step)
    )


@dataclass(frozen=True)
class SweepTarget:
    """Where the sweep's requests go and what shapes them, for one row's server: its URL and model name, the
    token pool of its prompts, its max_model_len, the largest MoE call its processes make (the batched-token
    limit), and the config's request timeout and retries."""

    base_url: str
    model: str
    pool: TokenPool
    model_len: int
    max_tokens_per_call: int
    timeout: float
    retries: int

    def post(self, payloads: list[dict], concurrency: int) -> int:
        """The payloads, `concurrency` prompts at a time, each such group in one request (together()): how
        many requests that took."""
        grouped = together(payloads, concurrency)
        post_completions(
            self.base_url,
            grouped,
            lambda reply, i: reply.get("usage", {}),
            concurrency=1,
            timeout=self.timeout,
            retries=self.retries,
            backoff=1.0,
        )
        return len(grouped)

    def server_totals(self) -> server_metrics.Totals | None:
        """The server's own counters now (its /metrics); None where it does not answer."""
        return server_metrics.read_totals(self.base_url, self.timeout)

    def prefix_cache_hits(self) -> int | None:
        """Prompt tokens the server's prefix cache has served so far, over its engines (its /metrics counter
        vllm:prefix_cache_hits, in vLLM 0.26 and 0.32); None where the server does not say (stats off)."""
        return server_metrics.prefix_cache_hits(self.server_totals())

    def payload(self, length: int, tokens: int, index: int) -> dict:
        """Prompt `index` of this server, `length` tokens long, generating `tokens` tokens greedily."""
        return {
            "model": self.model,
            "prompt": self.pool.prompt(length, index),
            "max_tokens": tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }


def together(payloads: list[dict], concurrency: int) -> list[dict]:
    """The payloads in groups of `concurrency`, each group one request whose prompt is the list of its
    prompts (the completions API's batched prompt), sent one group after another. The server takes a
    request's prompts in together, so a decode group runs at or near its size (on the CPU: 8, 40 and 100
    tokens, a few steps at 98-99). Sent as separate
    requests from a pool of threads, 100 prompts reached the server over longer than their 12 tokens took on
    an H100: the Qwen3 twin's decode batch of 100 peaked at 88 sequences in one row and ramped through 12
    sizes in another, so the two rows' M=65-256 calls shared too few sizes for the speed gate to judge the
    range (2026-12-07, docs/perf.md). Payloads that differ in more than their prompt (the sweep sends none)
    are not merged: they go one by one."""
    if concurrency <= 1:
        return payloads
    groups = [payloads[i : i + concurrency] for i in range(0, len(payloads), concurrency)]
    merged = []
    for group in groups:
        shared = {k: v for k, v in group[0].items() if k != "prompt"}
        if len(group) > 1 and all({k: v for k, v in p.items() if k != "prompt"} == shared for p in group):
            merged.append({**shared, "prompt": [p["prompt"] for p in group]})
        else:
            merged.extend(group)
    return merged


def sweep_target(
    config: EvalConfig, data: Gsm8kData, base_url: str, model: str, max_tokens_per_call: int | None
) -> SweepTarget:
    """The row's SweepTarget: the pool from the config's scoring texts by the server's tokenizer, the server's
    max_model_len. max_tokens_per_call: the largest call the server's processes said they make (None or 0:
    vLLM's default batched-token limit)."""
    train, test = data.train_rows(), data.test_rows()
    texts = scoring_texts(train, test, config.num_fewshot, min(16, len(test))) if test else []
    timeout = config.request_timeout_seconds
    return SweepTarget(
        base_url=base_url,
        model=model,
        pool=TokenPool(token_pool(base_url, model, texts, timeout)),
        model_len=max_model_len(base_url, timeout),
        max_tokens_per_call=max_tokens_per_call or DEFAULT_MAX_TOKENS,
        timeout=timeout,
        retries=max(config.max_retries, 1),
    )


def reach_every_range(
    config: EvalConfig, target: SweepTarget, owed: Callable[[], dict[str, int]], first_index: int = 0
) -> dict[str, Any]:
    """The whole workload for a config's server: `sweep` on prompts from first_index on (those before went to
    the speed measurement, with the check paused), then fill_cells' rounds until the check can judge its
    cells or the config's layer_check_sweep_seconds, counted after the sweep, are spent."""
    sent = sweep(target, first_index)
    started = time.monotonic()
    sent["rounds"] = fill_cells(
        target,
        owed,
        deadline=started + config.layer_check_sweep_seconds,
        first_index=first_index + sent["requests"],
    )
    sent["requests"] += sum(r["requests"] for r in sent["rounds"])
    sent["posts"] += sum(r["posts"] for r in sent["rounds"])
    sent["seconds"] = round(sent["seconds"] + time.monotonic() - started, 2)
    return sent


def fill_cells(
    target: SweepTarget, owed: Callable[[], dict[str, int]], *, deadline: float, first_index: int
) -> list[dict[str, Any]]:
    """Step 4 of the module docstring. owed(): per range, the cells the layer check still cannot judge where
    the check needs them (the runner reads the processes' tables once each has copied them after the requests
    before: core/flushes.py); what each round found and sent, for results.json."""
    rounds: list[dict[str, Any]] = []
    index = first_index
    best, stalled = None, 0
    while len(rounds) < MAX_ROUNDS:
        wanted = owed()
        if rounds:
            rounds[-1]["owed_after"] = wanted
        total = sum(wanted.values())
        if best is None or total < best:
            best, stalled = total, 0
        else:
            stalled += 1
        # Three rounds in a row that judged nothing more: the cells left are not reachable this way.
        if not wanted or stalled >= STALLED_ROUNDS or time.monotonic() >= deadline:
            break
        sent = send_units(target, dict.fromkeys(wanted, 1), first_index=index)
        index += sent["requests"]
        rounds.append(
            {
                "owed": wanted,
                "sent": list(sent["units"]),
                "requests": sent["requests"],
                "posts": sent["posts"],
            }
        )
        if not sent["units"]:
            break
    return rounds


def send_units(target: SweepTarget, units: dict[str, int], *, first_index: int) -> dict[str, Any]:
    """`units[name]` more units of each range's workload (RANGE_UNITS), prompts from first_index on: a round
    of fill_cells, and the speed measurement's top-up of ranges short of what the speed gate needs
    (evaluate/moe_speed.py). Returns the units really sent (none for a range the server cannot reach)."""
    index, sent, posts = first_index, {}, 0
    for name, count in units.items():
        for _ in range(count):
            payloads, concurrency = _unit(target, name, index)
            if not payloads:  # the server cannot make such calls: nothing to send, nothing to record
                break
            index += len(payloads)
            posts += target.post(payloads, concurrency)
            sent[name] = sent.get(name, 0) + 1
    return {"units": sent, "requests": index - first_index, "posts": posts}


def _unit(target: SweepTarget, name: str, index: int) -> tuple[list[dict], int]:
    """One unit of a range's workload (RANGE_UNITS; >= 4096: prompts that fill a step at the batched-token
    limit); [] when the server cannot make such calls."""
    limit, model_len = target.max_tokens_per_call, target.model_len
    i = layer_range_names().index(name)
    if LAYER_RANGE_EDGES[i] > limit:
        return [], 0
    prompts, concurrent, length, tokens = RANGE_UNITS[i]
    room = model_len - DECODE_TOKENS - 1
    if prompts == 0:  # the largest calls: long prompts sent together, packed by chunked prefill
        length = min(room, max(PREFILL_LENGTHS))
        if length <= 0 or limit <= length:
            return [], 0
        # Twice the limit and one more, as the sweep's own batched prefill: a call of the range is a step
        # filled to the limit, and the first prompt to arrive is often scheduled alone. One limit's worth
        # plus a prompt made no such step on the CPU TEP server (limit 4096) in three rounds (2026-12-04),
        # and that row ended incomplete on the rarest expert's cell.
        prompts, tokens = -(-2 * limit // length) + 1, 1
        concurrent = prompts
    if length > min(model_len - tokens - 1, limit):
        return [], 0
    return [target.payload(length, tokens, index + j + 1) for j in range(prompts)], concurrent


def token_pool(base_url: str, model: str, texts: list[str], timeout: float) -> list[int]:
    """The texts' token ids by the server's own tokenizer (at least a few thousand, repeated if short)."""
    text = "\n\n".join(texts) if texts else FALLBACK_TEXT * 8
    try:
        reply = requests.post(
            f"{base_url}/tokenize",
            json={"model": model, "prompt": text, "add_special_tokens": False},
            timeout=timeout,
        )
        reply.raise_for_status()
        ids = [int(t) for t in reply.json()["tokens"]]
    except (requests.RequestException, KeyError, ValueError, TypeError) as exc:
        raise InfraError(f"layer check: POST {base_url}/tokenize failed: {exc}") from None
    if not ids:
        raise InfraError("layer check: the server's tokenizer returned no tokens for the sweep's texts")
    return ids


def max_model_len(base_url: str, timeout: float) -> int:
    try:
        reply = requests.get(f"{base_url}/v1/models", timeout=timeout)
        reply.raise_for_status()
        return int(reply.json()["data"][0]["max_model_len"])
    except (requests.RequestException, KeyError, IndexError, ValueError, TypeError) as exc:
        raise InfraError(f"layer check: GET {base_url}/v1/models gave no max_model_len: {exc}") from None


def sweep(target: SweepTarget, first_index: int = 0) -> dict[str, Any]:
    """Steps 1-3 of the module docstring, the target's prompts first_index + 1, + 2, ...: what was sent, with
    the wall seconds of each request group."""
    started = time.monotonic()
    index = first_index
    limit, model_len = target.max_tokens_per_call, target.model_len
    sent: dict[str, Any] = {
        "prefill_lengths": [],
        "batched_prefill": None,
        "decode_batches": [],
        # Wall seconds of each request group as the client saw them (the speed measurement's end-to-end view).
        "prefill_seconds": {},
        "decode_seconds": {},
        # The same requests as the engine timed them (server_metrics): each prefill's seconds, each decode
        # group's mean seconds between a sequence's tokens; None where the server's /metrics did not say.
        "engine_prefill_seconds": {},
        "engine_decode_step_seconds": {},
    }

    requests_sent = hashlib.sha256()

    posts = 0

    def post(payloads: list[dict], concurrency: int) -> float:
        nonlocal posts
        shape = [[p["prompt"], p["max_tokens"]] for p in payloads]
        requests_sent.update(json.dumps([concurrency, shape], separators=(",", ":")).encode())
        clock = time.monotonic()
        posts += target.post(payloads, concurrency)
        return round(time.monotonic() - clock, 4)

    def payload(length: int, tokens: int) -> dict:
        nonlocal index
        index += 1
        return target.payload(length, tokens, index)

    # The engine's times of each group: what a /metrics histogram gained since the reading before it (one
    # reading between two groups serves as the first's end and the second's start).
    reading = target.server_totals()

    def engine_mean(histogram: str) -> float | None:
        nonlocal reading
        before, reading = reading, target.server_totals()
        return server_metrics.mean_between(before, reading, histogram)

    room = model_len - DECODE_TOKENS - 1
    for length in PREFILL_LENGTHS:
        if length > min(room, limit):
            continue
        # Each prefill read apart, as the client's are: a compile while serving (vLLM's row, 1.2 s in one
        # call of 1500 tokens on the H100) moves a mean of three, not their median.
        walls, engine = [], []
        for _ in range(PREFILL_REPEATS):
            walls.append(post([payload(length, 1)], 1))
            engine.append(engine_mean(server_metrics.PREFILL_TIME))
        sent["prefill_seconds"][str(length)] = walls
        sent["engine_prefill_seconds"][str(length)] = engine
        sent["prefill_lengths"].append(length)
    longest = min(room, max(PREFILL_LENGTHS))
    if limit > longest and longest > 0:
        # Steps at the batched-token limit: prompts sent together are packed into calls of up to
        # max_tokens_per_call tokens by chunked prefill (twice the limit: at least one full step).
        count = -(-2 * limit // longest)
        seconds = post([payload(longest, 1) for _ in range(count)], count)
        sent["batched_prefill"] = {"prompts": count, "tokens_each": longest, "seconds": seconds}
        reading = target.server_totals()  # the decode groups' readings start after it
    for batch in DECODE_BATCHES:
        seconds = post([payload(DECODE_PROMPT_TOKENS, DECODE_TOKENS) for _ in range(batch)], batch)
        sent["decode_seconds"][str(batch)] = seconds
        sent["engine_decode_step_seconds"][str(batch)] = engine_mean(server_metrics.INTER_TOKEN_LATENCY)
        sent["decode_batches"].append(batch)
    sent["requests"] = index - first_index  # prompts: the next sender's prompts continue after them
    sent["posts"] = posts  # HTTP requests: a group of prompts sent at once is one (together())
    sent["seconds"] = round(time.monotonic() - started, 2)
    sent["ranges_targeted"] = [edge for edge in LAYER_RANGE_EDGES if edge <= limit]
    # What was sent, as one value: two rows' timings of the sweep compare only where it is the same (the
    # speed gate); the prompts follow the tokenizer, the task's texts, the limits and this module's code.
    sent["fingerprint"] = requests_sent.hexdigest()[:16]
    return sent
