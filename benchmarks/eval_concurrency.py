"""The GSM8K eval at several request concurrencies against one server: wall time, output tokens/s, and
whether the answers stay the answers (issue 42, item 5).

One server per config (its own server_args, env and kernel, as `moe-eval run` starts it, layer check and
timer off), then lm-eval through the harness's own `run_gsm8k` at each concurrency of `--concurrency`, in
that order; the first concurrency again at the end (`--repeat-first`, on by default) measures what the same
settings move by themselves (the batches a request shares depend on arrival times). An untimed warm-up
pass on a few questions comes first: the first lm-eval call of a process pays its imports and the
server's first requests (6-8 s more on the H200 canary, 2026-12-04). Per pass: seconds in all, seconds
from the first request sent to the last answer received (the rest is lm-eval building the task and
scoring: ~6 s a pass on this CPU whatever the concurrency), output tokens (the server's /tokenize of each
answer), accuracy, and against the first pass the questions whose answer text changed and the paired
McNemar test the harness's paired gate runs. The passes share one server, so later ones find the few-shot
prefixes in vLLM's prefix cache (the warm-up fills it first): a pass differs from the first by its
concurrency and by run-to-run batching, not by a cold cache. `--limit` sets the questions (a random-weight
twin's config asks for 8; the study wants hundreds of full-length answers).

    python benchmarks/eval_concurrency.py CONFIG.yaml --hw h200 --concurrency 16 64 256 --limit 200 \
        [--gsm8k-dir DIR] --out ROW.json
    python benchmarks/eval_concurrency.py --pair INCUMBENT.json CANDIDATE.json

`--pair` is the run's paired gate at each concurrency: the candidate row against the incumbent row, both at
that concurrency (the way `moe-eval run` pairs two configs of one list).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

from moe_eval.configs.config import EvalConfig, load_config
from moe_eval.core.results import versions
from moe_eval.evaluate import lm_eval_model
from moe_eval.evaluate.gsm8k import canary_data, gsm8k_data, run_gsm8k
from moe_eval.evaluate.serving import server_launch, serving
from moe_eval.gates.answers import correctness, first_response, per_question
from moe_eval.gates.stats import paired_compare
from moe_eval.models.builtin import resolve_model
from moe_eval.steps import count_answer_tokens

ALPHA = 0.05  # the paired gate's default alpha
WARMUP_QUESTIONS = 8


class RequestClock:
    """When lm-eval sent its first request and received its last answer: wraps the harness's client
    (lm_eval_model.ProgressCompletionsAPI: amodel_call, and model_call, lm-eval's path at concurrency 1) for
    this benchmark's process only."""

    def __init__(self) -> None:
        self.first_sent: float | None = None
        self.last_received: float | None = None
        api = lm_eval_model.ProgressCompletionsAPI
        inner_async, inner_sync = api.amodel_call, api.model_call

        async def timed_async(model_self, *args, **kwargs):
            with self._span():
                return await inner_async(model_self, *args, **kwargs)

        def timed_sync(model_self, *args, **kwargs):
            with self._span():
                return inner_sync(model_self, *args, **kwargs)

        api.amodel_call, api.model_call = timed_async, timed_sync

    @contextlib.contextmanager
    def _span(self):
        now = time.monotonic()
        self.first_sent = now if self.first_sent is None else min(self.first_sent, now)
        try:
            yield
        finally:
            self.last_received = time.monotonic()

    def reset(self) -> None:
        self.first_sent = self.last_received = None

    def seconds(self) -> float | None:
        if self.first_sent is None or self.last_received is None:
            return None
        return self.last_received - self.first_sent


def one_pass(
    config: EvalConfig, concurrency: int, base_url: str, model: str, data, work: Path, clock: RequestClock
) -> dict:
    at = dataclasses.replace(config, max_concurrency=concurrency)
    clock.reset()
    started = time.monotonic()
    outcome = run_gsm8k(at, base_url, model, data, work)
    seconds = time.monotonic() - started
    requests_seconds = clock.seconds()
    tokens = count_answer_tokens(base_url, model, outcome.samples) or {}
    texts = {qid: first_response(s) for qid, s in per_question(outcome.samples, "strict-match").items()}
    return {
        "concurrency": concurrency,
        "seconds": round(seconds, 2),
        "requests_seconds": None if requests_seconds is None else round(requests_seconds, 2),
        "questions": outcome.num_questions,
        "accuracy": outcome.scores["strict-match"]["accuracy"],
        "output_tokens": sum(tokens.values()),
        "output_tokens_per_s": round(sum(tokens.values()) / (requests_seconds or seconds), 1),
        "correct": {str(q): right for q, right in sorted(correctness(outcome.samples).items())},
        # A digest per answer: enough to say which answers changed, without storing model text.
        "answer_sha1": {str(q): hashlib.sha1(t.encode()).hexdigest()[:12] for q, t in sorted(texts.items())},
    }


def against(first: dict, other: dict) -> dict:
    """What changed from `first` to `other`: answer texts, and the paired gate's test on correctness."""
    changed = sum(1 for q, h in first["answer_sha1"].items() if other["answer_sha1"].get(q) != h)
    paired = paired_compare(_bools(first), _bools(other), ALPHA)
    return {"answers_changed": changed, "paired": paired.as_dict()}


def _bools(row: dict) -> dict[int, bool]:
    return {int(q): right for q, right in row["correct"].items()}


def measure(args: argparse.Namespace) -> dict:
    config = load_config(args.config)
    if args.limit:
        config = dataclasses.replace(config, num_questions=args.limit)
    data = canary_data() if config.task == "canary" else gsm8k_data(args.gsm8k_dir)
    model = resolve_model(config.model_name)
    order = list(args.concurrency) + ([args.concurrency[0]] if args.repeat_first else [])
    with tempfile.TemporaryDirectory(prefix="eval-concurrency-") as tmp:
        work = Path(tmp)
        plan = server_launch(
            config,
            model,
            hw=args.hw,
            devices=None,
            run_dir=work,
            log_path=work / "server.log",
            moe_backend=config.moe_backend,
            layer_check=False,
            moe_timing=False,
        )
        passes = []
        clock = RequestClock()
        with serving(plan, config.name, lambda line: print(line, flush=True)) as served:
            if args.warmup:
                warm = dataclasses.replace(config, num_questions=min(WARMUP_QUESTIONS, config.num_questions))
                one_pass(warm, order[0], served.base_url, model, data, work, clock)
            for concurrency in order:
                row = one_pass(config, concurrency, served.base_url, model, data, work, clock)
                passes.append(row)
                print(
                    f"{config.name} c={concurrency}: {row['seconds']} s "
                    f"({row['requests_seconds']} s of requests), "
                    f"{row['output_tokens_per_s']} tok/s, "
                    f"accuracy {row['accuracy']:.4f}",
                    flush=True,
                )
            used = served.moe_backend_used
    for row in passes[1:]:
        row["vs_first"] = against(passes[0], row)
    return {
        "config": str(args.config),
        "name": config.name,
        "moe_backend_used": used,
        "hw": args.hw,
        "questions": config.num_questions,
        "max_tokens": config.max_tokens,
        "versions": versions(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "passes": passes,
    }


def pair(incumbent: dict, candidate: dict) -> list[dict]:
    """The paired gate per concurrency: the candidate's pass against the incumbent's, the first of each."""
    rows = []
    firsts = {}
    for row in incumbent["passes"]:
        firsts.setdefault(row["concurrency"], row)
    seen = set()
    for row in candidate["passes"]:
        c = row["concurrency"]
        if c in seen or c not in firsts:
            continue
        seen.add(c)
        result = against(firsts[c], row)
        rows.append({"concurrency": c, **result})
    return rows


def table(result: dict) -> str:
    lines = [
        f"{result['name']} ({result['moe_backend_used']}), {result['questions']} questions",
        "| concurrency | seconds | of which requests | output tok/s | accuracy | answers changed vs first "
        "| paired p(worse) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["passes"]:
        vs = row.get("vs_first")
        changed = "-" if vs is None else str(vs["answers_changed"])
        p = "-" if vs is None else f"{vs['paired']['p_worse']:.3g}"
        lines.append(
            f"| {row['concurrency']} | {row['seconds']} | {row['requests_seconds']} | "
            f"{row['output_tokens_per_s']} | "
            f"{row['accuracy']:.4f} | {changed} | {p} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path, nargs="?")
    parser.add_argument("--hw", default="cpu", choices=["cpu", "h100", "h200", "b200"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeat-first", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--limit", type=int, help="questions (default: the config's num_questions)")
    parser.add_argument("--gsm8k-dir", help="GSM8K train/test.jsonl folder (GSM8K configs)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--pair", nargs=2, type=Path, metavar=("INCUMBENT", "CANDIDATE"))
    args = parser.parse_args(argv)
    if args.pair:
        incumbent, candidate = (json.loads(p.read_text()) for p in args.pair)
        print(json.dumps(pair(incumbent, candidate), indent=1))
        return 0
    if args.config is None:
        parser.error("a config (or --pair)")
    result = measure(args)
    print(table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
