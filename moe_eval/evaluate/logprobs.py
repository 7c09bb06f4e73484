"""Log-probability divergence: how far a kernel moves the model's numbers, not only its answers.

The accuracy gate only sees a kernel bug once it flips whole answers; a bug that shifts every
logit a little (a lost scale, a bf16 accumulation) passes it. This module scores N fixed texts
(GSM8K questions with their reference answers, behind a fixed few-shot block) on a running
server, keeps each position's log-probability and top-k, and compares two such captures.

Stages:
  1. `scoring_texts`: the N texts, in lm-eval's gsm8k prompt format.
  2. `capture`: POST each text to /v1/completions with echo + logprobs (prompt logprobs).
  3. `write_logprobs` / `read_logprobs` (moe_eval.core.logprob_texts): one compact JSONL line per text.
  4. `divergence` (moe_eval.gates.divergence): |Δ log p| of the reference tokens, top-1 flips, KL over
     the shared top-k; `divergence_checks`: one `Check` per configured limit.
This module is the I/O half (texts, requests to a server); the comparison is pure and lives in gates/.

Usage:

    div = divergence(read_logprobs(base_path), capture(url, model, scoring_texts(train, test, 5, 64)))
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from moe_eval.core.errors import ConfigError, InfraError
from moe_eval.core.logprob_texts import TOP_K, TextLogprobs

# --- stage 1: the texts ------------------------------------------------------------------------

# lm-eval 0.4.13 lm_eval/tasks/gsm8k/gsm8k.yaml: doc_to_text "Question: {{question}}\nAnswer:",
# doc_to_target "{{answer}}", and no delimiters of its own, so TaskConfig's defaults apply:
# target_delimiter " " (between "Answer:" and the answer), fewshot_delimiter "\n\n" (after each
# shot). tests/reports/test_logprobs.py renders the same rows through lm-eval itself to hold this.
# The one few-shot format of the project: the canary's training data (canary/train.py) uses it too.
TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"


def _shot(row: dict, where: str) -> str:
    try:
        question, answer = row["question"], row["answer"]
    except (KeyError, TypeError):
        raise ValueError(f"{where}: a GSM8K row needs 'question' and 'answer'; got {row!r:.120}") from None
    return f"Question: {question}\nAnswer:{TARGET_DELIMITER}{answer}"


def scoring_texts(train_rows: list[dict], test_rows: list[dict], num_fewshot: int, n: int) -> list[str]:
    """N texts: the first `num_fewshot` train rows as shots, then test question i with its reference
    answer. The shots are fixed (lm-eval samples them per question), so every text shares one prefix
    and a capture depends on the kernel alone."""
    if not 0 <= num_fewshot <= len(train_rows):
        raise ValueError(f"num_fewshot {num_fewshot}: the train rows hold {len(train_rows)}")
    if not 1 <= n <= len(test_rows):
        raise ValueError(f"n {n}: the test rows hold {len(test_rows)} (need 1..{len(test_rows)})")
    prefix = "".join(
        _shot(row, f"train row {i}") + FEWSHOT_DELIMITER for i, row in enumerate(train_rows[:num_fewshot])
    )
    return [prefix + _shot(row, f"test row {i}") for i, row in enumerate(test_rows[:n])]


def read_rows(path: Path | str) -> list[dict]:
    """A JSONL file of GSM8K rows (one object per line; blank lines skipped)."""
    path = Path(path)
    rows = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


# --- stage 2: capture --------------------------------------------------------------------------


_TOKEN_ID_PREFIX = "token_id:"  # vLLM's format_token_id_placeholder under return_tokens_as_token_ids


def _token_id(token: Any, what: str) -> int:
    if not isinstance(token, str) or not token.startswith(_TOKEN_ID_PREFIX):
        raise ValueError(
            f"{what} is {token!r:.40}, not 'token_id:<int>' (does the server honour "
            "return_tokens_as_token_ids?)"
        )
    return int(token[len(_TOKEN_ID_PREFIX) :])


def _top_k(entry: dict[str, float], top_k: int, what: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    # vLLM puts the text's own token first in each position's dict, then the top-k; when that token
    # is not in the top-k the dict holds k + 1 entries (serving.py keeps indices 0..k). Sorting and
    # cutting at k recovers the true top-k; ties (equal log p) go to the smaller id, as in divergence().
    pairs = sorted(
        ((_token_id(tok, what), float(lp)) for tok, lp in entry.items()), key=lambda p: (-p[1], p[0])
    )
    pairs = pairs[:top_k]
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def _logprob_lists(reply: dict) -> tuple[list, list, list]:
    """choices[0].logprobs' tokens, token_logprobs and top_logprobs, checked to be of one length."""
    try:
        lp = reply["choices"][0]["logprobs"]
        tokens, token_lps, tops = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(
            f"no choices[0].logprobs with tokens/token_logprobs/top_logprobs in {reply!s:.200}"
        ) from None
    if not (len(tokens) == len(token_lps) == len(tops)):
        raise ValueError(
            f"logprobs lists differ in length: tokens {len(tokens)}, token_logprobs "
            f"{len(token_lps)}, top_logprobs {len(tops)}"
        )
    return tokens, token_lps, tops


