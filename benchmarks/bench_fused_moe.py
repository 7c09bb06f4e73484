"""Benchmark the bundled Triton fused MoE against its peers on the shipped per-rank shapes (GPU).

Peers (--peers), interleaved replay by replay so they share the card's thermal and power state:
  triton      moe_eval.kernels.fused_moe.fused_moe (alignment included), CUDA graph
  grouped_mm  moe_eval.kernels.torch_moe.grouped_mm_moe (sort, grouped GEMM, SiLU-and-mul,
              grouped GEMM, unpermute, sum), CUDA graph
  flashinfer_cutlass  moe_eval.kernels.flashinfer_cutlass (FlashInfer's CUTLASS fused MoE, BF16),
              autotuned once per shape at exactly the M values of the run, CUDA graph (needs
              flashinfer installed and its fused_moe_90 module: benchmarks/flashinfer_h200.py builds
              it, or places a prebuilt one with --aot-library)
  vllm_triton vLLM's Triton fused MoE driven as vLLM's fused_experts drives it
              (benchmarks/vllm_moe_peer.py): from --vllm-peer-dir (default .vllm-peer/, written by
              benchmarks/extract_vllm_moe_peer.py: vLLM 0.32.0's kernel and tuned configs, OUR
              alignment and one-pass Triton stand-ins for its CUDA activation and top-k sum), or
              from the installed vLLM when there is no folder. CUDA graph
  vllm_installed  the installed vLLM's own fused_experts (its CUDA alignment, activation and sum)
  triton_pdl, triton_nopdl, triton_naive_pdl, triton_naive_forced  the tuned plan with
              `MoeTileConfig.pdl` asked for (naive and aligned calls), dropped, the call made naive where
              naive qualifies and pdl asked for, or naive at every M with pdl; M <= 64 only
  triton_sum_in_gemm2, triton_pdl_sum_in_gemm2  the tuned plan with `MoeTileConfig.sum_in_gemm2` (the
              top-k sum inside the aligned GEMM2), pdl as tuned or asked for; where the tuned GEMMs
              are the pointer kernels
  triton_default  the same kernel on the default heuristic's tiles (no tuned file), CUDA graph
  triton_package  the same kernel on the package's own tuned file for this GPU, read past
              MOE_EVAL_TUNED_DIR: a fresh tuning in that folder (as `triton`) against the shipped tiles
  triton_gemv*  issue 34's decode GEMVs: the shape's tuned config with `gemv` tiles on its naive calls
              (GEMV_VARIANTS: tile_configs.default_gemv_tiles and a few variations of it), CUDA graph;
              with --gemv-force the GEMVs run every call (also where naive does not qualify: one
              expert stream per slot), to see where they stop paying
With a vLLM peer (or --gemms-alone) each of triton / vllm_triton / vllm_installed also gets a
`<peer>:gemms` timer in the same interleaved replays: GEMM1 + activation + GEMM2 only, the slot
assignment precomputed outside the graph (each side at its own BLOCK_M with OUR alignment, or
the naive one-block-per-slot assignment where the side's own rule takes it), the buffers
preallocated, no top-k sum (ours: unless the plan folds it into GEMM2, then it is inside).
Eager, unless --skip-eager (they sync the host, so they cannot be captured):
  reference   moe_eval.kernels.fused_moe.fused_moe_ref (fp32)
  torch_moe_eager  moe_eval.kernels.torch_moe.torch_moe (the CPU path; M <= 1024)
Each graph holds one call per rotated input set (different tokens and routing, so the experts a
call hits were not the previous call's), replayed back to back after a warm-up; the time of a call
is a replay's time over the calls in it; the median of the replays is reported. Every timed peer's
output for the first input set is checked against fused_moe_ref in fp32 (relative error in the
row; --no-check skips it). Kernels are compiled before timing by --precompile-workers processes.

Roofline: max(FLOPs / matmul ceiling, bytes / copy ceiling), FLOPs = 6 * slots * D * F (slots on
this rank), bytes = experts hit * 3 * D * F * 2 + x + out, ceilings measured in the same run
(8192^3 bf16 matmul on random data; device-to-device copy counting read + write).

With a vLLM peer the run ends with the ratio tables of issue 13 (vLLM time / bundled time per
shape x M, whole call and GEMMs alone, geometric mean per shape, pass / fail against the targets),
also written to DIR/ratios.md; `--report-only DIR/rows.jsonl` prints them again from saved rows.

Usage: python benchmarks/bench_fused_moe.py --out-dir DIR [--shapes "Qwen3-30B-A3B TP1" ...] [--m 1 16]
                                           [--peers triton vllm_triton] [--vllm-peer-dir DIR] [--skip-eager]
Writes DIR/bench.json, DIR/rows.jsonl (as it goes), DIR/bench.md, DIR/ratios.md and
DIR/roofline_<model>.png; prints the tables on stdout. --decode-targets: issue 34's table instead
(DIR/decode.md: per cell the time, TB/s on the weights and the ratio to the copy floor).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "--cpu-smoke" in sys.argv:
    # Triton picks its interpreter when a kernel is decorated, so before anything imports triton.
    os.environ["TRITON_INTERPRET"] = "1"

import argparse
import dataclasses
import datetime
import json
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from moe_eval.kernels.fused_moe import (
    AlignVariant,
    LaunchPlan,
    allocate_intermediates,
    assign_slots,
    fused_moe,
    fused_moe_ref,
    launch_experts,
    launch_plan,
    launch_sum,
    pdl_available,
)
from moe_eval.kernels.testing import MoeCase, rel_err, shape_case
from moe_eval.kernels.tile_configs import (
    M_GRID,
    PREFILL_SHAPES,
    SHIPPED_SHAPES,
    TUNED_DIR,
    GemvTiles,
    MoeShape,
    MoeTileConfig,
    config_file_name,
    default_config,
    default_gemv_tiles,
    nearest_m,
    read_tuned_file,
)
from moe_eval.kernels.torch_moe import grouped_mm_moe, torch_moe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bounds import BOUNDS  # noqa: E402 - beside this file


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- ceilings ------------------------------------------------------------------------------------


def measure_ceilings() -> dict[str, float]:
    """Sustained bf16 matmul TFLOP/s and device-to-device copy GB/s (read + write), this card, now."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):  # warm-up long enough for the clocks to settle at the power cap
        a @ b
    times = _event_times(lambda: a @ b, reps=20)
    tflops = 2 * n**3 / statistics.median(times) / 1e12
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB, 34x the L2
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = _event_times(lambda: dst.copy_(src), reps=20)
    gbps = 2 * src.numel() * 2 / statistics.median(times) / 1e9
    return {"matmul_tflops": tflops, "copy_gbps": gbps}


def _event_times(fn: Callable[[], object], reps: int) -> list[float]:
    """Seconds per call, one pair of events around each call."""
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in events]


# --- CUDA-graph timing ---------------------------------------------------------------------------


