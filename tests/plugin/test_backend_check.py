"""The harness's check that the server used the MoE kernel the config asked for (log text only)."""

import json

import pytest

from moe_eval.core.errors import InfraError
from moe_eval.launch import server_environment
from moe_eval.serve.server_log import bundled_kernel_lines, verify_moe_backend

VLLM_CPU = (
    "(Worker pid=1) INFO [unquantized.py:364] Using CPU Unquantized MoE backend out of potential backends: "
    "['CPU'].\n"
)
VLLM_FI = (
    "(Worker pid=1) INFO Using FlashInfer CUTLASS Unquantized MoE backend out of potential backends: "
    "['FlashInfer CUTLASS', 'TRITON'].\n"
)
VLLM_TRITON = "INFO Using TRITON Unquantized MoE backend out of potential backends: ['TRITON'].\n"


def bundled(backend: str, pid: int = 7) -> str:
    return "moe-eval bundled MoE kernel: " + json.dumps({"backend": backend, "pid": pid, "layer": {}}) + "\n"


def test_records_of_two_ranks_on_one_line_are_both_read():
    # As CI's TEP server wrote them (2026-11-29): rank 1's record before rank 0's newline, then a
    # record cut short by a crash, then one after another process's prefix.
    log = (
        bundled("torch", 6977).rstrip("\n")
        + bundled("torch", 6978)
        + 'moe-eval bundled MoE kernel: {"backend": "tor\n'
        + "(Worker_TP1 pid=6978) "
        + bundled("torch", 6979)
    )
    assert [r["pid"] for r in bundled_kernel_lines(log)] == [6977, 6978, 6979]


@pytest.mark.parametrize(
    "requested, stem, log, used",
    [
        ("torch", "Tiny-BF16-torch", bundled("torch") + bundled("torch", 8), "bundled:torch"),
        (None, "Tiny-BF16-vllm", VLLM_CPU, "vllm:CPU"),
        (None, "Qwen3-30B-A3B-BF16-fi-cutlass", VLLM_FI, "vllm:FlashInfer CUTLASS"),
        (None, "Qwen3-30B-A3B-BF16-triton", VLLM_TRITON, "vllm:TRITON"),
    ],
)
def test_agreeing_logs(requested, stem, log, used):
    assert verify_moe_backend(requested, stem, log) == used


@pytest.mark.parametrize(
    "requested, stem, log, names",
    [
        (
            "triton",
            "X-BF16-triton",
            bundled("torch"),
            ["bundled 'triton'", "bundled torch"],
        ),  # other bundled kernel
        ("torch", "X-BF16-torch", VLLM_CPU, ["bundled 'torch'", "vLLM's CPU"]),  # plugin never loaded
        ("torch", "X-BF16-torch", bundled("torch") + VLLM_CPU, ["vLLM's CPU"]),  # some layer fell back
        (None, "X-BF16-vllm", bundled("torch"), ["leaves the MoE kernel to vLLM", "bundled torch"]),
        (None, "Qwen3-30B-A3B-BF16-fi-cutlass", VLLM_TRITON, ["'FlashInfer CUTLASS'", "vLLM's TRITON"]),
        (None, "Qwen3-30B-A3B-BF16-triton", "", ["'TRITON'", "no MoE backend line"]),
    ],
)
def test_mismatches_are_infra_errors_naming_both(requested, stem, log, names):
    with pytest.raises(InfraError, match="MoE kernel mismatch") as err:
        verify_moe_backend(requested, stem, log)
    for name in names:
        assert name in str(err.value)


def test_launcher_activates_the_plugin_only_when_asked(tmp_path):
    base = {"MOE_EVAL_MOE_BACKEND": "stale", "VLLM_PLUGINS": "other"}
    env = server_environment(base, {}, on_cpu=True, world_size=1, run_dir=tmp_path)
    assert "MOE_EVAL_MOE_BACKEND" not in env and env["VLLM_PLUGINS"] == "other"
    env = server_environment(base, {}, on_cpu=True, world_size=1, run_dir=tmp_path, moe_backend="torch")
    assert env["MOE_EVAL_MOE_BACKEND"] == "torch" and env["VLLM_PLUGINS"] == "other,moe_eval_kernels"
    env = server_environment(
        {}, {"VLLM_PLUGINS": ""}, on_cpu=True, world_size=1, run_dir=tmp_path, moe_backend="torch"
    )
    assert env["VLLM_PLUGINS"] == ""  # the config's own env always wins