def parse_completion(reply: dict, index: int, top_k: int) -> TextLogprobs:
    """The echoed prompt's logprobs from one vLLM completions reply (echo, logprobs, max_tokens 1).

    Raises ValueError when the reply is not shaped as expected."""
    tokens, token_lps, tops = _logprob_lists(reply)
    # The echo is prompt + generated; usage says where the prompt ends. Without usage, assume the one
    # token max_tokens=1 asked for.
    usage = reply.get("usage") or {}
    n_prompt = usage.get("prompt_tokens")
    n_generated = usage.get("completion_tokens")
    if n_prompt is None:
        n_prompt = len(tokens) - (1 if n_generated is None else n_generated)
    if n_generated is not None and n_prompt + n_generated != len(tokens):
        raise ValueError(
            f"usage says {n_prompt} prompt + {n_generated} generated tokens, the echo holds {len(tokens)}"
        )
    if not 1 <= n_prompt <= len(tokens):
        raise ValueError(f"prompt of {n_prompt} tokens in an echo of {len(tokens)}")
    ids, lps, top_ids, top_lps = [], [], [], []
    for pos in range(n_prompt):
        what = f"position {pos}"
        ids.append(_token_id(tokens[pos], what))
        if token_lps[pos] is None or tops[pos] is None:
            if pos != 0:
                raise ValueError(f"{what} has no logprob (only position 0 may lack one)")
            lps.append(None)
            top_ids.append(None)
            top_lps.append(None)
            continue
        lps.append(float(token_lps[pos]))
        t_ids, t_lps = _top_k(tops[pos], top_k, what)
        top_ids.append(t_ids)
        top_lps.append(t_lps)
    return TextLogprobs(index, tuple(ids), tuple(lps), tuple(top_ids), tuple(top_lps))


def capture(
    base_url: str,
    model: str,
    texts: list[str],
    *,
    top_k: int = TOP_K,
    concurrency: int = 1,
    timeout: float = 300,
    retries: int = 3,
    backoff: float = 1.0,
) -> list[TextLogprobs]:
    """Score each text on a running vLLM OpenAI server; results in text order.

    One request at a time by default: on the H200 two sequential passes of the same kernel gave
    bitwise identical logprobs, while concurrent requests batched differently moved them by ~0.006
    mean |Δ log p|, which would drown the differences this measures. (A request with prompt logprobs
    never reads vLLM's prefix cache, SamplingParams.skip_reading_prefix_cache, so the shared few-shot
    prefix is recomputed every time.) `retries` is the attempts per text (as the configs'
    max_retries): connection errors, timeouts and 5xx are retried after backoff, 2 x backoff, ...
    seconds; when they are spent, or at once on a 4xx or a reply of the wrong shape, InfraError."""
    # prompt_logprobs follow `logprobs` under echo; return_tokens_as_token_ids keys every token by
    # id, so two tokens that decode to the same text never collide in a top_logprobs dict.
    payloads = [
        {
            "model": model,
            "prompt": text,
            "echo": True,
            "logprobs": top_k,
            "max_tokens": 1,
            "temperature": 0.0,
            "return_tokens_as_token_ids": True,
        }
        for text in texts
    ]
    return post_completions(
        base_url,
        payloads,
        lambda reply, i: parse_completion(reply, i, top_k),
        concurrency=concurrency,
        timeout=timeout,
        retries=retries,
        backoff=backoff,
    )


