"""The golden reference a row is judged against: found in the cache or made (the I/O half of the golden gate:
it may start a golden server; the gate only compares).

The runner's last step (moe_eval.steps.MakeGolden) calls it after the row's own server is down (its GPUs or
cores then make the golden when the cache has none); `moe-eval golden` makes them ahead of a run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from moe_eval.configs.config import EvalConfig
from moe_eval.core.results import cpu_model
from moe_eval.evaluate.golden import (
    PROBE_SCALE_ERROR,
    GoldenSpec,
    GoldenStore,
    ServerPlace,
    cache_dir,
    ensure_golden,
    golden_spec,
)
from moe_eval.evaluate.gsm8k import Gsm8kData
from moe_eval.gates.measurements import GoldenRecord


def golden_device(hw: str, gpus: tuple[str, ...]) -> str:
    """The golden key's device: numbers differ between CPU instruction sets and GPU generations."""
    if hw == "cpu":
        return f"cpu: {cpu_model()}"
    return gpus[0] if gpus else hw


def golden_spec_on(
    config: EvalConfig, data: Gsm8kData, model: str, hw: str, gpus: tuple[str, ...], store: GoldenStore
) -> GoldenSpec:
    """The golden `config`'s gate compares with, made on this hardware: one setup for a run's golden
    (measure_golden) and `moe-eval golden`'s."""
    return golden_spec(
        config, data, model, golden_device(hw, gpus), memo_path=store.root / "weights-digests.json"
    )


def measure_golden(
    config: EvalConfig,
    options: Any,
    data: Gsm8kData,
    model: str,
    run_dir: Path,
    timings: dict[str, float],
) -> tuple[GoldenRecord, dict[str, Any]]:
    """The golden reference for this config's model, texts, vLLM and device: from the cache, else made
    now on this run's GPUs or cores (the config's own server is down by then); with results.json's
    `golden` (which record, made now or cached, its cost)."""
    started = time.monotonic()
    store = GoldenStore(options.golden_cache or cache_dir())
    spec = golden_spec_on(config, data, model, options.hw, options.gpus, store)
    place = ServerPlace(
        hw=options.hw,
        devices=options.devices,
        gpus=len(options.gpus),
        log_dir=run_dir / "golden",
        progress=options.progress,
        stage=options.status.stage if options.status is not None else (lambda _: None),
    )
    golden, made_now = ensure_golden(spec, config, place, store)
    timings["golden_seconds"] = time.monotonic() - started
    described = golden.describe() | {"made_now": made_now, "seconds": timings["golden_seconds"]}
    return GoldenRecord(
        golden.key.digest, str(golden.path), golden.prefill, golden.decode, golden.probe, PROBE_SCALE_ERROR
    ), described
