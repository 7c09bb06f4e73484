"""Expert parallelism (TEP and DEP) over two ranks around the bundled Triton kernel, over NCCL.

For `nvidia-h200-x2` (any host with 2 GPUs): one process per GPU, the Qwen3-30B-A3B layer
(E=128, K=8, D=2048, F=768) split 64 + 64 experts (vLLM's linear placement), M tokens per rank.

Correctness, per M, against fused_moe_ref (fp32) of the full layer on one rank:
  TEP  both ranks take the same M tokens; partial outputs all-reduced.
  DEP  each rank has its own M tokens; all-gather, local experts, then the combine back, both ways:
       reduce-scatter (what NCCL runs by default) and all-reduce keeping own rows (gloo's way).
  Bound: relative error < 1e-2 and no NaN, as in the kernel tests.

Timing (GPU only), CUDA graphs over 4 rotated input sets sharing the weights, medians:
  tep_local   this rank's kernel on TEP's local work: M tokens, its 64 experts (expert map)
  dep_local   this rank's kernel on DEP's local work: the 2M gathered tokens, its 64 experts
  one_gpu     the full layer (128 experts) on M tokens on one GPU: what TP1 would run
each replayed with both ranks at once ("concurrent") and with the other rank idle at a barrier
("alone": the single-GPU time of the same local work), interleaved round by round. Plus the whole
TEP and DEP layer step, collectives included, eager (DEP syncs the host for the token counts).

    python benchmarks/bench_ep_nccl.py --out-dir DIR                       # 2 GPUs, NCCL
    python benchmarks/bench_ep_nccl.py --out-dir DIR --cpu-smoke           # 2 CPU ranks, gloo, small

--cpu-smoke checks the script itself on a CPU (torch kernel, small shape, no timing). NVLink
multicast stays off in NCCL and torch (the lent multi-GPU machines require it); set here for the
rank processes, whatever the caller's environment says.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_eval.kernels.tile_configs import SHIPPED_SHAPES

if TYPE_CHECKING:
    from bench_fused_moe import GraphTimer

WORLD = 2
_QWEN3_TP1 = {s.name: s for s in SHIPPED_SHAPES}["Qwen3-30B-A3B TP1"]  # the whole layer; split here
QWEN3_30B_A3B = {"E": _QWEN3_TP1.num_experts, "K": _QWEN3_TP1.top_k, "D": _QWEN3_TP1.D, "F": _QWEN3_TP1.F}
SMOKE_SHAPE = {"E": 8, "K": 2, "D": 64, "F": 32}
M_GRID = (1, 64, 4096)
REL_TOL = 1e-2
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _barrier(rank: int) -> None:
    dist.barrier(device_ids=[rank])
    torch.cuda.synchronize()


def _time_rounds(
    timers: dict[str, GraphTimer], rank: int, rounds: int, inner: int
) -> dict[str, dict[str, list[float]]]:
    """Per graph (bench_fused_moe.GraphTimer): samples with both ranks replaying at once, and with
    this rank alone. A sample is `inner` back-to-back replays, long enough that host skew between
    the ranks is small next to the window in which both GPUs run."""
    samples = {name: {"concurrent": [], "alone": []} for name in timers}
    for timer in timers.values():  # warm-up: clocks up, caches in their steady state
        for _ in range(3):
            timer.replay_us(inner)
    for _ in range(rounds):
        for name, timer in timers.items():
            _barrier(rank)
            samples[name]["concurrent"].append(timer.replay_us(inner))
            for turn in range(WORLD):
                _barrier(rank)
                if turn == rank:
                    samples[name]["alone"].append(timer.replay_us(inner))
    return samples


def _time_layer_steps(steps: dict[str, object], rank: int, reps: int) -> dict[str, list[float]]:
    """Wall microseconds of a whole layer step (kernel + collectives), both ranks together."""
    out = {name: [] for name in steps}
    for step in steps.values():
        step()
    for _ in range(reps):
        for name, step in steps.items():
            _barrier(rank)
            t = time.perf_counter()
            step()
            torch.cuda.synchronize()
            out[name].append((time.perf_counter() - t) * 1e6)
    return out


def _step(wrapper, hidden, weights, routing, emap):
    """One layer step through a TEP / DEP wrapper (moe_eval.kernels.expert_parallel)."""
    from moe_eval.kernels.moe_call import MoeCall, Routing

    return wrapper.apply(MoeCall(hidden, weights, Routing(*routing), emap))


def _timings(moe, kernel, full, w13, w2, emap, M: int, rank: int, rounds: int) -> dict[str, float]:
    """Medians in microseconds: the local works and the one-GPU layer (graphs), the layer steps (eager).
    `moe`: the kernel's function (the local works); `kernel`: the registered kernel the wrappers take."""
    from moe_eval.kernels.expert_parallel import DepKernel, TepKernel
    from moe_eval.kernels.testing import make_case

    E, K, D, F = QWEN3_30B_A3B.values()
    rotations = [make_case(WORLD * M, E, K, D, F, dtype=torch.bfloat16, device=full.hidden_TD.device,
                           seed=100 * M + i, weights_from=full) for i in range(4)]  # fmt: skip

    def kernel(c, tokens: slice, w13, w2, emap):
        return lambda: moe(c.hidden_TD[tokens], w13, w2, c.topk_weights_TK[tokens], c.topk_ids_TK[tokens],
                           expert_map_E=emap)  # fmt: skip

    first_m, every = slice(0, M), slice(0, WORLD * M)
    works = {
        "tep_local": [kernel(c, first_m, w13, w2, emap) for c in rotations],
        "dep_local": [kernel(c, every, w13, w2, emap) for c in rotations],
        "one_gpu": [kernel(c, first_m, full.w13_eFD, full.w2_eDF, None) for c in rotations],
    }
    from bench_fused_moe import GraphTimer  # this folder; warm-up, capture, one checked replay

    timers = {name: GraphTimer(calls) for name, calls in works.items()}  # they keep the calls alive
    out = {}
    for name, modes in _time_rounds(timers, rank, rounds, inner=5).items():
        for mode, us in modes.items():
            out[f"us_{name}_{mode}"] = statistics.median(us)
    del timers
    c, mine = rotations[0], slice(rank * M, (rank + 1) * M)
    hidden, weights, ids = c.hidden_TD, c.topk_weights_TK, c.topk_ids_TK
    local = kernel.to_kernel_format(w13, w2)
    tep, dep = TepKernel(kernel), DepKernel(kernel)
    steps = {
        "tep_step": lambda: _step(tep, hidden[:M], local, (weights[:M], ids[:M]), emap),
        "dep_step": lambda: _step(dep, hidden[mine], local, (weights[mine].contiguous(),
                                  ids[mine].contiguous()), emap),
    }  # fmt: skip
    for name, us in _time_layer_steps(steps, rank, reps=20).items():
        out[f"us_{name}_eager"] = statistics.median(us)
    del rotations
    torch.cuda.empty_cache()
    return out