def decode_prompts(train_rows: list[dict], test_rows: list[dict], num_fewshot: int, n: int) -> list[str]:
    """The first n scoring texts cut after "Answer:": the prompt lm-eval sends for question i, with the
    fixed few-shot block of `scoring_texts`. What the model generates from it runs the decode path."""
    texts = scoring_texts(train_rows, test_rows, num_fewshot, n)
    cut = [text.rsplit("Answer:" + TARGET_DELIMITER, 1) for text in texts]
    return [head + "Answer:" for head, _ in cut]


def capture_decode(
    base_url: str,
    model: str,
    prompts: list[str],
    *,
    tokens: int,
    top_k: int = TOP_K,
    timeout: float = 300,
    retries: int = 3,
    backoff: float = 1.0,
) -> list[TextLogprobs]:
    """Greedy continuations of `prompts`, `tokens` at most each, with each generated token's log p and
    top-k: the decode path (one token per step, CUDA graphs on a GPU server), which prefill scoring never
    reaches. One request at a time, as `capture`. Position i of a record is generated token i."""
    payloads = [
        {
            "model": model,
            "prompt": prompt,
            "logprobs": top_k,
            "max_tokens": tokens,
            "temperature": 0.0,
            "return_tokens_as_token_ids": True,
        }
        for prompt in prompts
    ]
    return post_completions(
        base_url,
        payloads,
        lambda reply, i: parse_generation(reply, i, top_k),
        concurrency=1,
        timeout=timeout,
        retries=retries,
        backoff=backoff,
    )


def parse_generation(reply: dict, index: int, top_k: int) -> TextLogprobs:
    """The generated tokens' logprobs from one completions reply without echo. ValueError when the
    reply is not shaped as expected."""
    tokens, token_lps, tops = _logprob_lists(reply)
    if not tokens:
        raise ValueError("generated logprobs empty")
    ids, lps, top_ids, top_lps = [], [], [], []
    for pos, (token, token_lp, top) in enumerate(zip(tokens, token_lps, tops)):
        what = f"generated token {pos}"
        if token_lp is None or top is None:
            raise ValueError(f"{what} has no logprob")
        ids.append(_token_id(token, what))
        lps.append(float(token_lp))
        t_ids, t_lps = _top_k(top, top_k, what)
        top_ids.append(t_ids)
        top_lps.append(t_lps)
    return TextLogprobs(index, tuple(ids), tuple(lps), tuple(top_ids), tuple(top_lps))


def post_completions(
    base_url: str,
    payloads: list[dict],
    parse: Any,
    *,
    concurrency: int,
    timeout: float,
    retries: int,
    backoff: float,
) -> list[TextLogprobs]:
    """POST each payload to /v1/completions and parse its reply; retries as `capture` says."""
    import requests  # lazy: the module's other stages need no HTTP

    url = base_url.rstrip("/") + "/v1/completions"
    local = threading.local()  # one keep-alive session per worker thread (a Session is not thread-safe)
    sessions: list[requests.Session] = []

    def post(index: int) -> TextLogprobs:
        session = getattr(local, "session", None)
        if session is None:
            session = local.session = requests.Session()
            sessions.append(session)
        problem = ""
        for attempt in range(max(retries, 1)):
            if attempt:
                time.sleep(backoff * 2 ** (attempt - 1))
            try:
                response = session.post(url, json=payloads[index], timeout=timeout)
            except requests.RequestException as exc:
                problem = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code >= 500:
                problem = f"HTTP {response.status_code}: {response.text[:300]}"
                continue
            if response.status_code != 200:
                # A 4xx (text longer than max_model_len, unknown model, logprobs above the server's
                # max_logprobs) fails the same way every time: no retry.
                raise InfraError(
                    f"POST {url} (text {index}): HTTP {response.status_code}: {response.text[:300]}"
                )
            try:
                return parse(response.json(), index)
            except ValueError as exc:  # includes a body that is not JSON
                raise InfraError(f"POST {url} (text {index}): unexpected reply: {exc}") from None
        raise InfraError(f"POST {url} (text {index}): {max(retries, 1)} attempts failed; last: {problem}")

    try:
        if concurrency <= 1:
            return [post(i) for i in range(len(payloads))]
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return list(pool.map(post, range(len(payloads))))
    finally:
        for session in sessions:
            session.close()


# --- stage 3: files ----------------------------------------------------------------------------
