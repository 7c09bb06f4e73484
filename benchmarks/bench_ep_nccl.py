"""Two-GPU expert parallelism (TEP and DEP) around the bundled Triton kernel, over NCCL.

For `nvidia-h200-x2` (or any 2-GPU host): one process per GPU, the Qwen3-30B-A3B layer
(E=128, K=8, D=2048, F=768) split 64 + 64 experts, M tokens per rank in {1, 64, 4096}.
Checks each combine against the single-rank reference of the full layer (bf16 relative error
< 1e-2, no NaN), then times each rank's kernel on its local work (CUDA graph, rotated inputs,
median) against the same local work on one GPU. Prints a table; writes JSON with --out.

    NCCL_NVLS_ENABLE=0 python benchmarks/bench_ep_nccl.py --out ep-nccl.json

NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the lent multi-GPU machines require.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

E, K, D, F = 128, 8, 2048, 768
M_GRID = (1, 64, 4096)
WORLD = 2
REL_TOL = 1e-2


def _time_graph(fn, inputs, reps: int = 50) -> float:
    """Median microseconds of one call, replayed from a CUDA graph over rotated input sets."""
    for args in inputs:  # warm-up (Triton compile, autotune lookups) outside the graph
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in inputs:
            fn(*args)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(inputs))
    return statistics.median(times)


def _rank(rank: int, store: str, out: str | None) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    from moe_eval.kernels.expert_parallel import dep_moe, shard_experts, tep_moe
    from moe_eval.kernels.fused_moe import fused_moe
    from moe_eval.kernels.testing import make_case, rel_err

    rows = []
    for M in M_GRID:
        full = make_case(M * WORLD, E, K, D, F, dtype=torch.bfloat16, device="cuda", seed=M)
        ref = full.reference_fp32()
        w13, w2, emap = shard_experts(full.w13_eFD, full.w2_eDF, WORLD, rank)
        tep = tep_moe(fused_moe, full.hidden_TD, w13, w2, full.topk_weights_TK, full.topk_ids_TK, emap)
        mine = slice(rank * M, (rank + 1) * M)
        dep = dep_moe(fused_moe, full.hidden_TD[mine], w13, w2, full.topk_weights_TK[mine].contiguous(),
                      full.topk_ids_TK[mine].contiguous(), emap)
        dep_all = [torch.empty_like(dep) for _ in range(WORLD)]
        dist.all_gather(dep_all, dep)
        err_tep, err_dep = rel_err(tep, ref), rel_err(torch.cat(dep_all), ref)
        # Per-rank kernel time on its local work (all M*W tokens, its 64 experts) vs one GPU, all 128.
        rotations = [make_case(M * WORLD, E, K, D, F, dtype=torch.bfloat16, device="cuda", seed=100 + i,
                               weights_from=full) for i in range(4)]
        local = [(c.hidden_TD, w13, w2, c.topk_weights_TK, c.topk_ids_TK) for c in rotations]
        us_local = _time_graph(lambda *a, m=emap: fused_moe(*a, expert_map_E=m), local)
        single = [(c.hidden_TD, c.w13_eFD, c.w2_eDF, c.topk_weights_TK, c.topk_ids_TK) for c in rotations]
        us_single = _time_graph(lambda *a: fused_moe(*a), single)
        ok = err_tep < REL_TOL and err_dep < REL_TOL and not tep.isnan().any() and not dep.isnan().any()
        rows.append({"rank": rank, "M_per_rank": M, "rel_err_tep": err_tep, "rel_err_dep": err_dep, "ok": ok,
                     "us_rank_local_experts": us_local, "us_one_gpu_all_experts": us_single})
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        flat = [r for part in gathered for r in part]
        for r in flat:
            print(f"rank {r['rank']} M/rank {r['M_per_rank']:5d}  err TEP {r['rel_err_tep']:.2e}  "
                  f"DEP {r['rel_err_dep']:.2e}  {'OK' if r['ok'] else 'FAIL'}  kernel {r['us_rank_local_experts']:.1f} us "
                  f"(one GPU, all experts: {r['us_one_gpu_all_experts']:.1f} us)")
        if out:
            with open(out, "w") as fh:
                json.dump({"gpus": [torch.cuda.get_device_name(i) for i in range(WORLD)],
                           "torch": torch.__version__, "rows": flat}, fh, indent=2)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--store", default=None, help="rendezvous file (default: a fresh temporary file)")
    args = parser.parse_args()
    if torch.cuda.device_count() < WORLD:
        raise SystemExit(f"needs {WORLD} GPUs; this machine has {torch.cuda.device_count()}")
    import tempfile

    store = args.store or os.path.join(tempfile.mkdtemp(), "store")
    mp.spawn(_rank, args=(store, args.out), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