def _rank_main(rank: int, store: str, out_dir: str, Ms: list[int], cpu_smoke: bool, rounds: int) -> None:
    os.environ.update(NO_MULTICAST_ENV)
    from moe_eval.kernels.backends import BACKENDS
    from moe_eval.kernels.expert_parallel import DepKernel, TepKernel, shard_experts
    from moe_eval.kernels.moe_call import MoeBackend
    from moe_eval.kernels.testing import make_case, rel_err

    if cpu_smoke:
        from moe_eval.kernels.torch_moe import torch_moe as moe

        kernel = BACKENDS[MoeBackend.TORCH]
        device, backend, shape = torch.device("cpu"), "gloo", SMOKE_SHAPE
    else:
        from moe_eval.kernels.fused_moe import fused_moe as moe

        kernel = BACKENDS[MoeBackend.TRITON]

        torch.cuda.set_device(rank)
        device, backend, shape = torch.device("cuda", rank), "nccl", QWEN3_30B_A3B
    init = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=WORLD, **init)
    E, K, D, F = shape["E"], shape["K"], shape["D"], shape["F"]
    combines = ["all_reduce"] if cpu_smoke else ["reduce_scatter", "all_reduce"]  # gloo: no reduce_scatter
    rows = []
    for M in Ms:
        t0 = time.perf_counter()
        full = make_case(WORLD * M, E, K, D, F, dtype=torch.bfloat16, device=device, seed=M)
        ref = full.reference_fp32()
        w13, w2, emap = shard_experts(full.w13_eFD, full.w2_eDF, WORLD, rank)
        local = kernel.to_kernel_format(w13, w2)
        first = (full.topk_weights_TK[:M], full.topk_ids_TK[:M])
        tep = _step(TepKernel(kernel), full.hidden_TD[:M], local, first, emap)
        row = {"rank": rank, "M_per_rank": M, "rel_err_tep": rel_err(tep, ref[:M]),
               "nan_tep": bool(tep.isnan().any())}  # fmt: skip
        mine = slice(rank * M, (rank + 1) * M)
        for combine in combines:
            routing = (full.topk_weights_TK[mine].contiguous(), full.topk_ids_TK[mine].contiguous())
            dep = _step(DepKernel(kernel, combine=combine), full.hidden_TD[mine], local, routing, emap)
            sent = dep.float() if cpu_smoke else dep  # gloo: no bf16 all_gather
            gathered = [torch.empty_like(sent) for _ in range(WORLD)]
            dist.all_gather(gathered, sent)
            dep_all = torch.cat(gathered)
            row[f"rel_err_dep_{combine}"] = rel_err(dep_all, ref)
            row[f"nan_dep_{combine}"] = bool(dep_all.isnan().any())
        errs = [v for k, v in row.items() if k.startswith("rel_err")]
        row["ok"] = all(e < REL_TOL for e in errs) and not any(
            v for k, v in row.items() if k.startswith("nan")
        )
        if not cpu_smoke:
            row |= _timings(moe, kernel, full, w13, w2, emap, M, rank, rounds)
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(f"rank {rank} M/rank {M}: {'ok' if row['ok'] else 'FAIL'} "
              + " ".join(f"{k}={v:.3g}" for k, v in row.items() if k.startswith(("rel_err", "us_"))),
              file=sys.stderr, flush=True)  # fmt: skip
    gathered_rows = [None] * WORLD
    dist.all_gather_object(gathered_rows, rows)
    if rank == 0:
        meta = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "backend": backend, "shape": shape, "world": WORLD, "torch": torch.__version__,
            "devices": (
                [torch.cuda.get_device_name(i) for i in range(WORLD)] if not cpu_smoke else ["cpu"] * WORLD
            ),
            "env": {k: os.environ.get(k) for k in NO_MULTICAST_ENV},
            "command": "python " + " ".join(sys.argv),
        }  # fmt: skip
        if not cpu_smoke:
            import triton

            meta["triton"] = triton.__version__
        flat = [r for part in gathered_rows for r in part]
        doc = {"meta": meta, "rows": flat}
        tmp = Path(out_dir) / "ep.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(Path(out_dir) / "ep.json")
        (Path(out_dir) / "ep.md").write_text(markdown(flat) + "\n")
    dist.destroy_process_group()


