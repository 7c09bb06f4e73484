"""Throughput of the CPU server with the bundled torch MoE kernel against vLLM's own CPU MoE kernel.

Serves builtin:tiny-qwen3-moe (random-weight Qwen3-MoE, bf16, TP=1; not the embedded default, which
is now the canary of config-cpu.txt) once per kernel, in both orders (A B B A) so that warm caches
and machine drift fall on both, and drives each server with a fixed number of concurrent completion
requests of fixed length (ignore_eos). Reports generated tokens per second per server and the
ratio. Usage:

    python benchmarks/bench_cpu_server.py --concurrency 16 --requests 128 --max-tokens 128 --pairs 2 \
        --out docs/cpu-throughput.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import requests

from moe_eval import launch
from moe_eval.core.results import cpu_model, versions
from moe_eval.models.builtin import resolve_model

KERNELS = {"vllm-cpu": None, "bundled-torch": "torch"}


def drive(base_url: str, model: str, concurrency: int, n_requests: int, max_tokens: int) -> dict:
    prompts = [
        f"Question: Tom has {i} apples and buys {i % 7 + 2} more. How many now?\nAnswer:"
        for i in range(n_requests)
    ]

    def one(prompt: str) -> int:
        reply = requests.post(
            f"{base_url}/v1/completions",
            timeout=600,
            json={
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        )
        reply.raise_for_status()
        return reply.json()["usage"]["completion_tokens"]

    one(prompts[0])  # warm-up outside the clock
    started = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, prompts))
    seconds = time.perf_counter() - started
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}


def serve_and_drive(kernel: str, model: str, args: argparse.Namespace, work: Path) -> dict:
    run_dir = work / f"{kernel}-{time.monotonic_ns()}"
    spec = launch.ServerSpec(
        model=model,
        server_args=["--enforce-eager", "--max-model-len", "4096", "--dtype", "bfloat16"],
        log_path=run_dir / "server.log",
        port=launch.free_port(),
        startup_max_wait_seconds=600,
    )
    # The layer check off: this measures the kernels' serving throughput, not the check's sampling.
    env = launch.server_environment(
        dict(os.environ),
        {},
        on_cpu=True,
        world_size=1,
        run_dir=run_dir,
        moe_backend=KERNELS[kernel],
        layer_check=False,
    )
    with launch.VllmServer(spec, env) as server:
        result = drive(server.base_url, model, args.concurrency, args.requests, args.max_tokens)
    log = (run_dir / "server.log").read_text()
    expected = "moe-eval bundled MoE kernel" if KERNELS[kernel] else "Using CPU Unquantized MoE backend"
    assert expected in log, f"{kernel}: the server log does not show the expected MoE kernel"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=1, help="repeat the A B B A block this many times")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = resolve_model("builtin:tiny-qwen3-moe")
    runs: dict[str, list[float]] = {k: [] for k in KERNELS}
    order = ["vllm-cpu", "bundled-torch", "bundled-torch", "vllm-cpu"] * args.pairs  # both orders in one run
    with tempfile.TemporaryDirectory() as tmp:
        for kernel in order:
            result = serve_and_drive(kernel, model, args, Path(tmp))
            runs[kernel].append(result["tokens_per_second"])
            print(
                f"{kernel:14s} {result['tokens']} tokens in {result['seconds']:.1f} s = "
                f"{result['tokens_per_second']:.1f} tok/s",
                flush=True,
            )
    medians = {k: statistics.median(v) for k, v in runs.items()}
    slowdown = medians["vllm-cpu"] / medians["bundled-torch"]
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "versions": versions(),
        "args": vars(args) | {"out": None},
        "order": order,
        "tokens_per_second": runs,
        "median_tokens_per_second": medians,
        "vllm_over_bundled": slowdown,
    }
    print(
        f"median tok/s: vllm-cpu {medians['vllm-cpu']:.1f}, bundled-torch {medians['bundled-torch']:.1f}; "
        f"vLLM / bundled = {slowdown:.2f}x (target <= 1.3x)"
    )
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
