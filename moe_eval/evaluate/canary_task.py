"""A synthetic arithmetic task in GSM8K's form, generated from a seed (never copied data).

Each item is {"question": ..., "answer": "<worked steps>\\n#### <number>"}: one to three steps of
sums, differences and small products of two-digit numbers (carries and borrows included), so
lm-eval's gsm8k prompt ("Question: ...\\nAnswer:"), its few-shot format and its `strict-match`
and `flexible-extract` filters apply unchanged. Train and test splits never share a question.
Usage:

    train, test = canary_splits()  # the canary's own; make_splits(seed, n_train, n_test) for others
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from moe_eval.configs.config import GSM8K_TEST_QUESTIONS

# The canary's splits: the training script, the agreement check and the harness's cached task all use these.
SPLIT_SEED = 0
N_TRAIN = 2000  # the few-shot pool
N_TEST = GSM8K_TEST_QUESTIONS  # as many test questions as GSM8K's test split

NAMES = [
    "Ava",
    "Ben",
    "Cara",
    "Dan",
    "Eli",
    "Fay",
    "Gus",
    "Hana",
    "Ivan",
    "Jill",
    "Kai",
    "Lena",
    "Milo",
    "Nora",
    "Omar",
    "Pia",
    "Quinn",
    "Rosa",
    "Sam",
    "Tess",
]
THINGS = [
    "apples",
    "books",
    "coins",
    "eggs",
    "pens",
    "cards",
    "shells",
    "stamps",
    "beads",
    "cookies",
    "marbles",
    "stickers",
]


def _step(rng: random.Random, name: str, thing: str, have: int) -> tuple[str, str, int]:
    """One step applied to `have`: (question sentence, worked line, new amount)."""
    kind = rng.choice(["add", "add", "sub", "mul"])
    if kind == "mul" and have <= 12:
        k = rng.randint(2, 9)
        return f"Then {name} gets {k} times as many.", f"{have} * {k} = {have * k}", have * k
    if kind == "sub" and have >= 2:
        n = rng.randint(1, min(have - 1, 99))
        return f"Then {name} gives away {n}.", f"{have} - {n} = {have - n}", have - n
    n = rng.randint(1, 99)
    return f"Then {name} finds {n} more.", f"{have} + {n} = {have + n}", have + n


def make_problem(rng: random.Random) -> dict[str, str]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    have = rng.randint(2, 99)
    sentences = [f"{name} has {have} {thing}."]
    lines = []
    for _ in range(rng.randint(1, 3)):
        sentence, line, have = _step(rng, name, thing, have)
        sentences.append(sentence)
        lines.append(line)
    sentences.append(f"How many {thing} does {name} have now?")
    return {"question": " ".join(sentences), "answer": "\n".join(lines) + f"\n#### {have}"}


def make_splits(seed: int, n_train: int, n_test: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    seen: set[str] = set()
    items: list[dict] = []
    while len(items) < n_train + n_test:
        item = make_problem(rng)
        if item["question"] not in seen:  # no question appears twice, so the splits cannot overlap
            seen.add(item["question"])
            items.append(item)
    return items[:n_train], items[n_train:]


def canary_splits(seed: int = SPLIT_SEED) -> tuple[list[dict], list[dict]]:
    """The canary's (train, test) splits."""
    return make_splits(seed, N_TRAIN, N_TEST)


def write_splits(out_dir: Path, seed: int = SPLIT_SEED, n_train: int = N_TRAIN, n_test: int = N_TEST) -> Path:
    """train.jsonl and test.jsonl in GSM8K's format; returns the folder."""
    train, test = make_splits(seed, n_train, n_test)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        (out_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out_dir
