"""The shape-twin table (docs/twins.md) from run folders of config-gpu-twins.txt configs.

    python benchmarks/twins_table.py RUN_DIR [RUN_DIR ...] [--json]

One row per config: layout, the kernel the server log names, divergence against the incumbent, error against
the golden (ratio to the incumbent's), start-up and evaluation seconds, GPU memory vLLM logged (weights, KV
cache it preallocated, CUDA graphs; GiB per worker), compilations while serving, device-counted MoE calls, and
the verdict with the failed checks. --json prints the raw rows (docs/data/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_eval.core.record import RunRecord  # noqa: E402


def row(results: Path) -> dict[str, Any]:
    r = RunRecord.read(results)
    div, gate = r.judged.get("divergence") or {}, r.judged.get("golden_gate") or {}
    serving, timings = r.serving, r.bookkeeping.timings
    return {
        "config": f"{results.parent.parent.name}/{results.parent.name}",
        "run": results.parent.parent.parent.name,
        "model": r.config["model_name"],
        "layout": r.layout,
        "kernel": serving.moe_backend_used,
        "status": r.status,
        "failed_checks": [c.name for c in r.verdict.checks if not c.passed],
        "divergence_mean_abs": div.get("mean_abs_dlogp"),
        "divergence_top1_flip_rate": div.get("top1_flip_rate"),
        "golden_error": (gate.get("run") or {}).get("mean_abs"),
        "golden_ratio": gate.get("ratio"),
        "golden_p": gate.get("p"),
        "golden_power_scale_error": (gate.get("power") or {}).get("scale_error"),
        "startup_seconds": timings.get("startup_seconds"),
        "eval_seconds": timings.get("eval_seconds"),
        "golden_seconds": timings.get("golden_seconds"),
        "gpu_memory_logged": serving.gpu_memory_logged or None,
        "jit_while_serving": serving.jit_while_serving.get("count"),
        "kernel_calls": serving.bundled_kernel_calls.get("calls"),
        "kernel_calls_counted_on": serving.bundled_kernel_calls.get("counted_on"),
        "mutation": r.mutation,
        "versions": {k: r.environment.versions.get(k) for k in ("vllm", "torch")},
        "gpus": r.environment.hardware.gpus,
    }


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| config | layout | kernel (server log) | Δ log p vs incumbent, top-1 | error vs golden (ratio) | "
        "start s | eval s | weights / KV / graphs GiB | JIT | MoE calls | verdict |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        mem = r["gpu_memory_logged"] or {}
        gib = "/".join(
            _num((mem.get(k) or [None])[0], ".2f") for k in ("weights_gib", "kv_cache_gib", "cuda_graphs_gib")
        )
        verdict = r["status"].upper() + (f" ({', '.join(r['failed_checks'])})" if r["failed_checks"] else "")
        config = r["config"] + (f" --mutate {r['mutation']}" if r["mutation"] else "")
        lines.append(
            f"| {config} | {r['layout']} | {r['kernel'] or '-'} | "
            f"{_num(r['divergence_mean_abs'], '.4f')}, {_num(r['divergence_top1_flip_rate'], '.2%')} | "
            f"{_num(r['golden_error'], '.4f')} ({_num(r['golden_ratio'], '.3f')}) | "
            f"{_num(r['startup_seconds'], '.0f')} | {_num(r['eval_seconds'], '.0f')} | {gib} | "
            f"{_num(r['jit_while_serving'], 'd')} | {_num(r['kernel_calls'], 'd')} | {verdict} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [row(p) for run in args.runs for p in sorted(run.glob("*/*/results.json"))]
    print(json.dumps(rows, indent=2) if args.json else markdown(rows), end="" if not args.json else "\n")


if __name__ == "__main__":
    main()
