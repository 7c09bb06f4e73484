"""Benchmark the bundled Triton fused MoE against its peers on the shipped per-rank shapes (GPU).

Peers (--peers), interleaved replay by replay so they share the card's thermal and power state:
  triton      moe_eval.kernels.fused_moe.fused_moe (alignment included), CUDA graph
  grouped_mm  moe_eval.kernels.torch_moe.grouped_mm_moe (sort, grouped GEMM, SiLU-and-mul,
              grouped GEMM, unpermute, sum), CUDA graph
  flashinfer_cutlass  moe_eval.kernels.flashinfer_cutlass (FlashInfer's CUTLASS fused MoE, BF16),
              autotuned once per shape at exactly the M values of the run, CUDA graph (needs
              flashinfer installed and its fused_moe_90 module: benchmarks/flashinfer_h200.py builds
              it, or places a prebuilt one with --aot-library)
Eager, unless --skip-eager (they sync the host, so they cannot be captured):
  reference   moe_eval.kernels.fused_moe.fused_moe_ref (fp32)
  torch_moe_eager  moe_eval.kernels.torch_moe.torch_moe (the CPU path; M <= 1024)
Each graph holds one call per rotated input set (different tokens and routing, so the experts a
call hits were not the previous call's), replayed back to back after a warm-up; the time of a call
is a replay's time over the calls in it; the median of the replays is reported.

Roofline: max(FLOPs / matmul ceiling, bytes / copy ceiling), FLOPs = 6 * slots * D * F (slots on
this rank), bytes = experts hit * 3 * D * F * 2 + x + out, ceilings measured in the same run
(8192^3 bf16 matmul on random data; device-to-device copy counting read + write).

Usage: python benchmarks/bench_fused_moe.py --out-dir DIR [--shapes "Qwen3-30B-A3B TP1" ...] [--m 1 16]
                                           [--peers triton grouped_mm flashinfer_cutlass] [--skip-eager]
Writes DIR/bench.json, DIR/bench.md and DIR/roofline_<model>.png; prints the table on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from moe_eval.kernels.fused_moe import fused_moe, fused_moe_ref
from moe_eval.kernels.testing import MoeCase, shape_case
from moe_eval.kernels.tile_configs import M_GRID, SHIPPED_SHAPES, MoeShape
from moe_eval.kernels.torch_moe import grouped_mm_moe, torch_moe


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
    return [shape_case(shape, M, seed=1000 * M + i, weights_from=weights_from) for i in range(n_sets)]


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
    bytes_ = hit * 3 * shape.D * shape.F * 2 + 2 * M * shape.D * 2
    return {"experts_hit": hit, "slots": slot, "flops": flops, "bytes": bytes_}


def _call(fn: Callable, case: MoeCase) -> Callable[[], object]:
    return lambda: fn(*case.args(), **case.kwargs())


# --- peers: each turns the rotated input sets into one call per set, plus notes for its rows -----

PeerCalls = tuple[list[Callable[[], object]], dict]


def triton_peer(shape: MoeShape, cases: list[MoeCase], Ms: list[int]) -> PeerCalls:
    return [_call(fused_moe, c) for c in cases], {}


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
            out=out, workspace=ws, tune_max_num_tokens=_fi.max_tokens, enable_pdl=FLASHINFER_OPTIONS["enable_pdl"],
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


GRAPH_PEERS: dict[str, Callable[[MoeShape, list[MoeCase], list[int]], PeerCalls]] = {
    "triton": triton_peer,
    "grouped_mm": grouped_mm_peer,
    "flashinfer_cutlass": flashinfer_cutlass_peer,
}
DEFAULT_PEERS = ("triton", "grouped_mm")


def bench_shape(
    shape: MoeShape,
    Ms: list[int],
    ceilings: dict[str, float],
    replays: int,
    peers: tuple[str, ...] = DEFAULT_PEERS,
    eager: bool = True,
    deadline: float | None = None,
    on_rows: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Rows for every (M, impl). Stops before an M once time.perf_counter() passes `deadline`;
    `on_rows` sees each M's rows as soon as they exist (for callers that save as they go)."""
    rows = []
    base = shape_case(shape, 1, seed=7)  # holds the weights every set shares
    for M in Ms:
        if deadline is not None and time.perf_counter() > deadline:
            log(f"  {shape.name}: deadline reached before M={M}")
            break
        cases = rotated_sets(shape, M, base)
        counts = layer_counts(shape, cases)
        timers, notes = {}, {}
        for name in peers:
            calls, notes[name] = GRAPH_PEERS[name](shape, cases, Ms)
            timers[name] = GraphTimer(calls)
        samples = time_interleaved(timers, replays)
        del timers
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
            med = statistics.median(us)
            m_rows.append({
                "model": shape.model, "layout": shape.layout, "M": M, "impl": impl,
                "median_us": med, "min_us": min(us), "max_us": max(us), "samples": len(us),
                "tflops": counts["flops"] / med / 1e6, "gbps": counts["bytes"] / med / 1e3,
                "roofline_us": roof_us, "frac_roofline": roof_us / med,
                "experts_hit": counts["experts_hit"], "slots": counts["slots"], **notes.get(impl, {}),
            })  # fmt: skip
        rows += m_rows
        if on_rows is not None:
            on_rows(m_rows)
        meds = {r["impl"]: r["median_us"] for r in m_rows if r["impl"] in peers}
        log(f"  {shape.name:24s} M={M:6d} " + "  ".join(f"{k} {v:9.1f} us" for k, v in meds.items())
            + f"  roofline {roof_us:8.1f} us")  # fmt: skip
        del cases
        torch.cuda.empty_cache()
    return rows


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
            f"| {r['model']} | {r['layout']} | {r['M']} | {r['impl']} | {r['median_us']:.1f} | {r['tflops']:.1f} | "
            f"{r['gbps']:.0f} | {r['roofline_us']:.1f} | {r['frac_roofline']:.1%} | {ratio} |"
        )
    return "\n".join(lines)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    add_shape_args(parser)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--skip-alignment", action="store_true", help="skip the alignment-path comparison")
    parser.add_argument("--peers", nargs="*", default=list(DEFAULT_PEERS), choices=list(GRAPH_PEERS))
    parser.add_argument(
        "--skip-eager", action="store_true", help="skip the eager reference and torch_moe rows"
    )
    add_flashinfer_options(parser)
    args = parser.parse_args(argv)
    apply_flashinfer_options(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    shapes = shapes_named(args.shapes) if args.shapes else list(SHIPPED_SHAPES)
    import triton

    ceilings = measure_ceilings()
    log(f"ceilings: {ceilings}")
    rows = []
    for shape in shapes:
        rows += bench_shape(
            shape, args.m, ceilings, args.replays, tuple(args.peers), eager=not args.skip_eager
        )
    align_rows = []
    if not args.skip_alignment:
        for shape in shapes[:1]:
            align_rows += bench_alignment(shape, args.m, 20)
    ceilings_after = measure_ceilings()
    log(f"ceilings after: {ceilings_after}")
    meta = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": "python " + " ".join(sys.argv),
        "ceilings_before": ceilings,
        "ceilings_after": ceilings_after,
    }
    if "flashinfer_cutlass" in args.peers:
        import flashinfer

        meta["flashinfer"] = flashinfer.__version__
    (args.out_dir / "bench.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "alignment": align_rows}, indent=1)
    )
    table = markdown_table(rows)
    (args.out_dir / "bench.md").write_text(table + "\n")
    plot(rows, args.out_dir)
    print(json.dumps(meta))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
