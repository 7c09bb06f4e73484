"""GSM8K through lm-eval against a running server's /v1/completions.

lm-eval's own `gsm8k` task (prompt, few-shot split, `strict-match` and `flexible-extract`
filters) is used as is. With a local data folder the task is re-pointed at its two JSONL
files and the hub is switched off, so nothing reaches the network. Usage:

    outcome = run_gsm8k(config, base_url, model, Gsm8kData(Path("../shared/data/gsm8k")), work_dir)
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from moe_eval.configs.config import EvalConfig
from moe_eval.core.errors import ConfigError, InfraError
from moe_eval.evaluate.canary_task import SPLIT_SEED, write_splits

# sha256 of the original OpenAI release (grade-school-math @ 3101c7d), as lm-eval's hub copy.
ORIGINAL_SHA256 = {
    "train.jsonl": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
    "test.jsonl": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
}
HUB_TASK = "gsm8k"
HUB_DATASET, HUB_CONFIG = "openai/gsm8k", "main"  # what lm-eval's gsm8k task loads (its dataset_path/_name)
LOCAL_TASK = "gsm8k_local_files"
CANARY_TASK = "canary_arith"
FILTERS = ("strict-match", "flexible-extract")


@dataclass(frozen=True)
class Gsm8kData:
    """Where the questions come from: the hub (dir None), a local GSM8K folder, or the canary's
    generated task (same prompt, few-shot layout and filters as gsm8k, other rows)."""

    dir: Path | None
    generated: bool = False
    extra_stops: tuple[str, ...] = ()  # generation also stops at these, besides lm-eval's own stop sequences

    @property
    def task_name(self) -> str:
        if self.generated:
            return CANARY_TASK
        return HUB_TASK if self.dir is None else LOCAL_TASK

    def test_rows(self) -> list[dict]:
        """The test split's rows (question, answer); [] where the hub's cannot be had (`unavailable`)."""
        return self._rows("test")

    def train_rows(self) -> list[dict]:
        """The train split's rows (the few-shot pool); [] where the hub's cannot be had."""
        return self._rows("train")

    def unavailable(self) -> str | None:
        """Why the rows cannot be had (the hub's dataset neither reachable nor cached), or None."""
        return None if self.dir is not None else hub_split("test")[1] or hub_split("train")[1]

    def _rows(self, split: str) -> list[dict]:
        if self.dir is None:
            return list(hub_split(split)[0])
        text = (self.dir / f"{split}.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def describe(self) -> dict[str, Any]:
        if self.dir is None:
            return {"source": "hub", "dataset": "openai/gsm8k (main)"}
        hashes = {name: _sha256(self.dir / name) for name in ORIGINAL_SHA256}
        if self.generated:
            return {
                "source": "generated",
                "task": CANARY_TASK,
                # An identity compared by --resume (questions_difference), not an import path: kept as it was
                # recorded before the task's module moved to evaluate/canary_task.py.
                "generator": "moe_eval.canary.task",
                "seed": SPLIT_SEED,
                "dir": str(self.dir),
                "sha256": hashes,
            }
        return {
            "source": "local",
            "dir": str(self.dir),
            "sha256": hashes,
            "matches_original_release": hashes == ORIGINAL_SHA256,
        }


@functools.cache
def hub_split(split: str) -> tuple[tuple[dict, ...], str | None]:
    """The hub's GSM8K split through the `datasets` library, as lm-eval's task loads it (so from the same
    cache: HF_HOME, HF_DATASETS_OFFLINE), for the scoring texts and the progress view's references; the
    rows, or () and why not. Loaded once per process."""
    try:
        import datasets

        rows = datasets.load_dataset(HUB_DATASET, HUB_CONFIG, split=split)
        return tuple({"question": r["question"], "answer": r["answer"]} for r in rows), None
    except Exception as exc:  # noqa: BLE001  no network and no cache, a moved dataset: the run says why
        return (), f"{HUB_DATASET} ({HUB_CONFIG}, {split}) could not be loaded: {type(exc).__name__}: {exc}"


def hub_preflight() -> str | None:
    """Before any server starts: why the hub's GSM8K cannot be had (not in the `datasets` cache, and the
    hub switched off or not reachable), or None. A cheap look, not a load: the cache's folder for the
    dataset, then one TCP connection to the hub with a short timeout (loading through `datasets` retries
    for 25 s when the name does not resolve)."""
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    cache = Path(os.environ.get("HF_DATASETS_CACHE") or home / "datasets")
    folder = cache / HUB_DATASET.replace("/", "___") / HUB_CONFIG
    if any(folder.glob("*/*/dataset_info.json")):
        return None
    where = f"{HUB_DATASET} ({HUB_CONFIG}) is not in the datasets cache ({folder})"
    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(flag, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{where} and {flag} is set"
    import socket

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]
    host, _, port = endpoint.partition(":")
    try:
        socket.create_connection((host, int(port or 443)), timeout=5).close()
    except OSError as exc:
        return f"{where} and the hub ({host}) is not reachable: {exc}"
    return None


def questions_difference(recorded: dict[str, Any] | None, current: dict[str, Any]) -> str | None:
    """How a results file's `gsm8k` description and `current` name other questions (None: the same ones):
    the source, then each file whose hash differs. Where the files lie is not part of it (a resumed run may
    read the same files from another folder: seen on a GPU machine whose generated canary task sat under
    another HOME)."""
    if not recorded:
        return "the earlier run recorded no description of its questions"

    def identity(described: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in described.items() if key != "dir"}

    was, now = identity(recorded), identity(current)
    if was == now:
        return None
    if was.get("source") != now.get("source"):
        return f"questions from {was.get('source')} then, from {now.get('source')} now"
    hashes_then, hashes_now = was.get("sha256") or {}, now.get("sha256") or {}
    files = sorted(
        name for name in set(hashes_then) | set(hashes_now) if hashes_then.get(name) != hashes_now.get(name)
    )
    if files:
        return "other questions: " + ", ".join(files) + (" differs" if len(files) == 1 else " differ")
    moved = sorted(key for key in set(was) | set(now) if was.get(key) != now.get(key))
    return "other questions: " + ", ".join(f"{key} {was.get(key)} -> {now.get(key)}" for key in moved)


def canary_data() -> Gsm8kData:
    """The canary task's splits, generated once into the cache (deterministic: seed SPLIT_SEED)."""
    from moe_eval.models.builtin import cache_root

    folder = cache_root() / "tasks" / f"canary-arith-v1-seed{SPLIT_SEED}"
    if not (folder / "test.jsonl").exists():
        staging = write_splits(folder.with_name(f"{folder.name}.tmp-{os.getpid()}"))
        try:
            staging.replace(folder)  # atomic: readers see both splits or none
        except OSError:  # another run made it first: same seed, same files
            shutil.rmtree(staging, ignore_errors=True)
    # The canary was trained with its loss on answers and the blank line after them, not on the next
    # "Question:", so it ends an answer with blank lines; its answers never hold one, so stop there too.
    return Gsm8kData(folder, generated=True, extra_stops=("\n\n",))


def gsm8k_data(dir_option: str | None) -> Gsm8kData:
    if not dir_option:
        return Gsm8kData(None)
    path = Path(dir_option).expanduser().resolve()
    missing = [name for name in ORIGINAL_SHA256 if not (path / name).is_file()]
    if missing:
        raise ConfigError(
            f"--gsm8k-dir: value '{dir_option}' lacks {', '.join(missing)} "
            "(a GSM8K folder holds train.jsonl and test.jsonl)"
        )
    return Gsm8kData(path)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_local_task(
    data_dir: Path, task_dir: Path, task_name: str = LOCAL_TASK, extra_stops: tuple[str, ...] = ()
) -> Path:
    """lm-eval's gsm8k.yaml, unchanged except for its name, where its rows come from and any extra stops."""
    import lm_eval

    stock = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    task = yaml.safe_load(stock.read_text())
    task.pop("tag", None)  # keep the copy out of lm-eval's groups
    task["task"] = task_name
    task["dataset_path"] = "json"
    task["dataset_name"] = None
    task["dataset_kwargs"] = {
        "data_files": {"train": str(data_dir / "train.jsonl"), "test": str(data_dir / "test.jsonl")}
    }
    if extra_stops:
        task["generation_kwargs"]["until"] = [*task["generation_kwargs"]["until"], *extra_stops]
    task_dir.mkdir(parents=True, exist_ok=True)
    path = task_dir / f"{task_name}.yaml"
    path.write_text(yaml.safe_dump(task, sort_keys=False))
    return path


@dataclass(frozen=True)
class Gsm8kOutcome:
    scores: dict[str, dict[str, float]]  # filter -> {"accuracy", "stderr"}
    num_questions: int
    samples: list[dict[str, Any]]
    lm_eval_config: dict[str, Any]


def run_gsm8k(
    config: EvalConfig,
    base_url: str,
    model: str,
    data: Gsm8kData,
    work_dir: Path,
    listener: Callable[[str, str], None] | None = None,
) -> Gsm8kOutcome:
    """lm-eval against the server; `listener(prompt, text)` hears every answer as it arrives."""
    if config.max_concurrency is None:  # configs.config.effective_config resolves it from the hardware
        raise ValueError(
            f"{config.path}: max_concurrency unresolved (run the config through effective_config)"
        )
    if data.dir is not None:
        # Set before `datasets` is imported: without HF_DATASETS_OFFLINE it pings the hub.
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"
    import lm_eval
    from lm_eval.tasks import TaskManager

    from moe_eval.evaluate import lm_eval_model  # registers lm_eval_model.MODEL_NAME with lm-eval

    include = None
    if data.dir is not None:
        include = str(
            write_local_task(data.dir, work_dir / "lm_eval_tasks", data.task_name, data.extra_stops).parent
        )
    model_args = {
        "model": model,
        "base_url": f"{base_url}/v1/completions",
        "num_concurrent": config.max_concurrency,
        "max_retries": config.max_retries,
        "timeout": int(config.request_timeout_seconds),
        # Without it lm-eval probes /tokenize, then falls back to downloading a hub tokenizer.
        "tokenizer_backend": None,
        "tokenized_requests": False,
        "max_gen_toks": config.max_tokens,
        "seed": config.seed,
    }
    gen_kwargs = {
        "max_gen_toks": config.max_tokens,
        "temperature": config.temperature,
        "do_sample": config.temperature > 0,
    }
    lm_eval_model.set_listener(listener)
    try:
        results = lm_eval.simple_evaluate(
            model=lm_eval_model.MODEL_NAME,
            model_args=model_args,
            tasks=[data.task_name],
            num_fewshot=config.num_fewshot,
            limit=config.num_questions,
            log_samples=True,
            gen_kwargs=gen_kwargs,
            task_manager=TaskManager(include_path=include),
            random_seed=config.seed,
            numpy_random_seed=config.seed,
            torch_random_seed=config.seed,
            # exact_match aggregates by mean, whose stderr lm-eval computes in closed form (no resampling)
            # whenever bootstrap_iters > 0; at 0 it reports no stderr at all.
            fewshot_random_seed=config.seed,
            bootstrap_iters=1000,
        )
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # lm-eval gives up the whole run when one request keeps failing
        raise InfraError(f"lm-eval failed against {base_url}: {type(exc).__name__}: {exc}") from exc
    finally:
        lm_eval_model.set_listener(None)
    return _outcome(results, data.task_name, model_args, gen_kwargs)


def _outcome(results: dict, task: str, model_args: dict, gen_kwargs: dict) -> Gsm8kOutcome:
    metrics = results["results"][task]
    scores = {}
    for name in FILTERS:
        scores[name] = {
            "accuracy": float(metrics[f"exact_match,{name}"]),
            "stderr": _float_or_nan(metrics.get(f"exact_match_stderr,{name}")),
        }
    samples = results.get("samples", {}).get(task, [])
    # lm-eval logs one sample per (question, filter); a question is one doc_id.
    questions = {s["doc_id"] for s in samples}
    return Gsm8kOutcome(
        scores=scores,
        num_questions=len(questions),
        samples=samples,
        lm_eval_config={
            "model_args": dict(model_args),
            "gen_kwargs": gen_kwargs,
            "task": task,
            "n_samples": results.get("n-samples", {}).get(task),
        },
    )


def _float_or_nan(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")
