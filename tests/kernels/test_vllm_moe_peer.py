"""The benchmark's vLLM peer (benchmarks/vllm_moe_peer.py): vLLM's kernel driven on our alignment.

What the GPU run cannot be trusted to check by itself: that vLLM's fused_moe_kernel, handed OUR
alignment (sentinel T*K, -1 past the padded count, slots of other ranks dropped) or vLLM's naive
small-batch assignment, computes the MoE; and that the config rules copied from vLLM pick what
vLLM picks. Without a GPU the kernel runs in Triton's interpreter (fp32, fp16), from the folder
that benchmarks/extract_vllm_moe_peer.py writes (skipped where it has not been extracted).

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch

from moe_eval.kernels.testing import make_case, rel_err
from tests.kernels.conftest import HAS_GPU


@contextlib.contextmanager
def _interpreter_if_no_gpu():
    """triton.jit picks the interpreter when a function is decorated: the peer's stand-ins (at
    import) and the cut kernel (at load) must be decorated with TRITON_INTERPRET=1 on a CPU."""
    previous = os.environ.get("TRITON_INTERPRET")
    if not HAS_GPU:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
with _interpreter_if_no_gpu():
    import vllm_moe_peer

PEER_DIR = vllm_moe_peer.DEFAULT_DIR
needs_folder = pytest.mark.skipif(
    not (PEER_DIR / "MANIFEST.json").is_file(),
    reason="no .vllm-peer/: run benchmarks/extract_vllm_moe_peer.py",
)

# The peer stores GEMM1's [T*K, 2F] output, SiLU-and-mul's [T*K, F] and GEMM2's per-slot output in
# the dtype (vLLM's layout), one rounding more than our kernel: fp16 ~4 roundings of 4.9e-4 / sqrt(3)
# -> ~6e-4 expected; fp32 as in test_fused_moe.py (the interpreter's dot is numpy's, IEEE).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.bfloat16] if HAS_GPU else [torch.float32, torch.float16]

CASES = [
    # (T, E, K, D, F, local experts, weight on input)
    pytest.param(5, 8, 2, 64, 48, None, False, id="aligned-K2"),  # K in {2,3,4}: vLLM's CUDA sum (stand-in)
    pytest.param(1, 128, 8, 32, 32, None, False, id="naive-assignment"),  # T*K*4 <= E: no alignment
    pytest.param(20, 8, 3, 32, 32, [5, 1, 6, 2], False, id="EP-map"),  # slots of other ranks dropped
    pytest.param(9, 6, 1, 32, 48, None, True, id="weight-on-input"),  # Llama-4: weight in GEMM1
    pytest.param(12, 7, 5, 48, 40, None, False, id="K5-torch-sum"),  # K not in {2,3,4}: torch.sum
    pytest.param(40, 4, 2, 32, 32, None, False, id="many-blocks"),  # EM from vLLM's buffer size
]


@pytest.fixture(scope="module")
def peer():
    with _interpreter_if_no_gpu():
        return vllm_moe_peer.load_folder(PEER_DIR)


@needs_folder
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("T", "E", "K", "D", "F", "local", "on_input"), CASES)
def test_whole_and_gemms_match_reference(peer, T, E, K, D, F, local, on_input, dtype, device):
    case = make_case(T, E, K, D, F, dtype=dtype, device=device, seed=T * 7 + E, local_experts=local,
                     apply_router_weight_on_input=on_input)  # fmt: skip
    ref = case.reference_fp32()
    whole = peer.whole_call(case, E)()
    assert not torch.isnan(whole).any()
    assert rel_err(whole, ref) <= TOLERANCE[dtype]
    call, finish = peer.gemms_call(case, E)
    call()
    assert rel_err(finish(), ref) <= TOLERANCE[dtype]


@needs_folder
def test_manifest_and_kernel(peer):
    assert peer.version == "0.32.0"
    # The launcher passes vLLM's 0.32.0 arguments by name: the cut kernel must still take them.
    for name in ("naive_block_assignment", "SWAP_AB", "USE_TD", "HAS_BIAS", "compute_type", "top_k"):
        assert name in peer.kernel.arg_names, name


@needs_folder
@pytest.mark.parametrize(("e", "F", "M", "expected"), [
    # Qwen3-30B-A3B TP1: vLLM's H200 file (keys up to 4096; M = 16384 takes 4096's entry)
    (128, 768, 4096, {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 16}),
    (128, 768, 16384, {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 16}),
    (128, 768, 1, {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}),
    # Mixtral-8x7B TP2
    (8, 7168, 256, {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}),
    # Llama-4-Scout TP2: no bf16 file for E=16, N=4096 -> get_default_config
    (16, 4096, 4096, {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 16}),
    (16, 4096, 1024, {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}),
    (16, 4096, 1, {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1}),
])  # fmt: skip
def test_config_lookup_on_the_h200(peer, e, F, M, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    w13 = torch.empty(e, 2 * F, 8, dtype=torch.bfloat16, device="meta")
    w2 = torch.empty(e, 8, F, dtype=torch.bfloat16, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    config = peer.config(w13, w2, 8, M)
    assert {k: config[k] for k in expected} == expected


def test_config_file_name_and_nearest_rule():
    assert (
        vllm_moe_peer.config_file_name(128, 768, "NVIDIA H200", None)
        == "E=128,N=768,device_name=NVIDIA_H200.json"
    )
    assert (
        vllm_moe_peer.config_file_name(8, 7168, "NVIDIA H200 NVL", None)
        == "E=8,N=7168,device_name=NVIDIA_H200.json"
    )
    assert (
        vllm_moe_peer.config_file_name(8, 7168, "NVIDIA H100 80GB HBM3", "float32")
        == "E=8,N=7168,device_name=NVIDIA_H100_80GB_HBM3,dtype=float32.json"
    )
    configs = {16: "a", 24: "b", 1024: "c", 4096: "d"}
    assert vllm_moe_peer.nearest(configs, 20) == "a"  # linear distance, ties to the first key
    assert vllm_moe_peer.nearest(configs, 2560) == "c"
    assert vllm_moe_peer.nearest(configs, 16384) == "d"
