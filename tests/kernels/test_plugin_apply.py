"""The plugin's apply() with the tensors vLLM passes (int32 global topk ids, fp32 weights, expert map),
calling the real kernels: torch on CPU here, Triton on a GPU (marked gpu)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_eval.core.layout import Layout, LayoutKind
from moe_eval.kernels.fused_moe import fused_moe_ref
from moe_eval.kernels.oracle import Hardware, MoeBackendUnavailable
from moe_eval.kernels.plugin import BundledExperts
from moe_eval.kernels.testing import rel_err

# bf16 outputs against an fp32-accumulated reference: ~4e-3 typical (bf16 rounding of the
# intermediate and of the output); 1e-2 is the project-wide bound for bf16 kernels.
REL_TOL_BF16 = 1e-2
REL_TOL_FP32 = 1e-5  # fp32 end to end: only summation order differs


def _vllm_like_layer(e: int, F: int, D: int, dtype, device, expert_map=None, on_input=False):
    w13 = torch.randn(e, 2 * F, D, dtype=dtype, device=device) / D**0.5
    w2 = torch.randn(e, D, F, dtype=dtype, device=device) / F**0.5
    return SimpleNamespace(
        w13_weight=torch.nn.Parameter(w13, requires_grad=False),
        w2_weight=torch.nn.Parameter(w2, requires_grad=False),
        expert_map=expert_map,
        apply_router_weight_on_input=on_input,
        activation=SimpleNamespace(value="silu"),
    )


def _routing(T: int, E: int, K: int, device):
    logits = torch.randn(T, E, device=device)
    weights, ids = torch.softmax(logits, -1).topk(K, -1)
    return (weights / weights.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


CPU = Hardware("cpu", "cpu", None, triton_available=True, flashinfer_available=False)


@pytest.mark.parametrize(
    "layout, expert_map",
    [
        (Layout(LayoutKind.TP), None),  # all 8 experts local
        (
            Layout(LayoutKind.TEP, tensor_parallel=2),
            "second-half",
        ),  # rank 1 of 2: experts 4..7 local, rest -1
    ],
)
def test_torch_backend_apply_matches_reference(layout, expert_map):
    torch.manual_seed(0)
    E, K, D, F, T = 8, 2, 64, 32, 13
    emap = None
    if expert_map:
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[4:] = torch.arange(4, dtype=torch.int32)
    layer = _vllm_like_layer(4 if emap is not None else E, F, D, torch.float32, "cpu", emap)
    w13, w2 = layer.w13_weight.data.clone(), layer.w2_weight.data.clone()
    experts = BundledExperts("torch", layout, CPU)
    experts.process_weights(layer, E, K)
    x = torch.randn(T, D)
    topk_weights, topk_ids = _routing(T, E, K, "cpu")
    out = experts.apply(layer, x, topk_weights, topk_ids)
    ref = fused_moe_ref(x, w13, w2, topk_weights, topk_ids, expert_map_E=emap)
    assert rel_err(out, ref) < REL_TOL_FP32


def test_unsupported_activation_is_refused():
    layer = _vllm_like_layer(4, 8, 16, torch.float32, "cpu")
    layer.activation = SimpleNamespace(value="gelu")
    experts = BundledExperts("torch", Layout(LayoutKind.TP), CPU)
    experts.process_weights(layer, 4, 1)
    with pytest.raises(NotImplementedError, match="gelu"):
        experts.apply(layer, torch.randn(2, 16), *_routing(2, 4, 1, "cpu"))


def test_triton_request_on_cpu_fails_with_the_oracles_reason():
    with pytest.raises(MoeBackendUnavailable, match="CUDA GPU"):
        BundledExperts("triton", Layout(LayoutKind.TP), CPU)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 64, 1024])
@pytest.mark.parametrize("ep", [False, True])
def test_triton_backend_apply_on_gpu_matches_reference(T, ep):
    """Qwen3-30B-A3B shape (E=128, K=8, D=2048, F=768); EP: this rank holds experts 64..127."""
    torch.manual_seed(T)
    E, K, D, F = 128, 8, 2048, 768
    emap = None
    if ep:
        emap = torch.full((E,), -1, dtype=torch.int32, device="cuda")
        emap[64:] = torch.arange(64, dtype=torch.int32, device="cuda")
    layer = _vllm_like_layer(64 if ep else E, F, D, torch.bfloat16, "cuda", emap)
    w13, w2 = layer.w13_weight.data.clone(), layer.w2_weight.data.clone()
    layout = Layout(LayoutKind.TEP, tensor_parallel=2) if ep else Layout(LayoutKind.TP)
    experts = BundledExperts("triton", layout)  # real hardware detection
    experts.process_weights(layer, E, K)
    x = torch.randn(T, D, dtype=torch.bfloat16, device="cuda")
    topk_weights, topk_ids = _routing(T, E, K, "cuda")
    out = experts.apply(layer, x, topk_weights, topk_ids)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), topk_weights, topk_ids, expert_map_E=emap)
    assert not out.isnan().any() and rel_err(out, ref) < REL_TOL_BF16


@pytest.mark.parametrize(
    "mutation", ["swap_gate_up", "ignore_routing_weights", "shift_expert_ids", "ignore_expert_map"]
)
def test_each_mutation_changes_the_output(mutation):
    """`run --mutate` must break the computation (or it could not prove a gate); None must not."""
    torch.manual_seed(1)
    E, K, D, F, T = 8, 2, 64, 32, 16
    emap = torch.full((E,), -1, dtype=torch.int32)
    emap[4:] = torch.arange(4, dtype=torch.int32)
    layout = Layout(LayoutKind.TEP, tensor_parallel=2)
    x = torch.randn(T, D)
    topk_weights, topk_ids = _routing(T, E, K, "cpu")
    layer = _vllm_like_layer(4, F, D, torch.float32, "cpu", emap)
    ref = fused_moe_ref(
        x,
        layer.w13_weight.data.clone(),
        layer.w2_weight.data.clone(),
        topk_weights,
        topk_ids,
        expert_map_E=emap,
    )
    outs = {}
    for name in (None, mutation):
        layer_copy = _vllm_like_layer(4, F, D, torch.float32, "cpu", emap)
        layer_copy.w13_weight.data.copy_(layer.w13_weight.data)
        layer_copy.w2_weight.data.copy_(layer.w2_weight.data)
        experts = BundledExperts("torch", layout, CPU, mutation=name)
        experts.process_weights(layer_copy, E, K)
        outs[name] = experts.apply(layer_copy, x, topk_weights, topk_ids)
    assert rel_err(outs[None], ref) < REL_TOL_FP32
    assert rel_err(outs[mutation], ref) > 0.1, f"{mutation} left the output nearly unchanged"


def test_mutations_are_refused_where_they_cannot_apply(tmp_path):
    from moe_eval.configs.config import parse_config
    from moe_eval.core.errors import ConfigError
    from moe_eval.kernels.mutations import check_mutation

    base = "model_name: m\naccuracy_threshold: 0.5\nnum_questions: 4\nnum_fewshot: 5\n"
    tp = parse_config(tmp_path / "a.yaml", base + "moe_backend: torch\n")
    vllm_own = parse_config(tmp_path / "b.yaml", base)
    with pytest.raises(ConfigError, match="not one of"):
        check_mutation("flip_signs", tp)
    with pytest.raises(ConfigError, match="bundled kernels only"):
        check_mutation("swap_gate_up", vllm_own)
    with pytest.raises(ConfigError, match="no\\s+expert map"):
        check_mutation("ignore_expert_map", tp)
    check_mutation("swap_gate_up", tp)


def test_golden_probe_switch_is_scale_one_expert_in_place_and_goes_back_bit_for_bit(monkeypatch):
    """The golden server's probe (kernels/golden_probe.py): switched on, the reference layer's weights are
    exactly what `--mutate scale_one_expert` loads; switched off, exactly the originals again."""
    from moe_eval.kernels import plugin
    from moe_eval.kernels.golden_probe import GoldenProbeSwitch
    from moe_eval.kernels.mutations import mutate_weights

    monkeypatch.setattr(plugin, "_REFERENCE_EXPERTS", [])
    torch.manual_seed(2)
    E, K, D, F, T = 8, 2, 64, 32, 16
    x = torch.randn(T, D, dtype=torch.bfloat16)
    topk_weights, topk_ids = _routing(T, E, K, "cpu")
    layer = _vllm_like_layer(E, F, D, torch.bfloat16, "cpu")
    original = layer.w13_weight.data.clone()
    experts = BundledExperts("reference", Layout(LayoutKind.TP), CPU)
    experts.process_weights(layer, E, K)
    # An EP rank without global expert 0 (it holds 4..7): nothing to switch there.
    emap = torch.full((E,), -1, dtype=torch.int32)
    emap[4:] = torch.arange(4, dtype=torch.int32)
    other_rank = BundledExperts("reference", Layout(LayoutKind.TEP, tensor_parallel=2), CPU)
    other_layer = _vllm_like_layer(4, F, D, torch.bfloat16, "cpu", emap)
    other_before = other_layer.w13_weight.data.clone()
    other_rank.process_weights(other_layer, E, K)
    before = experts.apply(layer, x, topk_weights, topk_ids)

    switch = GoldenProbeSwitch()
    answer = switch.moe_eval_golden_probe("on")
    assert answer["layers"] == 2 and answer["target_layers"] == 1 and answer["probe"] == "scale_one_expert"
    assert torch.equal(experts.weights.w13_eFD, mutate_weights("scale_one_expert", original))
    assert torch.equal(other_rank.weights.w13_eFD, other_before)
    probed = experts.apply(layer, x, topk_weights, topk_ids)
    assert not torch.equal(probed, before)
    switch.moe_eval_golden_probe("on")  # twice on: scaled once, not twice
    assert torch.equal(experts.weights.w13_eFD, mutate_weights("scale_one_expert", original))

    assert switch.moe_eval_golden_probe("off")["probe"] is None
    assert torch.equal(experts.weights.w13_eFD, original)
    assert torch.equal(experts.apply(layer, x, topk_weights, topk_ids), before)
    with pytest.raises(ValueError, match="'sideways' must be 'on' or 'off'"):
        switch.moe_eval_golden_probe("sideways")


def test_a_call_that_raises_inside_the_timers_bracket_releases_its_start_stamp():
    """An eager call's gated start stamp waits for the host's release: a kernel that raises must release it
    at once (else the GPU waits 10 ms and counts a give-up the host's pace did not cause)."""
    from moe_eval.kernels.plugin import _timed_call

    abandoned = []
    timer = SimpleNamespace(abandon=lambda: abandoned.append(True))

    def broken():
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        _timed_call(timer, broken)
    assert abandoned == [True]
    assert _timed_call(timer, lambda: 7) == 7 and abandoned == [True]  # a call that returns is not abandoned
    assert _timed_call(None, lambda: 8) == 8  # no timer