class GraphTimer:
    """One CUDA graph that runs `calls` (one per input set) in order; replays are timed with events."""

    def __init__(self, calls: list[Callable[[], object]]):
        # The graph replays raw pointers: whatever the calls hold (outputs, workspaces made outside
        # the capture) must live as long as the graph. Dropping FlashInfer's output buffers with
        # its call list let the next capture reuse them: an illegal address at M=256 (2026-11-29).
        self.calls = calls
        self.num_calls = len(calls)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile and warm up outside the capture
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for call in calls:
                call()
        self.graph.replay()
        torch.cuda.synchronize()

    def warm(self, seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            self.graph.replay()
            torch.cuda.synchronize()

    def replay_us(self, inner: int = 1) -> float:
        """Microseconds per call over `inner` back-to-back replays between one pair of events."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            self.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / (inner * self.num_calls)


def time_interleaved(
    timers: dict[str, GraphTimer], replays: int, warm_s: float = 0.2
) -> dict[str, list[float]]:
    """Microseconds per call for each timer, replays interleaved A, B, A, B, ..."""
    for name, timer in timers.items():
        try:
            timer.warm(warm_s / len(timers))
        except Exception as exc:  # a fault surfaces at the sync after a replay: name the graph
            raise RuntimeError(f"{name}'s graph failed while warming up: {exc}") from exc
    samples: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(replays):
        for name, timer in timers.items():
            samples[name].append(timer.replay_us())
    return samples


def median_us(calls: list[Callable[[], object]], replays: int = 20, warm_s: float = 0.05) -> float:
    timer = GraphTimer(calls)
    return statistics.median(time_interleaved({"x": timer}, replays, warm_s)["x"])


# --- shapes, inputs and accounting ---------------------------------------------------------------


def shapes_named(names: Iterable[str]) -> list[MoeShape]:
    """The shipped shapes of these names ("Qwen3-30B-A3B TP1"), in that order; KeyError on an unknown one."""
    by_name = {s.name: s for s in SHIPPED_SHAPES}
    return [by_name[n] for n in names]


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """--shapes (names; none given: the script's default) and --m (default: the M grid)."""
    parser.add_argument("--shapes", nargs="*", help='names like "Qwen3-30B-A3B TP1" (default: all shipped)')
    parser.add_argument("--m", nargs="*", type=int, default=list(M_GRID))


def rotated_sets(shape: MoeShape, M: int, weights_from: MoeCase) -> list[MoeCase]:
    """Input sets with their own tokens and routing, sharing `weights_from`'s weights (the layer is
    0.6-4.0 GB, beyond the 60 MB L2; rotating the routing keeps a call's experts out of L2)."""
    n_sets = 4 if M <= 1024 else 2
    device, dtype = weights_from.w13_eFD.device, weights_from.w13_eFD.dtype
    return [
        shape_case(shape, M, seed=1000 * M + i, weights_from=weights_from, device=device, dtype=dtype)
        for i in range(n_sets)
    ]


def layer_counts(shape: MoeShape, cases: list[MoeCase]) -> dict[str, float]:
    """Mean experts hit, slots computed on this rank, FLOPs and bytes of one call."""
    hits, slots = [], []
    for case in cases:
        local = case.topk_ids_TK.reshape(-1).long()
        if case.expert_map_E is not None:
            local = case.expert_map_E.long()[local]
        local = local[local >= 0]
        hits.append(local.unique().numel())
        slots.append(local.numel())
    M = cases[0].hidden_TD.shape[0]
    hit, slot = statistics.mean(hits), statistics.mean(slots)
    flops = 6 * slot * shape.D * shape.F
    weight_bytes = hit * 3 * shape.D * shape.F * cases[0].w13_eFD.element_size()
    bytes_ = weight_bytes + 2 * M * shape.D * 2
    return {"experts_hit": hit, "slots": slot, "flops": flops, "bytes": bytes_, "weight_bytes": weight_bytes}


def _call(fn: Callable, case: MoeCase) -> Callable[[], object]:
    return lambda: fn(*case.args(), **case.kwargs())


# --- peers: each turns the rotated input sets into one call per set, plus notes for its rows -----

PeerCalls = tuple[list[Callable[[], object]], dict]


def _device_name(case: MoeCase) -> str:
    device = case.hidden_TD.device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _triton_plan(shape: MoeShape, case: MoeCase):
    T = case.hidden_TD.shape[0]
    return launch_plan(T, shape.local_experts, shape.F, shape.D, shape.top_k, _device_name(case))


def triton_peer(shape: MoeShape, cases: list[MoeCase], Ms: list[int]) -> PeerCalls:
    plan = _triton_plan(shape, cases[0])
    return [_call(fused_moe, c) for c in cases], {"config": json.dumps(plan.config.to_json())}


DECODE_VARIANT_MAX_M = 64


def default_tiles_peer(shape: MoeShape, cases: list[MoeCase], Ms: list[int]) -> PeerCalls:
    """The default heuristic's tiles (what a GPU with no tuned file for the shape runs)."""
    T = cases[0].hidden_TD.shape[0]
    config = default_config(T, shape.local_experts, shape.top_k)
    return _configured_calls(shape, cases, [config] * len(cases))


def package_tiles_peer(shape: MoeShape, cases: list[MoeCase], Ms: list[int]) -> PeerCalls:
    """The tiles of the package's own file for this GPU, whatever MOE_EVAL_TUNED_DIR holds: with a fresh
    tuning in that folder (`triton`), the shipped tiles timed in the same replays."""
    path = TUNED_DIR / config_file_name(shape.local_experts, shape.F, shape.D, _device_name(cases[0]))
    if not path.is_file():
        raise ValueError(f"triton_package: the package has no tuned file {path.name} for this GPU")
    entries = read_tuned_file(path)
    T = cases[0].hidden_TD.shape[0]
    return _configured_calls(shape, cases, [entries[nearest_m(list(entries), T)]] * len(cases))


def _decode_variant(variant: str) -> Callable[[MoeShape, list[MoeCase], list[int]], PeerCalls]:
    """The tuned plan with `pdl` (`MoeTileConfig.pdl`) set otherwise, at decode sizes (M <= 64) only:
    triton_pdl asks for it wherever the plan is the tl.dot pointer chain (naive calls, and aligned ones,
    GEMM1 following the alignment), triton_nopdl drops it, triton_naive_pdl makes the call naive with the
    tuned tiles where naive qualifies and asks for it, triton_naive_forced runs the tuned tiles naive at
    every M (one block per slot, no alignment: an expert hit by several slots is read once per slot), with
    pdl."""

    def peer_calls(shape: MoeShape, cases: list[MoeCase], Ms: list[int]) -> PeerCalls:
        T = cases[0].hidden_TD.shape[0]
        if T > DECODE_VARIANT_MAX_M:
            raise ValueError(f"{variant} is a decode comparison (M <= {DECODE_VARIANT_MAX_M}), not M={T}")
        configs = []
        for c in cases:
            tuned = _triton_plan(shape, c).config
            if variant != "triton_nopdl" and not tuned.pdl_capable:
                raise ValueError(f"{variant}: the tuned plan at M={T} is no tl.dot pointer chain ({tuned})")
            naive = tuned.naive or variant in ("triton_naive_pdl", "triton_naive_forced")
            fold_k = tuned.fold_k if tuned.naive else False
            configs.append(
                dataclasses.replace(tuned, naive=naive, fold_k=fold_k, pdl=variant != "triton_nopdl")
            )
        if variant == "triton_naive_forced":
            calls = [_forced_naive_call(shape, c, cfg) for c, cfg in zip(cases, configs)]
            notes = {"config": json.dumps(configs[0].to_json()), "naive_ran": True, "naive_forced": True}
            return calls, notes | {"pdl_ran": pdl_available(cases[0].hidden_TD.device)}
        return _configured_calls(shape, cases, configs)

    return peer_calls


SUM_IN_GEMM2_VARIANTS = ("triton_sum_in_gemm2", "triton_pdl_sum_in_gemm2")


def _sum_in_gemm2_variant(variant: str) -> Callable[[MoeShape, list[MoeCase], list[int]], PeerCalls]:
    """The tuned plan with `MoeTileConfig.sum_in_gemm2` asked for (issue 56: the top-k sum inside the
    aligned GEMM2, one launch fewer): triton_sum_in_gemm2 keeps the tuned pdl, triton_pdl_sum_in_gemm2 asks
    for pdl too. Any M whose tuned GEMMs are the pointer kernels; on naive calls the plan is the tuned one
    (`sum_in_gemm2_ran` says whether the sum moved)."""

    def peer_calls(shape: MoeShape, cases: list[MoeCase], Ms: list[int]) -> PeerCalls:
        configs = []
        for c in cases:
            tuned = _triton_plan(shape, c).config
            if tuned.gemm1.persistent or tuned.gemm2.persistent or tuned.gemm2.tma:
                raise ValueError(
                    f"{variant}: the tuned GEMMs at this M are not the pointer kernels ({tuned})"
                )
            pdl = tuned.pdl or (variant == "triton_pdl_sum_in_gemm2" and tuned.pdl_capable)
            configs.append(dataclasses.replace(tuned, sum_in_gemm2=True, pdl=pdl))
        calls, notes = _configured_calls(shape, cases, configs)
        # Aligned calls move the sum (naive ones keep their plan); K = 1 has none to move.
        return calls, notes | {"sum_in_gemm2_ran": not notes["naive_ran"] and shape.top_k > 1}

    return peer_calls


def _configured_calls(shape: MoeShape, cases: list[MoeCase], configs: list[MoeTileConfig]) -> PeerCalls:
    calls = [
        lambda c=c, cfg=cfg: fused_moe(*c.args(), **c.kwargs(), config=cfg) for c, cfg in zip(cases, configs)
    ]
    T = cases[0].hidden_TD.shape[0]
    plan = launch_plan(
        T, shape.local_experts, shape.F, shape.D, shape.top_k, _device_name(cases[0]), configs[0]
    )
    return calls, {
        "config": json.dumps(configs[0].to_json()),
        "pdl_ran": plan.pdl and pdl_available(cases[0].hidden_TD.device),
        "naive_ran": plan.align.naive,
    }


def grouped_mm_peer(shape: MoeShape, cases: list[MoeCase], Ms: list[int]) -> PeerCalls:
    return [_call(grouped_mm_moe, c) for c in cases], {}


class _FlashInferState:
    """Per shape (the sets of every M share its weights): w31, one workspace, tuned once."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.w31: torch.Tensor | None = None
        self.workspace: list[torch.Tensor] = []
        self.max_tokens = 0
        self.tune_s: float | None = None


_fi = _FlashInferState()
# Call options, set from the command line: a workspace per input set instead of one shared, and
# FlashInfer's programmatic dependent launch on (None: its default) or off (False).
FLASHINFER_OPTIONS: dict = {"workspace_per_call": False, "enable_pdl": None}


def flashinfer_cutlass_peer(shape: MoeShape, cases: list[MoeCase], Ms: list[int]) -> PeerCalls:
    """FlashInfer's CUTLASS MoE, capturable: a preallocated workspace, tactics chosen beforehand.

    Tuned once per shape over exactly the M values of the run (tuning_buckets, up to
    tune_max_num_tokens = the largest), as vLLM tunes once at warm-up, with one workspace sized
    for the largest M (valid for every smaller one). Tuning runs kernels, so it cannot happen
    inside a capture. Tuning each M on its own, with a workspace sized for that M, hit an illegal
    memory access at Qwen3-30B-A3B TP1 M=256 on the H200 (docs/flashinfer.md).
    """
    from flashinfer.autotuner import autotune

    from moe_eval.kernels.flashinfer_cutlass import flashinfer_cutlass_moe, to_flashinfer_w31, workspace_bytes

    key = (shape.name, cases[0].w13_eFD.data_ptr(), tuple(Ms))
    if _fi.key != key:
        _fi.__init__()  # drop the previous shape's weights and workspace first
        _fi.key, _fi.w31, _fi.max_tokens = key, to_flashinfer_w31(cases[0].w13_eFD), max(Ms)
        ws_bytes = workspace_bytes(
            _fi.max_tokens, shape.D, shape.F, shape.local_experts, shape.top_k,
            expert_map=cases[0].expert_map_E is not None,
        )  # fmt: skip
        n_spaces = len(cases) if FLASHINFER_OPTIONS["workspace_per_call"] else 1
        _fi.workspace = [torch.empty(ws_bytes, dtype=torch.uint8, device="cuda") for _ in range(n_spaces)]

    outs = [torch.empty_like(c.hidden_TD) for c in cases]

    def call(i: int) -> Callable[[], object]:
        c, out, ws = cases[i], outs[i], _fi.workspace[i % len(_fi.workspace)]
        return lambda: flashinfer_cutlass_moe(
            c.hidden_TD, _fi.w31, c.w2_eDF, c.topk_weights_TK, c.topk_ids_TK, expert_map_E=c.expert_map_E,
            out=out, workspace=ws, tune_max_num_tokens=_fi.max_tokens,
            enable_pdl=FLASHINFER_OPTIONS["enable_pdl"],
        )  # fmt: skip

    if _fi.tune_s is None:
        t = time.perf_counter()
        with autotune(True, tuning_buckets=tuple(sorted(set(Ms)))):
            call(0)()
        torch.cuda.synchronize()
        _fi.tune_s = time.perf_counter() - t
        log(f"  flashinfer_cutlass: tuned {shape.name} at M in {sorted(set(Ms))} in {_fi.tune_s:.1f} s")
    return [call(i) for i in range(len(cases))], {"tune_s_shape": _fi.tune_s, **FLASHINFER_OPTIONS}


def add_flashinfer_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fi-workspace-per-call", action="store_true", help="flashinfer: a workspace per input set"
    )
    parser.add_argument(
        "--fi-no-pdl", action="store_true", help="flashinfer: programmatic dependent launch off"
    )


def apply_flashinfer_options(args: argparse.Namespace) -> None:
    FLASHINFER_OPTIONS["workspace_per_call"] = args.fi_workspace_per_call
    FLASHINFER_OPTIONS["enable_pdl"] = False if args.fi_no_pdl else None


# vLLM peers, loaded once per run by configure_vllm_peers (benchmarks/vllm_moe_peer.py).
VLLM_PEERS: dict = {}
VLLM_PEER_NAMES = ("vllm_triton", "vllm_installed")


def configure_vllm_peers(peers: Iterable[str], peer_dir: Path | None) -> list[str]:
    """Load the vLLM peers asked for: vllm_triton from the folder (or the installed vLLM when there
    is none), vllm_installed from the installed vLLM. Returns the names that could not be loaded
    (each logged with its reason): the run goes on without them rather than losing the others."""
    import subprocess

    import vllm_moe_peer

    failed = []
    for name in peers:
        if name in VLLM_PEERS:
            continue
        uses_installed = name == "vllm_installed" or not (
            peer_dir or (vllm_moe_peer.DEFAULT_DIR / "MANIFEST.json").is_file()
        )
        if uses_installed:
            # A vLLM built for another torch can crash the interpreter on import, not raise: try it
            # in a child first, so this process (and the other peers' numbers) survives.
            probe = subprocess.run(
                [
                    sys.executable, "-c",
                    "import vllm._custom_ops, vllm.model_executor.layers.fused_moe.fused_moe",
                ],
                capture_output=True, text=True, timeout=300, check=False,
            )  # fmt: skip
            if probe.returncode != 0:
                log(f"{name}: the installed vLLM does not import (rc {probe.returncode}): "
                    f"{(probe.stderr or probe.stdout).strip()[-300:]}; dropped from this run")  # fmt: skip
                failed.append(name)
                continue
        try:
            VLLM_PEERS[name] = (
                vllm_moe_peer.load(peer_dir) if name == "vllm_triton" else vllm_moe_peer.load_installed()
            )
        except Exception as exc:  # noqa: BLE001 - ImportError and whatever vLLM raises on a foreign torch
            log(f"{name}: not loaded ({type(exc).__name__}: {str(exc)[:300]}); dropped from this run")
            failed.append(name)
    return failed


def _vllm_notes(peer, shape: MoeShape, case: MoeCase) -> dict:
    T = case.hidden_TD.shape[0]
    config = peer.config(case.w13_eFD, case.w2_eDF, shape.top_k, T)
    naive = case.expert_map_E is None and T * shape.top_k * 4 <= shape.num_experts
    return {"vllm_source": peer.source, "vllm_version": peer.version, "config": json.dumps(config),
            "naive_assignment": naive}  # fmt: skip


def _vllm_whole(name: str) -> Callable[[MoeShape, list[MoeCase], list[int]], PeerCalls]:
    def peer_calls(shape: MoeShape, cases: list[MoeCase], Ms: list[int]) -> PeerCalls:
        peer = VLLM_PEERS[name]
        return [peer.whole_call(c, shape.num_experts) for c in cases], _vllm_notes(peer, shape, cases[0])

    return peer_calls


# --- issue 34: the decode GEMVs beside the tuned plan --------------------------------------------

# Variations of tile_configs.default_gemv_tiles (4 warps, a step of up to 1024, 64 weights a thread a
# step, no pipelining): PDL between the two launches; the steps' loads pipelined through shared memory
# (cp.async, 2 stages) instead of many resident programs; 8 warps and twice the rows (half the programs,
# twice the bytes in flight each); the same tile shaped otherwise: half the step and twice the rows
# (GEMM2 then reads h, as large as its weights at one row, once for two output rows, and loops twice as
# often), or twice the step (at most the reduction's length) and half the rows (fewer trips, more
# programs).
GEMV_VARIANTS: dict[str, dict] = {
    "triton_gemv": {},
    "triton_gemv_pdl": {"pdl": True},
    "triton_gemv_pdl_s2": {"pdl": True, "stages": 2},
    "triton_gemv_pdl_w8": {"pdl": True, "warps": 8, "rows": 2},
    "triton_gemv_pdl_short": {"pdl": True, "rows": 2, "step": 0.5},
    "triton_gemv_pdl_long": {"pdl": True, "rows": 0.5, "step": 2},
}
# --gemv-force: the GEMV peers run the GEMVs at every call, not only where naive qualifies.
GEMV_OPTIONS: dict = {"force": False}


def gemv_tiles(shape: MoeShape, variant: str) -> GemvTiles:
    v = GEMV_VARIANTS[variant]
    base = default_gemv_tiles(shape.F, shape.D, shape.top_k, pdl=v.get("pdl", False))

    def vary(tile, reduce_dim: int):
        longest = 1 << max(reduce_dim - 1, 0).bit_length()
        block_k = min(longest, max(16, int(tile.block_k * v.get("step", 1))))
        block_n = max(1, int(tile.block_n * v.get("rows", 1)))
        return dataclasses.replace(tile, block_n=block_n, block_k=block_k, num_warps=v.get("warps", 4),
                                   num_stages=v.get("stages", 1))  # fmt: skip

    return dataclasses.replace(base, gemm1=vary(base.gemm1, shape.D), gemm2=vary(base.gemm2, shape.F))


def gemv_config(shape: MoeShape, case: MoeCase, variant: str) -> MoeTileConfig:
    """The tuned config of this call with the variant's GEMVs on its naive calls (its tl.dot tiles serve
    the others); fold_k off, as `gemv` requires."""
    tuned = _triton_plan(shape, case).config
    return dataclasses.replace(tuned, naive=True, fold_k=False, pdl=False, gemv=gemv_tiles(shape, variant))


def _forced_naive_call(shape: MoeShape, case: MoeCase, config: MoeTileConfig) -> Callable[[], torch.Tensor]:
    """The config's naive calls (the GEMVs where it has them) whatever the token count: fused_moe's stages
    with the naive plan forced."""
    plan = LaunchPlan(config, AlignVariant(False, naive=True))
    kwargs = {"expert_map_E": case.expert_map_E, "precision": "tf32",
              "apply_router_weight_on_input": case.apply_router_weight_on_input}  # fmt: skip

    def call() -> torch.Tensor:
        out = torch.empty_like(case.hidden_TD)
        align = assign_slots(case.topk_ids_TK, plan, shape.local_experts, case.expert_map_E)
        h_PF, y_SD = allocate_intermediates(align, plan, case.hidden_TD, shape.F, out)
        launch_experts(*case.args(), align, plan, h_PF, y_SD, out, **kwargs)
        return out

    return call


def _gemv_peer(variant: str) -> Callable[[MoeShape, list[MoeCase], list[int]], PeerCalls]:
    def peer_calls(shape: MoeShape, cases: list[MoeCase], Ms: list[int]) -> PeerCalls:
        configs = [gemv_config(shape, c, variant) for c in cases]
        if GEMV_OPTIONS["force"]:
            calls = [_forced_naive_call(shape, c, cfg) for c, cfg in zip(cases, configs)]
        else:
            calls = [lambda c=c, cfg=cfg: fused_moe(*c.args(), **c.kwargs(), config=cfg)
                     for c, cfg in zip(cases, configs)]  # fmt: skip
        T = cases[0].hidden_TD.shape[0]
        plan = launch_plan(T, shape.local_experts, shape.F, shape.D, shape.top_k, _device_name(cases[0]),
                           configs[0])  # fmt: skip
        runs_gemv = GEMV_OPTIONS["force"] or plan.gemv is not None
        return calls, {"config": json.dumps(configs[0].to_json()), "gemv_ran": runs_gemv,
                       "gemv_forced": GEMV_OPTIONS["force"]}  # fmt: skip

    return peer_calls


GRAPH_PEERS: dict[str, Callable[[MoeShape, list[MoeCase], list[int]], PeerCalls]] = {
    "triton": triton_peer,
    **{
        name: _decode_variant(name)
        for name in ("triton_pdl", "triton_nopdl", "triton_naive_pdl", "triton_naive_forced")
    },  # fmt: skip
    **{name: _sum_in_gemm2_variant(name) for name in SUM_IN_GEMM2_VARIANTS},
    "triton_default": default_tiles_peer,
    "triton_package": package_tiles_peer,
    "grouped_mm": grouped_mm_peer,
    "flashinfer_cutlass": flashinfer_cutlass_peer,
    "vllm_triton": _vllm_whole("vllm_triton"),
    "vllm_installed": _vllm_whole("vllm_installed"),
    **{name: _gemv_peer(name) for name in GEMV_VARIANTS},
}
DEFAULT_PEERS = ("triton", "grouped_mm")

# GEMMs alone: (timed calls, finish per call: the checked output, computed outside the timing, notes)
GemmCalls = tuple[list[Callable[[], object]], list[Callable[[], torch.Tensor]], dict]


def triton_gemms(shape: MoeShape, cases: list[MoeCase]) -> GemmCalls:
    """GEMM1 + SiLU-and-mul + GEMM2 of fused_moe on its own plan, alignment done beforehand."""
    calls, finishes = [], []
    for c in cases:
        plan = _triton_plan(shape, c)
        align = assign_slots(c.topk_ids_TK, plan, shape.local_experts, c.expert_map_E)
        out = torch.empty_like(c.hidden_TD)
        h_PF, y_SD = allocate_intermediates(align, plan, c.hidden_TD, shape.F, out)
        kwargs = {"expert_map_E": c.expert_map_E,
                  "apply_router_weight_on_input": c.apply_router_weight_on_input,
                  "precision": "tf32"}  # fmt: skip

        def call(c=c, align=align, plan=plan, h_PF=h_PF, y_SD=y_SD, out=out, kwargs=kwargs) -> None:
            launch_experts(c.hidden_TD, c.w13_eFD, c.w2_eDF, c.topk_weights_TK, c.topk_ids_TK, align, plan,
                           h_PF, y_SD, out, with_sum=False, **kwargs)  # fmt: skip

        def finish(c=c, y_SD=y_SD, out=out) -> torch.Tensor:
            if y_SD is not out:
                launch_sum(y_SD, out, c.topk_ids_TK, c.expert_map_E)
            return out

        calls.append(call)
        finishes.append(finish)
    plan = _triton_plan(shape, cases[0])
    # fold_k: GEMM2 sums over K itself on this plan's naive calls, so its GEMMs alone include the sum. A plan
    # with sum_in_gemm2 is timed here without it (with_sum=False: no counting, no read-back).
    notes = {"config": json.dumps(plan.config.to_json()), "fold_k": plan.fold_k,
             "sum_in_gemm2_left_out": plan.sum_in_gemm2}  # fmt: skip
    return calls, finishes, notes


def _vllm_gemms(name: str) -> Callable[[MoeShape, list[MoeCase]], GemmCalls]:
    def gemm_calls(shape: MoeShape, cases: list[MoeCase]) -> GemmCalls:
        peer = VLLM_PEERS[name]
        pairs = [peer.gemms_call(c, shape.num_experts) for c in cases]
        return [p[0] for p in pairs], [p[1] for p in pairs], _vllm_notes(peer, shape, cases[0])

    return gemm_calls


GEMM_PEERS: dict[str, Callable[[MoeShape, list[MoeCase]], GemmCalls]] = {
    "triton": triton_gemms,
    "vllm_triton": _vllm_gemms("vllm_triton"),
    "vllm_installed": _vllm_gemms("vllm_installed"),
}


class EagerTimer:
    """GraphTimer's interface without CUDA (the --cpu-smoke run): host clock around eager calls."""

    def __init__(self, calls: list[Callable[[], object]]):
        self.calls = calls
        self.num_calls = len(calls)
        for call in calls:
            call()

    def warm(self, seconds: float) -> None:
        pass

    def replay_us(self, inner: int = 1) -> float:
        t0 = time.perf_counter()
        for call in self.calls:
            call()
        return (time.perf_counter() - t0) * 1e6 / self.num_calls


def _timer(calls: list[Callable[[], object]]):
    return GraphTimer(calls) if torch.cuda.is_available() else EagerTimer(calls)


def bench_shape(
    shape: MoeShape,
    Ms: list[int],
    ceilings: dict[str, float],
    replays: int,
    peers: tuple[str, ...] = DEFAULT_PEERS,
    eager: bool = True,
    deadline: float | None = None,
    on_rows: Callable[[list[dict]], None] | None = None,
    gemms_alone: bool = False,
    check: bool = True,
    base: MoeCase | None = None,
    repeats: int = 1,
    bounds: tuple[str, ...] = (),
) -> list[dict]:
    """Rows for every (M, impl). Stops before an M once time.perf_counter() passes `deadline`;
    `on_rows` sees each M's rows as soon as they exist (for callers that save as they go).

    gemms_alone: also a `<peer>:gemms` timer for each peer that has one (GEMM_PEERS), in the same
    interleaved replays. check: each timer's output for the first input set against fused_moe_ref.
    base: the case holding the weights (default: this shape's, random, on the GPU).
    repeats: interleaved runs of `replays` each; a row's median_us is the median of the runs'
    medians (`repeat_medians_us`), so one disturbed run cannot decide a cell.
    bounds: practical bounds (benchmarks/bounds.py) timed in the same replays, rows `bound:<name>`,
    no output checked."""
    rows = []
    base = base if base is not None else shape_case(shape, 1, seed=7)  # holds the weights every set shares
    for M in Ms:
        if deadline is not None and time.perf_counter() > deadline:
            log(f"  {shape.name}: deadline reached before M={M}")
            break
        cases = rotated_sets(shape, M, base)
        counts = layer_counts(shape, cases)
        timers, notes, outputs = {}, {}, {}
        for name in peers:
            try:
                calls, notes[name] = GRAPH_PEERS[name](shape, cases, Ms)
                timers[name] = _timer(calls)
                outputs[name] = calls[0]
            except Exception as exc:  # noqa: BLE001 - one peer failing must not cost the others' numbers
                log(f"  {shape.name} M={M} {name}: not timed ({type(exc).__name__}: {str(exc)[:300]})")
        if gemms_alone:
            for name in peers:
                if name not in GEMM_PEERS:
                    continue
                try:
                    calls, finishes, notes[f"{name}:gemms"] = GEMM_PEERS[name](shape, cases)
                    timers[f"{name}:gemms"] = _timer(calls)
                    outputs[f"{name}:gemms"] = lambda call=calls[0], finish=finishes[0]: (call(), finish())[1]
                except Exception as exc:  # noqa: BLE001 - as above
                    log(
                        f"  {shape.name} M={M} {name}:gemms: not timed "
                        f"({type(exc).__name__}: {str(exc)[:300]})"
                    )
        for name in bounds:
            try:
                timers[f"bound:{name}"] = _timer([BOUNDS[name](c) for c in cases])
            except Exception as exc:  # noqa: BLE001 - as above
                log(f"  {shape.name} M={M} bound:{name}: not timed ({type(exc).__name__}: {str(exc)[:300]})")
        runs = [time_interleaved(timers, replays) for _ in range(repeats)]
        samples = {name: [us for run in runs for us in run[name]] for name in timers}
        repeat_medians = {name: [statistics.median(run[name]) for run in runs] for name in timers}
        del timers
        errors = _check_outputs(cases[0], outputs) if check else {}
        del outputs
        if eager:
            # The reference syncs the host (nonzero), so it cannot be captured: eager, fewer calls.
            samples["reference"] = _eager_us(fused_moe_ref, cases, reps=3 if M >= 4096 else 5)
            if M <= 1024:  # torch_moe syncs the host once per call (bincount().tolist()): eager too
                samples["torch_moe_eager"] = _eager_us(torch_moe, cases, reps=5)
        roof_us = (
            max(
                counts["flops"] / (ceilings["matmul_tflops"] * 1e12),
                counts["bytes"] / (ceilings["copy_gbps"] * 1e9),
            )
            * 1e6
        )
        m_rows = []
        for impl, us in samples.items():
            med = statistics.median(repeat_medians[impl]) if impl in repeat_medians else statistics.median(us)
            m_rows.append({
                "model": shape.model, "layout": shape.layout, "M": M, "impl": impl,
                "median_us": med, "min_us": min(us), "max_us": max(us), "samples": len(us),
                "tflops": counts["flops"] / med / 1e6, "gbps": counts["bytes"] / med / 1e3,
                "roofline_us": roof_us, "frac_roofline": roof_us / med,
                "experts_hit": counts["experts_hit"], "slots": counts["slots"],
                "weight_bytes": counts["weight_bytes"], **notes.get(impl, {}),
                **({"rel_err": errors[impl]} if impl in errors else {}),
                **({"repeat_medians_us": repeat_medians[impl]} if impl in repeat_medians else {}),
            })  # fmt: skip
        rows += m_rows
        if on_rows is not None:
            on_rows(m_rows)
        meds = {
            r["impl"]: r["median_us"] for r in m_rows if r["impl"] in samples and r["impl"] != "reference"
        }
        log(f"  {shape.name:24s} M={M:6d} " + "  ".join(f"{k} {v:9.1f} us" for k, v in meds.items())
            + f"  roofline {roof_us:8.1f} us")  # fmt: skip
        bad = {k: v for k, v in errors.items() if not v <= CHECK_TOLERANCE}
        if bad:
            log(f"  WRONG RESULT {shape.name} M={M}: relative error {bad} (> {CHECK_TOLERANCE})")
        del cases
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


# bf16 line of tests/kernels (expected ~3e-3 for ours, ~4-6e-3 for vLLM's layout: one more rounding).
CHECK_TOLERANCE = 1e-2


def _check_outputs(case: MoeCase, outputs: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Relative error of each timer's output for `case` against fused_moe_ref in fp32 (NaN: inf)."""
    reference = case.reference_fp32()
    errors = {}
    for name, call in outputs.items():
        try:
            out = call()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            errors[name] = float("inf") if torch.isnan(out).any() else rel_err(out, reference)
        except Exception as exc:  # noqa: BLE001 - reported in the row and the log, the timing stands
            log(f"  check {name} failed: {type(exc).__name__}: {str(exc)[:200]}")
            errors[name] = float("nan")
    return errors


def bench_alignment(shape: MoeShape, Ms: list[int], replays: int) -> list[dict]:
    """Alignment alone, one program vs count/scan/scatter, to place SINGLE_PROGRAM_MAX_SLOTS."""
    from moe_eval.kernels import fused_moe as module

    rows = []
    saved = module.SINGLE_PROGRAM_MAX_SLOTS
    base = shape_case(shape, 1, seed=7)
    try:
        for M in Ms:
            cases = rotated_sets(shape, M, base)
            for block_m in (16, 64):
                times = {}
                for path, limit in (("single", 1 << 40), ("three-launch", 0)):
                    if path == "single" and M * shape.top_k > 8192:
                        continue  # every slot in one program's registers: not meant for this size
                    module.SINGLE_PROGRAM_MAX_SLOTS = limit
                    calls = [
                        lambda c=c, bm=block_m: module.moe_align_block_size(
                            c.topk_ids_TK, bm, shape.local_experts, c.expert_map_E
                        )
                        for c in cases
                    ]
                    times[path] = median_us(calls, replays)
                rows.append(
                    {
                        "shape": shape.name,
                        "M": M,
                        "block_m": block_m,
                        **{f"{k}_us": v for k, v in times.items()},
                    }
                )
                log(
                    f"  align {shape.name} M={M} bm={block_m}: "
                    + ", ".join(f"{k} {v:.1f} us" for k, v in times.items())
                )
    finally:
        module.SINGLE_PROGRAM_MAX_SLOTS = saved
    return rows


def _eager_us(fn: Callable, cases: list[MoeCase], reps: int) -> list[float]:
    fn(*cases[0].args(), **cases[0].kwargs())
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        case = cases[i % len(cases)]
        t0 = time.perf_counter()
        fn(*case.args(), **case.kwargs())
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return times


# --- report --------------------------------------------------------------------------------------


def markdown_table(rows: list[dict]) -> str:
    """One row per (shape, M, impl); 'x triton' is this impl's time over Triton's (> 1: slower)."""
    lines = [
        "| model | layout | M | impl | median us | TFLOP/s | GB/s | roofline us | of roofline | x triton |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    by_key = {(r["model"], r["layout"], r["M"], r["impl"]): r for r in rows}
    for r in rows:
        triton = by_key.get((r["model"], r["layout"], r["M"], "triton"))
        ratio = f"{r['median_us'] / triton['median_us']:.2f}" if triton else ""
        lines.append(
            f"| {r['model']} | {r['layout']} | {r['M']} | {r['impl']} | "
            f"{r['median_us']:.1f} | {r['tflops']:.1f} | "
            f"{r['gbps']:.0f} | {r['roofline_us']:.1f} | {r['frac_roofline']:.1%} | {ratio} |"
        )
    return "\n".join(lines)


# --- issue 13: vLLM / bundled ratios against the targets --------------------------------------------

# Issue 13's targets, on one interleaved H200 run: vLLM time / bundled time >= CELL_TARGET at every
# cell of these shapes, for the whole call and for the GEMMs alone; >= GEOMEAN_TARGET as the
# geometric mean over the M of a shape; and latency ceilings (bundled whole call, us).
TARGET_SHAPES = ("Qwen3-30B-A3B TP1", "Mixtral-8x7B TP2", "Llama-4-Scout TP2")
CELL_TARGET = 1.00
GEOMEAN_TARGET = 1.05
LATENCY_TARGETS_US = {("Qwen3-30B-A3B TP1", 1): 24.0}
# The ratios the issue quotes from the week before it (whole call, vLLM / bundled), for the table.
ISSUE_BASELINE = {
    "Qwen3-30B-A3B TP1": (1.16, 1.03, 1.03, 1.08, 1.04, 0.92, 0.94),
    "Mixtral-8x7B TP2": (1.11, 1.02, 1.04, 0.95, 0.84, 0.85, 0.85),
    "Llama-4-Scout TP2": (1.23, 1.03, 1.08, 1.16, 1.02, 0.91, 0.95),
}


def ratio_tables(rows: list[dict]) -> tuple[str, bool]:
    """Markdown ratio tables (one per vLLM peer x {whole call, GEMMs alone}) and whether every
    target that has numbers passed. A cell is `ratio` or `**ratio** (miss)`."""
    by = rows_by_cell(rows)
    shapes = list(dict.fromkeys(f"{r['model']} {r['layout']}" for r in rows))
    Ms = sorted({r["M"] for r in rows})
    vllm_impls = [i for i in VLLM_PEER_NAMES if any(r["impl"] == i for r in rows)]
    lines, all_ok = [], True
    for impl in vllm_impls:
        src = next(r for r in rows if r["impl"] == impl)
        for suffix, what in (("", "whole call"), (":gemms", "GEMMs alone")):
            if not any(k[2] == impl + suffix for k in by):
                continue
            lines += [
                (
                    f"#### vLLM / bundled, {what}: {impl} "
                    f"({src.get('vllm_source', '?')}, vLLM {src.get('vllm_version', '?')})"
                ),
                "",
                "| shape | " + " | ".join(f"M={m}" for m in Ms) + " | geomean | verdict |",
                "|---|" + "---:|" * (len(Ms) + 1) + "---|",
            ]
            for shape in shapes:
                cells, ratios, ok = [], [], True
                targeted = shape in TARGET_SHAPES
                for M in Ms:
                    ours, theirs = by.get((shape, M, "triton" + suffix)), by.get((shape, M, impl + suffix))
                    if not ours or not theirs:
                        cells.append("-")
                        continue
                    ratio = theirs["median_us"] / ours["median_us"]
                    ratios.append(ratio)
                    miss = targeted and ratio < CELL_TARGET
                    wrong = [
                        n
                        for n, r in (("ours", ours), ("vLLM", theirs))
                        if not r.get("rel_err", 0) <= CHECK_TOLERANCE
                    ]
                    ok &= not miss and not wrong
                    cells.append((f"**{ratio:.2f}** (miss)" if miss else f"{ratio:.2f}")
                                 + (f" WRONG {'/'.join(wrong)}" if wrong else ""))  # fmt: skip
                geo = statistics.geometric_mean(ratios) if ratios else float("nan")
                geo_miss = targeted and ratios and geo < GEOMEAN_TARGET
                ok &= not geo_miss
                complete = len(ratios) == len(Ms)
                verdict = (
                    ("PASS" if ok else "FAIL")
                    if targeted and complete
                    else ("partial" if targeted else "no target")
                )
                if targeted and not ok:
                    all_ok = False
                lines.append(f"| {shape} | " + " | ".join(cells)
                             + (f" | {'**' if geo_miss else ''}{geo:.3f}{'**' if geo_miss else ''}"
                                f" | {verdict} |"))  # fmt: skip
            lines.append("")
    if vllm_impls:
        base = [s for s in shapes if s in ISSUE_BASELINE]
        if base:
            lines += [
                "Issue 13's numbers from the week before (whole call, vLLM / bundled), for comparison:",
                "",
            ]
            lines += [f"- {s}: " + " ".join(f"{v:.2f}" for v in ISSUE_BASELINE[s]) for s in base]
            lines.append("")
    latency, met = latency_lines(by, LATENCY_TARGETS_US, "Latency")
    return "\n".join(lines + latency), all_ok and met


def latency_lines(by: dict, targets: dict, label: str) -> tuple[list[str], bool]:
    """One line per (shape, M) latency target the rows have (bundled whole call), and whether all were met."""
    lines, ok = [], True
    for (shape, M), limit in targets.items():
        r = by.get((shape, M, "triton"))
        if r:
            met = r["median_us"] <= limit
            ok &= met
            lines.append(f"{label}: {shape} M={M} bundled whole call {r['median_us']:.1f} us "
                         f"(target <= {limit:.0f} us): {'PASS' if met else 'FAIL'}")  # fmt: skip
    return lines, ok


# --- issue 23: the prefill targets against both peers ------------------------------------------------

# Issue 23's targets, on one interleaved H200 run (median of the repeats): peer time / bundled time
# >= 1.00 at every cell of tile_configs.PREFILL_SHAPES for FlashInfer CUTLASS and vLLM's Triton, >= 75 %
# of the roofline at M >= 1024, and Qwen3-30B-A3B TP1 M = 1 within 22 us (bundled whole call).
PREFILL_PEERS = ("flashinfer_cutlass", "vllm_triton")
ROOFLINE_TARGET = 0.75
ROOFLINE_FROM_M = 1024
PREFILL_LATENCY_US = {("Qwen3-30B-A3B TP1", 1): 22.0}


def prefill_tables(rows: list[dict]) -> tuple[str, bool]:
    """Markdown: peer / bundled per cell for each peer, the bundled kernel's fraction of the roofline,
    and the decode latency, each against issue 23's targets; and whether every target with numbers
    was met. Only shapes of PREFILL_SHAPES count; a cell with a wrong output counts as missed."""
    by = rows_by_cell(rows)
    shapes = [s for s in dict.fromkeys(f"{r['model']} {r['layout']}" for r in rows) if s in PREFILL_SHAPES]
    Ms = sorted({r["M"] for r in rows})
    lines, all_ok = [], True

    def ok_output(r: dict) -> bool:
        return r.get("rel_err", 0) <= CHECK_TOLERANCE

    for peer in PREFILL_PEERS:
        if not any(k[2] == peer for k in by):
            continue
        won = total = 0
        lines += [f"#### {peer} / bundled, whole call (>= {CELL_TARGET:.2f}: bundled at least as fast)", "",
                  *_m_head(Ms, last="geomean")]  # fmt: skip
        for shape in shapes:
            cells, ratios = [], []
            for M in Ms:
                ours, theirs = by.get((shape, M, "triton")), by.get((shape, M, peer))
                if not ours or not theirs:
                    cells.append("-")
                    continue
                ratio = theirs["median_us"] / ours["median_us"]
                ratios.append(ratio)
                wrong = not ok_output(ours) or not ok_output(theirs)
                miss = ratio < CELL_TARGET or not ok_output(ours)
                total += 1
                won += not miss
                all_ok &= not miss
                cells.append((f"**{ratio:.2f}**" if miss else f"{ratio:.2f}") + (" WRONG" if wrong else ""))
            geo = f"{statistics.geometric_mean(ratios):.3f}" if ratios else "-"
            lines.append(f"| {shape} | " + " | ".join(cells) + f" | {geo} |")
        lines += ["", f"{won} of {total} cells at >= {CELL_TARGET:.2f}.", ""]
    roof_Ms = [m for m in Ms if m >= ROOFLINE_FROM_M]
    if roof_Ms:
        lines += [f"#### bundled fraction of the roofline (target >= {ROOFLINE_TARGET:.0%} "
                  f"at M >= {ROOFLINE_FROM_M})",
                  "", *_m_head(roof_Ms)]  # fmt: skip
        for shape in shapes:
            cells = []
            for M in roof_Ms:
                r = by.get((shape, M, "triton"))
                if not r:
                    cells.append("-")
                    continue
                miss = r["frac_roofline"] < ROOFLINE_TARGET
                all_ok &= not miss
                cells.append(f"**{r['frac_roofline']:.0%}**" if miss else f"{r['frac_roofline']:.0%}")
            lines.append(f"| {shape} | " + " | ".join(cells) + " |")
        lines.append("")
    latency, met = latency_lines(by, PREFILL_LATENCY_US, "Decode")
    return "\n".join(lines + latency + bound_lines(by, shapes, roof_Ms)), all_ok and met


def _m_head(Ms: list[int], first: str = "shape", last: str | None = None) -> list[str]:
    """A Markdown table's header and alignment rows: `first`, a right-aligned column per M (and `last`)."""
    columns = [f"M={m}" for m in Ms] + ([last] if last else [])
    return ["| " + " | ".join([first, *columns]) + " |", "|---|" + "---:|" * len(columns)]


def bound_lines(by: dict, shapes: list[str], Ms: list[int]) -> list[str]:
    """The practical bounds of the run (benchmarks/bounds.py), where it timed them: the bundled whole call
    against torch's grouped GEMMs of the same work alone, and both against the roofline; no target."""
    bound = "bound:grouped_mm_gemms"
    if not Ms or not any(k[2] == bound for k in by):
        return []
    title = ("#### bundled whole call / torch grouped GEMMs alone (< 1.00: the bundled call, routing, SiLU "
             "and top-k sum included, takes less than the two vendor GEMMs alone); in brackets the grouped "
             "GEMMs' own fraction of the roofline")  # fmt: skip
    lines = ["", title, "", *_m_head(Ms)]
    for shape in shapes:
        cells = []
        for M in Ms:
            ours, gemms = by.get((shape, M, "triton")), by.get((shape, M, bound))
            cells.append(f"{ours['median_us'] / gemms['median_us']:.2f} ({gemms['frac_roofline']:.0%})"
                         if ours and gemms else "-")  # fmt: skip
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    return lines + split_lines(by, shapes, Ms, bound) + [""]


def split_lines(by: dict, shapes: list[str], Ms: list[int], bound: str) -> list[str]:
    """Where the bundled call's time goes beside the grouped GEMMs, where the run timed `triton:gemms` (its
    GEMM1 + SiLU + GEMM2 alone, the slot assignment precomputed): the cause of a cell above 1.00 measured,
    either the GEMMs themselves or the rest of the call (alignment, routing, top-k sum)."""
    if not any(k[2] == "triton:gemms" for k in by):
        return []
    title = (
        "#### the bundled GEMMs alone / torch grouped GEMMs alone; then the rest of the bundled call "
        "(whole call - its GEMMs alone: alignment, routing, top-k sum) as a share of the whole call"
    )
    lines = ["", title, "", *_m_head(Ms)]
    for shape in shapes:
        cells = []
        for M in Ms:
            whole, ours, gemms = (by.get((shape, M, impl)) for impl in ("triton", "triton:gemms", bound))
            cells.append(f"{ours['median_us'] / gemms['median_us']:.2f}; "
                         f"{1 - ours['median_us'] / whole['median_us']:.0%}"
                         if whole and ours and gemms else "-")  # fmt: skip
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    return lines + [""]


# --- issue 34: decode within 1.25 x the copy floor ---------------------------------------------------

# The floor of a call: the bytes of the experts it hits, read once, at the H200's measured copy ceiling
# (device-to-device copy, read + write counted: docs/perf.md). Issue 34's target: the bundled call at
# M = 1 within DECODE_FLOOR_RATIO of it, at every shape of PREFILL_SHAPES.
DECODE_COPY_GBPS = 4238.0
DECODE_FLOOR_RATIO = 1.25
DECODE_TARGET_M = 1


def decode_tables(rows: list[dict]) -> tuple[str, bool]:
    """Markdown per shape: each timed impl at each M as `us (TB/s on the weights, x floor)`, then the
    M = 1 verdict for the tuned plan and for the best of the other bundled impls (`triton*`); and
    whether every shape's best bundled impl met the target. A wrong output never counts as met. Where the
    read bounds were timed, issue 56's table follows and its verdict (`read_tables`) is the run's."""
    by = rows_by_cell(rows)
    shapes = [s for s in dict.fromkeys(f"{r['model']} {r['layout']}" for r in rows) if s in PREFILL_SHAPES]
    Ms = sorted({r["M"] for r in rows})
    impls = [i for i in dict.fromkeys(r["impl"] for r in rows) if i != "reference"]
    lines, all_ok = [], True
    for shape in shapes:
        title = f"#### {shape}: us (TB/s on the weights, x the copy floor at {DECODE_COPY_GBPS:.0f} GB/s)"
        lines += [title, "", *_m_head(Ms, first="impl")]
        for impl in impls:
            cells = []
            for M in Ms:
                r = by.get((shape, M, impl))
                if not r or "weight_bytes" not in r:
                    cells.append("-")
                    continue
                floor_us = r["weight_bytes"] / DECODE_COPY_GBPS / 1e3
                ratio = r["median_us"] / floor_us
                wrong = " WRONG" if not r.get("rel_err", 0) <= CHECK_TOLERANCE else ""
                forced = "" if r.get("gemv_ran", True) else " (aligned)"
                cells.append(f"{r['median_us']:.1f} ({r['weight_bytes'] / r['median_us'] / 1e6:.2f}, "
                             f"{ratio:.2f}x){forced}{wrong}")  # fmt: skip
            lines.append(f"| {impl} | " + " | ".join(cells) + " |")
        verdicts = []
        for label, names in (
            ("tuned", ["triton"]),
            ("best bundled", [i for i in impls if i.startswith("triton") and ":" not in i]),
        ):
            cands = [by[(shape, DECODE_TARGET_M, n)] for n in names if (shape, DECODE_TARGET_M, n) in by]
            cands = [r for r in cands if r.get("rel_err", 0) <= CHECK_TOLERANCE and "weight_bytes" in r]
            if not cands:
                continue
            best = min(cands, key=lambda r: r["median_us"])
            ratio = best["median_us"] * DECODE_COPY_GBPS * 1e3 / best["weight_bytes"]
            met = ratio <= DECODE_FLOOR_RATIO
            if label == "best bundled":
                all_ok &= met
            verdicts.append(f"{label} {best['impl']} {best['median_us']:.1f} us = {ratio:.2f}x "
                            f"({'PASS' if met else 'FAIL'})")  # fmt: skip
        lines += [
            "",
            f"M={DECODE_TARGET_M}, target <= {DECODE_FLOOR_RATIO:.2f}x the floor: " + "; ".join(verdicts),
            "",
        ]
    if any(r["impl"].startswith("bound:weights_read") for r in rows):
        # Issue 56 restated the target against the read (issue 34 found the floor's out of reach): its
        # verdict is the run's.
        read_text, all_ok = read_tables(rows)
        lines.append(read_text)
    return "\n".join(lines), all_ok


# --- issue 56: decode within 1.10 x the one-launch read of the same experts -------------------------

# The practical floor of a decode call: bound:weights_read* (benchmarks/bounds.py), one Triton launch that
# only reads the experts the call hits, timed in the same replays; the best of its cuts counts.
READ_TARGET = 1.10
READ_TARGET_MS = (1, 8, 40)
READ_PEERS = ("vllm_triton", "flashinfer_cutlass")


def rows_by_cell(rows: Iterable[dict]) -> dict[tuple[str, int, str], dict]:
    """Benchmark rows keyed (shape name, M, impl), as every table and the tile-file scripts read them."""
    return {(f"{r['model']} {r['layout']}", r["M"], r["impl"]): r for r in rows}


def repeat_medians(row: dict) -> list[float]:
    """A row's per-repeat medians (its one median for rows written before the repeats)."""
    return row.get("repeat_medians_us", [row["median_us"]])


def faster_in_every_repeat(ours: list[float], theirs: list[float], gain: float) -> bool:
    """Each repeat of `ours` below the same repeat of `theirs` by at least `gain` of it: not noise."""
    return all(a < b * (1 - gain) for a, b in zip(ours, theirs))


def one_launch_read(by: dict, shape: str, M: int) -> float | None:
    """The best cut of the one-launch read at (shape, M) in rows keyed (shape, M, impl), or None."""
    reads = [
        r["median_us"]
        for (s, m, i), r in by.items()
        if (s, m) == (shape, M) and i.startswith("bound:weights_read")
    ]
    return min(reads) if reads else None


def read_tables(rows: list[dict]) -> tuple[str, bool]:
    """Markdown: at each shape of PREFILL_SHAPES and M of READ_TARGET_MS that has a read bound, the read
    (best cut), the shipped plan, the best bundled call (`triton*` whole calls with a right output), each
    as us (x the read), and the peers beside them; and whether every such cell's best bundled call is
    within READ_TARGET. A cell whose bundled calls are all wrong counts as missed."""
    by = rows_by_cell(rows)
    shapes = [s for s in dict.fromkeys(f"{r['model']} {r['layout']}" for r in rows) if s in PREFILL_SHAPES]
    impls = [i for i in dict.fromkeys(r["impl"] for r in rows) if i.startswith("triton") and ":" not in i]
    peers = [p for p in READ_PEERS if any(k[2] == p for k in by)]
    header = ["shape", "M", "read us", "shipped (x read)", "best bundled", "us (x read)"]
    header += [f"{p} (x read)" for p in peers]
    title = f"#### Decode against the one-launch read of the same experts (target <= {READ_TARGET:.2f}x)"
    align = "|---|---:|---:|---:|---|---:|" + "---:|" * len(peers)
    lines = [title, "", "| " + " | ".join(header) + " |", align]
    met_cells = total = 0
    for shape in shapes:
        for M in READ_TARGET_MS:
            read = one_launch_read(by, shape, M)
            if read is None:
                continue

            def cell(impl: str) -> str:
                r = by.get((shape, M, impl))
                if not r:
                    return "-"
                wrong = "" if r.get("rel_err", 0) <= CHECK_TOLERANCE else " WRONG"
                return f"{r['median_us']:.1f} ({r['median_us'] / read:.2f}x){wrong}"

            right = [by[(shape, M, i)] for i in impls if (shape, M, i) in by]
            right = [r for r in right if r.get("rel_err", 0) <= CHECK_TOLERANCE]
            best = min(right, key=lambda r: r["median_us"]) if right else None
            met = best is not None and best["median_us"] / read <= READ_TARGET
            total += 1
            met_cells += met
            best_cell = cell(best["impl"]) if best else "-"
            cells = [shape, str(M), f"{read:.1f}", cell("triton"), best["impl"] if best else "-",
                     best_cell if met else f"**{best_cell}**", *(cell(p) for p in peers)]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"{met_cells} of {total} cells within {READ_TARGET:.2f}x of the read.", ""]
    return "\n".join(lines), total > 0 and met_cells == total


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mrows = [r for r in rows if r["model"] == model]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        styles = {
            "triton": "-o",
            "grouped_mm": "--s",
            "flashinfer_cutlass": "-D",
            "reference": ":^",
            "torch_moe_eager": "-.x",
        }  # style = impl
        for color, layout in zip(
            ["C0", "C1", "C2"], dict.fromkeys(r["layout"] for r in mrows)
        ):  # color = layout
            for impl, style in styles.items():
                pts = sorted(
                    (r["M"], r["frac_roofline"]) for r in mrows if r["layout"] == layout and r["impl"] == impl
                )
                if pts:
                    ax.plot(*zip(*pts), style, color=color, label=f"{impl} {layout}", alpha=0.85)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("fraction of roofline")
        ax.set_title(f"{model} MoE layer, H200, bf16 (CUDA-graph medians)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        path = out_dir / f"roofline_{model}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# --- compile before timing -------------------------------------------------------------------------


def _precompile_worker(shape_index: int, Ms: list[int], peers: tuple[str, ...], gemms_alone: bool,
                       peer_dir: str | None, gemv_force: bool = False) -> list[str]:  # fmt: skip
    """Worker: run every timed call once at each M on uninitialised weights, so Triton compiles into
    the disk cache what the timing process will then only load. Same M, so the same specialisations
    (vLLM's kernel specialises its grid and token counts on divisibility by 16)."""
    import types

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    configure_vllm_peers([p for p in peers if p in VLLM_PEER_NAMES], Path(peer_dir) if peer_dir else None)
    GEMV_OPTIONS["force"] = gemv_force
    shape = SHIPPED_SHAPES[shape_index]
    kw = {"dtype": torch.bfloat16, "device": "cuda"}
    weights = types.SimpleNamespace(
        w13_eFD=torch.empty(shape.local_experts, 2 * shape.F, shape.D, **kw),
        w2_eDF=torch.empty(shape.local_experts, shape.D, shape.F, **kw),
    )
    errors = []
    for M in Ms:
        case = shape_case(shape, M, seed=M, weights_from=weights)
        for name in peers:
            try:
                compiled_apart = ("triton", "triton_default", "triton_package", *SUM_IN_GEMM2_VARIANTS)
                if name in compiled_apart + VLLM_PEER_NAMES + tuple(GEMV_VARIANTS):
                    GRAPH_PEERS[name](shape, [case], Ms)[0][0]()
                if gemms_alone and name in GEMM_PEERS:
                    calls, finishes, _ = GEMM_PEERS[name](shape, [case])
                    calls[0]()
                    finishes[0]()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - compiles inline later; the timing process reports
                errors.append(f"{shape.name} M={M} {name}: {type(exc).__name__}: {str(exc)[:200]}")
        del case
        torch.cuda.empty_cache()
    return errors


def precompile(shapes: list[MoeShape], Ms: list[int], peers: tuple[str, ...], gemms_alone: bool,
               peer_dir: Path | None, workers: int) -> None:  # fmt: skip
    import concurrent.futures
    import multiprocessing

    t0 = time.perf_counter()
    jobs = [(SHIPPED_SHAPES.index(s), [M]) for s in shapes for M in Ms]
    jobs.sort(key=lambda j: -j[1][0])  # the largest M first: the longest jobs start early
    log(f"precompiling {len(jobs)} (shape, M) cells on {workers} workers")
    ctx = multiprocessing.get_context("spawn")
    args = [(si, ms, peers, gemms_alone, str(peer_dir) if peer_dir else None, GEMV_OPTIONS["force"])
            for si, ms in jobs]  # fmt: skip
    try:
        with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            for errors in pool.map(_precompile_worker, *zip(*args)):
                for err in errors:
                    log(f"  precompile: {err}")
    except Exception as exc:  # noqa: BLE001 - the timing process compiles what is missing
        log(f"precompile stopped: {type(exc).__name__}: {str(exc)[:300]}")
    log(f"precompiled in {time.perf_counter() - t0:.0f} s")


# --- the run ---------------------------------------------------------------------------------------


def cpu_smoke_shapes() -> list[MoeShape]:
    """The issue's three shapes in miniature, for --cpu-smoke (same names: the target logic runs)."""
    return [
        MoeShape("Qwen3-30B-A3B", "TP1", 128, 128, 8, 64, 32),
        MoeShape("Mixtral-8x7B", "TP2", 8, 8, 2, 64, 48),
        MoeShape("Llama-4-Scout", "TP2", 16, 16, 1, 64, 32, apply_router_weight_on_input=True),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    add_shape_args(parser)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=1,
                        help="interleaved runs per (shape, M); a row's time is the median of their "
                             "medians")  # fmt: skip
    parser.add_argument("--prefill-targets", action="store_true",
                        help="end with issue 23's tables (peers / bundled, roofline, decode) in "
                             "prefill.md")  # fmt: skip
    parser.add_argument("--decode-targets", action="store_true",
                        help="end with issue 34's table (us, TB/s on the weights, x the copy floor) in "
                             "decode.md")  # fmt: skip
    parser.add_argument(
        "--gemv-force",
        action="store_true",
        help="the triton_gemv* peers run the GEMVs at every M, not only on naive calls",
    )
    parser.add_argument("--skip-alignment", action="store_true", help="skip the alignment-path comparison")
    parser.add_argument("--peers", nargs="*", default=list(DEFAULT_PEERS), choices=list(GRAPH_PEERS))
    parser.add_argument(
        "--skip-eager", action="store_true", help="skip the eager reference and torch_moe rows"
    )
    parser.add_argument(
        "--vllm-peer-dir", type=Path, help="extracted vLLM kernel + configs (default .vllm-peer/)"
    )
    parser.add_argument("--gemms-alone", action=argparse.BooleanOptionalAction, default=None,
                        help="also time GEMM1 + activation + GEMM2 alone "
                             "(default: on with a vLLM peer)")  # fmt: skip
    parser.add_argument("--bounds", nargs="*", default=[], choices=list(BOUNDS),
                        help="practical bounds timed in the same replays (benchmarks/bounds.py)")  # fmt: skip
    parser.add_argument("--no-check", action="store_true", help="skip the output check against fused_moe_ref")
    parser.add_argument("--precompile-workers", type=int, default=12, help="0: compile inline while timing")
    parser.add_argument("--deadline-s", type=float, help="start no new (shape, M) after this many seconds")
    parser.add_argument("--report-only", type=Path, help="print the ratio tables of a rows.jsonl and exit")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="no GPU: miniature shapes under Triton's interpreter in fp32, eager timing "
                             "(plumbing only)")  # fmt: skip
    add_flashinfer_options(parser)
    args = parser.parse_args(argv)
    if args.report_only is not None:
        rows = [json.loads(line) for line in args.report_only.read_text().splitlines() if line.strip()]
        if args.decode_targets:
            table, ok = decode_tables(rows)
        else:
            table, ok = prefill_tables(rows) if args.prefill_targets else ratio_tables(rows)
        print(table)
        return 0 if ok else 1
    started = time.perf_counter()
    deadline = started + args.deadline_s if args.deadline_s is not None else None
    apply_flashinfer_options(args)
    GEMV_OPTIONS["force"] = args.gemv_force
    args.out_dir.mkdir(parents=True, exist_ok=True)
    failed = configure_vllm_peers([p for p in args.peers if p in VLLM_PEER_NAMES], args.vllm_peer_dir)
    peers = tuple(p for p in args.peers if p not in failed)
    gemms_alone = (
        args.gemms_alone if args.gemms_alone is not None else any(p in VLLM_PEER_NAMES for p in peers)
    )
    for name, peer in VLLM_PEERS.items():
        log(f"{name}: vLLM {peer.version} from {peer.source}")
    import triton

    rows_path = args.out_dir / "rows.jsonl"
    rows_path.write_text("")

    def save(new_rows: list[dict]) -> None:
        with rows_path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in new_rows)

    if args.cpu_smoke:
        shapes = cpu_smoke_shapes()
        if args.shapes:
            shapes = [s for s in shapes if s.name in args.shapes]
        ceilings = {"matmul_tflops": 1.0, "copy_gbps": 1.0}  # no device: the roofline columns mean nothing
        Ms = [m for m in args.m if m <= 64]
    else:
        shapes = shapes_named(args.shapes) if args.shapes else list(SHIPPED_SHAPES)
        Ms = list(args.m)
        if args.precompile_workers > 0:
            precompile(shapes, Ms, peers, gemms_alone, args.vllm_peer_dir, args.precompile_workers)
        ceilings = measure_ceilings()
    log(f"ceilings: {ceilings}")
    rows = []
    for shape in shapes:
        base = None
        if args.cpu_smoke:
            base = shape_case(shape, 1, seed=7, device="cpu", dtype=torch.float32)
        rows += bench_shape(
            shape, Ms, ceilings, args.replays, peers, eager=not args.skip_eager, deadline=deadline,
            on_rows=save, gemms_alone=gemms_alone, check=not args.no_check, base=base, repeats=args.repeats,
            bounds=tuple(args.bounds),
        )  # fmt: skip
    align_rows = []
    if not args.skip_alignment and not args.cpu_smoke:
        for shape in shapes[:1]:
            align_rows += bench_alignment(shape, Ms, 20)
    ceilings_after = ceilings if args.cpu_smoke else measure_ceilings()
    log(f"ceilings after: {ceilings_after}")
    meta = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (cpu smoke)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": "python " + " ".join(sys.argv),
        "ceilings_before": ceilings,
        "ceilings_after": ceilings_after,
        "seconds": round(time.perf_counter() - started, 1),
        "vllm_peers": {
            n: {"source": p.source, "version": p.version, **p.notes} for n, p in VLLM_PEERS.items()
        },
    }
    if "flashinfer_cutlass" in args.peers:
        import flashinfer

        meta["flashinfer"] = flashinfer.__version__
    (args.out_dir / "bench.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "alignment": align_rows}, indent=1)
    )
    table = markdown_table(rows)
    (args.out_dir / "bench.md").write_text(table + "\n")
    if not args.cpu_smoke:
        plot(rows, args.out_dir)
    print(json.dumps(meta))
    print(table)
    ok = True
    if args.decode_targets:
        tables, ok = decode_tables(rows)
        (args.out_dir / "decode.md").write_text(tables + "\n")
        print()
        print(tables)
    elif args.prefill_targets:
        tables, ok = prefill_tables(rows)
        (args.out_dir / "prefill.md").write_text(tables + "\n")
        print()
        print(tables)
    elif VLLM_PEERS:
        ratios, ok = ratio_tables(rows)
        (args.out_dir / "ratios.md").write_text(ratios + "\n")
        print()
        print(ratios)
    wrong = [(r["model"], r["layout"], r["M"], r["impl"], r["rel_err"]) for r in rows
             if "rel_err" in r and not r["rel_err"] <= CHECK_TOLERANCE]  # fmt: skip
    if wrong:
        print(f"WRONG RESULTS (relative error > {CHECK_TOLERANCE}): {wrong}")
    return 0 if ok and not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