def markdown(rows: list[dict]) -> str:
    errs = "| rank | M/rank | TEP rel err | DEP rel err (reduce-scatter) | DEP rel err (all-reduce) | ok |"
    lines = [errs, "|---:|---:|---:|---:|---:|:---:|"]
    for r in rows:
        rs = r.get("rel_err_dep_reduce_scatter")
        lines.append(f"| {r['rank']} | {r['M_per_rank']} | {r['rel_err_tep']:.2e} | "
                     f"{'' if rs is None else f'{rs:.2e}'} | {r['rel_err_dep_all_reduce']:.2e} | "
                     f"{'yes' if r['ok'] else 'NO'} |")  # fmt: skip
    if any("us_tep_local_alone" in r for r in rows):
        lines += ["", "| rank | M/rank | work | alone us | concurrent us | conc / alone |",
                  "|---:|---:|---|---:|---:|---:|"]  # fmt: skip
        for r in rows:
            for work in ("tep_local", "dep_local", "one_gpu"):
                a, c = r[f"us_{work}_alone"], r[f"us_{work}_concurrent"]
                lines.append(
                    f"| {r['rank']} | {r['M_per_rank']} | {work} | {a:.1f} | {c:.1f} | {c / a:.3f} |"
                )
        lines += ["", "| rank | M/rank | TEP layer step us (eager) | DEP layer step us (eager) |",
                  "|---:|---:|---:|---:|"]  # fmt: skip
        for r in rows:
            lines.append(f"| {r['rank']} | {r['M_per_rank']} | {r['us_tep_step_eager']:.1f} | "
                         f"{r['us_dep_step_eager']:.1f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True, help="writes ep.json and ep.md there")
    parser.add_argument("--m", nargs="*", type=int, default=None, help=f"tokens per rank (default {M_GRID})")
    parser.add_argument("--rounds", type=int, default=20, help="timing rounds (each: concurrent, then alone)")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="2 CPU ranks over gloo, small shape, no timing"
    )
    args = parser.parse_args(argv)
    os.environ.update(NO_MULTICAST_ENV)  # inherited by the spawned ranks as well
    if not args.cpu_smoke and torch.cuda.device_count() < WORLD:
        print(f"needs {WORLD} GPUs; this machine has {torch.cuda.device_count()} (--cpu-smoke runs on CPUs)",
              file=sys.stderr)  # fmt: skip
        return 2
    Ms = args.m or ([1, 3] if args.cpu_smoke else list(M_GRID))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    store = os.path.join(tempfile.mkdtemp(), "store")
    mp.spawn(
        _rank_main, args=(store, str(args.out_dir), Ms, args.cpu_smoke, args.rounds), nprocs=WORLD, join=True
    )
    doc = json.loads((args.out_dir / "ep.json").read_text())
    print(markdown(doc["rows"]))
    return 0 if all(r["ok"] for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
