"""Two scorings of the same texts on one server, compared bit for bit (the repeat check's measurement:
moe_eval.steps.RepeatScores makes it, moe_eval.gates.repeat judges it). In memory, on the values as served:
the files keep log p to 6 decimals, too coarse for "bit for bit"."""

from __future__ import annotations

import math
from collections.abc import Sequence

from typing_extensions import NotRequired, TypedDict  # pydantic reads typing's TypedDict from 3.12 only

from moe_eval.core.logprob_texts import TextLogprobs


class FirstDifference(TypedDict):
    """The first position, in text order, whose numbers differ."""

    text: int
    """the text's index"""
    position: int
    """the token position in it"""
    first: float | None
    """log p of the text's own token, first scoring"""
    again: float | None
    """the same, second scoring"""


class RepeatSection(TypedDict):
    """results.json `repeat`: the scored texts against their second scoring on the same server."""

    texts: int
    """texts scored twice"""
    positions: int
    """positions compared (each text's tokens after its first)"""
    identical: bool
    """every text tokenized alike and every position's log p, top-k ids and their log p equal as numbers
    (0.0 and -0.0 alike, a NaN in both alike)"""
    differing_positions: int
    """positions where any of those differ"""
    differing_texts: int
    """texts with at least one such position"""
    max_abs_difference: float
    """the largest finite |log p first - log p again| of a text's own token (0 where identical, and where
    only the top-k, a NaN or an infinite log p moved)"""
    first_difference: NotRequired[FirstDifference]
    """where they first differ"""
    gated: bool
    """false: reported only (repeat_gate is not set)"""


def _same(a: float | None, b: float | None) -> bool:
    # Equal as numbers: what a reader of the log-probabilities sees. A NaN in both is alike for this purpose
    # (the divergence gate names NaNs, not this check).
    return a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))


def _first_apart(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The first position whose token differs (the shorter length where one is the other's start)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _position_differs(first: TextLogprobs, again: TextLogprobs, position: int) -> bool:
    a_top, b_top = first.top_logprobs[position], again.top_logprobs[position]
    return (
        not _same(first.logprobs[position], again.logprobs[position])
        or first.top_ids[position] != again.top_ids[position]
        or (a_top is None) != (b_top is None)
        or (a_top is not None and b_top is not None and not all(map(_same, a_top, b_top)))
    )


def compare_scorings(first: Sequence[TextLogprobs], again: Sequence[TextLogprobs]) -> RepeatSection:
    """The two scorings of the same texts, position by position (a text tokenized otherwise the second time
    differs from its first token apart on)."""
    if len(first) != len(again):
        raise ValueError(f"{len(first)} texts scored first, {len(again)} the second time")
    positions = differing = differing_texts = 0
    largest = 0.0
    where: FirstDifference | None = None
    for a, b in zip(first, again):
        count = max(len(a), len(b)) - 1  # position 0 has no log p
        positions += count
        if a.token_ids != b.token_ids:  # tokenized otherwise: every position after the first apart differs
            apart = _first_apart(a.token_ids, b.token_ids)
            differing += count - max(apart - 1, 0)
            differing_texts += 1
            where = where or FirstDifference(text=a.index, position=max(apart, 1), first=None, again=None)
            continue
        in_text = 0
        for position in range(1, len(a)):
            if not _position_differs(a, b, position):
                continue
            in_text += 1
            x, y = a.logprobs[position], b.logprobs[position]
            if x is not None and y is not None and math.isfinite(x) and math.isfinite(y):
                largest = max(largest, abs(x - y))
            where = where or FirstDifference(text=a.index, position=position, first=x, again=y)
        differing += in_text
        differing_texts += in_text > 0
    section = RepeatSection(
        texts=len(first),
        positions=positions,
        identical=differing_texts == 0,
        differing_positions=differing,
        differing_texts=differing_texts,
        max_abs_difference=largest,
        gated=False,
    )
    if where is not None:
        section["first_difference"] = where
    return section
