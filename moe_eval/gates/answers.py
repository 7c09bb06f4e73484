"""lm-eval's per-question samples, read for the gates: each question's first answer and its strict-match
correctness, and the answers' counts (empty, truncated, without a number) the garbage gate limits."""

from __future__ import annotations

from typing import Any

INVALID = "[invalid]"  # what lm-eval's regex filters leave when they find nothing


def first_response(sample: dict[str, Any]) -> str:
    resps = sample.get("resps") or [[""]]
    first = resps[0]
    return first[0] if isinstance(first, list) and first else str(first)


def _filtered(sample: dict[str, Any]) -> str:
    filtered = sample.get("filtered_resps") or [""]
    return filtered[0] if isinstance(filtered, list) else str(filtered)


def per_question(samples: list[dict[str, Any]], filter_name: str) -> dict[int, dict[str, Any]]:
    return {s["doc_id"]: s for s in samples if s.get("filter") == filter_name}


def correctness(samples: list[dict[str, Any]], filter_name: str = "strict-match") -> dict[int, bool]:
    return {qid: bool(s.get("exact_match")) for qid, s in per_question(samples, filter_name).items()}


def answer_stats(
    samples: list[dict[str, Any]], token_counts: dict[int, int] | None, max_tokens: int
) -> dict[str, Any]:
    strict = per_question(samples, "strict-match")
    flexible = per_question(samples, "flexible-extract")
    n = len(strict)
    empty = sum(1 for s in strict.values() if not first_response(s).strip())
    invalid = sum(1 for qid in strict if qid in flexible and _filtered(flexible[qid]) == INVALID)
    no_strict = sum(1 for s in strict.values() if _filtered(s) == INVALID)
    truncated = None if token_counts is None else sum(1 for c in token_counts.values() if c >= max_tokens)
    return {
        "questions": n,
        "empty": empty,
        "invalid": invalid,
        "no_strict_answer": no_strict,
        "truncated": truncated,
        "max_tokens": max_tokens,
    }
