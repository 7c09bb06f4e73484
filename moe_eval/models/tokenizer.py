"""The tokenizer of the models moe-eval builds (the tiny model, the canary, the shape twins): byte-level BPE
trained here on generated text, so nothing is downloaded. Shared by models/builtin.py and models/twins.py
(it was in models.py, which twins.py then imported while models.py imported twins.py: a circle)."""

from __future__ import annotations

import random
from collections.abc import Iterable

EOS_TOKEN = "<|endoftext|>"


def tokenizer_corpus(seed: int, lines: int = 4000) -> list[str]:
    """Arithmetic word-problem-like text, generated: the tokenizer learns digits, words, punctuation."""
    rng = random.Random(seed)
    names = ["Natalia", "James", "Weng", "Betty", "Julie", "Mark", "Tina", "Alexis", "Ken", "Ann"]
    things = ["clips", "apples", "dollars", "pages", "eggs", "books", "hours", "miles", "cookies", "cards"]
    verbs = ["sold", "bought", "earned", "read", "baked", "found", "spent", "gave", "made", "has"]
    out = []
    for _ in range(lines):
        a, b = rng.randint(1, 999), rng.randint(1, 99)
        n, t, v = rng.choice(names), rng.choice(things), rng.choice(verbs)
        out.append(
            f"Question: {n} {v} {a} {t} in May and {b} more in June. How many {t} in total?\n"
            f"Answer: {n} {v} {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {t}.\n#### {a + b}"
        )
    return out


def bpe_tokenizer(corpus: Iterable[str], vocab_size: int, max_length: int, split_digits: bool = False):
    """A byte-level BPE tokenizer trained on `corpus`: any text tokenizes (no unknown tokens), as with
    real models' tokenizers; EOS_TOKEN is its one special token, also the pad token; no BOS.
    `split_digits`: every digit its own token (the canary's arithmetic needs place value)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if split_digits
        else byte_level
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        bos_token=None,
        model_max_length=max_length,
    )
