"""The warm-up that keeps Triton from compiling while a server serves (moe_eval.kernels.warmup).

On CPU: the plan enumeration covers every token count and stays small. On a GPU (marked gpu):
after `precompile_fused_moe`, calls of any token count up to the bound compile nothing, counted
with Triton's own post-compile hook (the one vLLM's JIT monitor uses).

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k.
"""

from __future__ import annotations

import random

import pytest
import torch

from moe_eval.kernels.fused_moe import align_variant, launch_plan
from moe_eval.kernels.tile_configs import SHIPPED_SHAPES
from moe_eval.kernels.warmup import distinct_plans
from tests.kernels.conftest import HAS_GPU

H200 = "NVIDIA H200"
# (e, F, D, K): the canary at TP1 and at EP2 (default tiles), and two tuned shipped shapes.
SHAPES = [(8, 128, 256, 2), (4, 128, 256, 2)] + [
    (s.local_experts, s.F, s.D, s.top_k)
    for s in SHIPPED_SHAPES
    if s.name in ("Qwen3-30B-A3B TP1", "Mixtral-8x7B TP2")
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "e{}-F{}-D{}-K{}".format(*s))
def test_every_token_count_follows_a_plan_that_was_warmed_up(shape):
    e, F, D, K = shape
    plans = distinct_plans(4096, e, F, D, K, H200)
    for tokens in range(1, 4097):
        plan = launch_plan(tokens, e, F, D, K, H200)
        assert plan in plans and plans[plan] <= tokens
    # Each plan costs one compile of a few kernels at server start: keep the count small.
    assert len(plans) <= 24, len(plans)


def test_alignment_variants_are_per_power_of_two_bucket():
    # One compiled single-program alignment per power-of-two bucket of slots, whatever the count
    # inside it (NB_BLOCKS is sized for the bucket's largest count).
    assert align_variant(17, 16, 128) == align_variant(32, 16, 128)
    assert align_variant(33, 16, 128) != align_variant(32, 16, 128)
    assert align_variant(0, 16, 128) is None
    assert not align_variant(100_000, 64, 128).single


def _compile_counter(monkeypatch):
    from triton import knobs

    compiled: list[str] = []
    previous = knobs.runtime.jit_post_compile_hook

    def hook(**kwargs):
        compiled.append(getattr(kwargs.get("fn"), "name", "?"))
        return previous(**kwargs) if previous is not None else None

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", hook)
    return compiled


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("ep", [False, True])
def test_after_precompile_no_token_count_compiles(monkeypatch, ep):
    from moe_eval.kernels.fused_moe import fused_moe
    from moe_eval.kernels.testing import make_case
    from moe_eval.kernels.warmup import precompile_fused_moe

    E, K, D, F, max_tokens = 8, 2, 256, 128, 3000  # the canary's layer; EP: this rank holds experts 4..7
    local = list(range(4, 8)) if ep else None
    base = make_case(4, E, K, D, F, dtype=torch.bfloat16, device="cuda", seed=0, local_experts=local)
    report = precompile_fused_moe(
        base.w13_eFD,
        base.w2_eDF,
        top_k=K,
        num_experts=E,
        expert_map_E=base.expert_map_E,
        apply_router_weight_on_input=False,
        max_tokens=max_tokens,
    )
    assert report.variants == len(report.token_counts) >= 5
    compiled = _compile_counter(monkeypatch)
    rng = random.Random(0)
    for tokens in [1, 2, 3, 7, 8, 9, 100, 511, 512, 513, 1000, 2047, 2048, 2049, max_tokens] + rng.sample(
        range(1, max_tokens + 1), 20
    ):
        case = make_case(
            tokens,
            E,
            K,
            D,
            F,
            dtype=torch.bfloat16,
            device="cuda",
            seed=tokens,
            local_experts=local,
            weights_from=base,
        )
        fused_moe(*case.args(), **case.kwargs())
    torch.cuda.synchronize()
    assert compiled == [], f"compiled while serving: {compiled}"
