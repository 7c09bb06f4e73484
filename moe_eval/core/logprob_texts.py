"""Scored texts as records: a text's tokens with their log-probabilities and top-k (`TextLogprobs`), and
the JSONL files a run keeps them in (logprobs.jsonl, decode.jsonl, the golden's). Captured through a server
by moe_eval.evaluate.logprobs; compared by moe_eval.gates.divergence and moe_eval.gates.golden_errors."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_eval.core.errors import ConfigError
from moe_eval.core.results import atomic_write_text

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
