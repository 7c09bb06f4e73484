"""Expert parallelism over 2 ranks (gloo, one process per rank): TEP and DEP around the bundled
torch kernel and the Triton kernel (interpreter), against the single-rank reference of the full layer.

Tolerances (relative error ||out - ref|| / ||ref||, reference fp32 on the same rounded inputs):
  torch backend, bf16: 1e-2. bf16 rounding of the intermediate h and of the output (~2^-8 each,
      relative) dominates; the fp32 combine adds nothing. Measured ~3e-3 on these shapes.
  Triton backend, fp32 under the interpreter: 1e-5. fp32 products and sums, only the order differs.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from moe_eval.kernels.expert_parallel import expert_map, local_experts
from moe_eval.kernels.testing import make_case, rel_err

TOLERANCE = {"torch": 1e-2, "triton": 1e-5}
DTYPE = {"torch": torch.bfloat16, "triton": torch.float32}  # interpreter: no bf16 tl.dot (see conftest)
WORLD = 2
CASES = [  # (name, E, K, D, F, tokens per rank, why)
    ("even", 8, 2, 32, 16, (6, 6), "E divides over the ranks: 4 experts each"),
    (
        "uneven",
        7,
        2,
        24,
        12,
        (5, 3),
        "E = 7: ranks hold 4 and 3 (vLLM's linear placement); DEP ranks hold 5 and 3 tokens",
    ),
    ("one-token-k1", 6, 1, 16, 8, (1, 0), "K = 1 with an empty rank in DEP"),
    ("fewer-tokens-first", 8, 2, 16, 8, (2, 5), "DEP rank 0 holds fewer tokens: its block is padded"),
]


def test_linear_placement_like_vllm():
    assert [list(local_experts(7, 2, r)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6]]
    assert [len(local_experts(128, 2, r)) for r in range(2)] == [64, 64]
    assert expert_map(7, 2, 1).tolist() == [-1, -1, -1, -1, 0, 1, 2]
    with pytest.raises(ValueError, match="cannot be split over 4 ranks"):
        local_experts(3, 4, 0)


def _reduce_scatter_over_all_reduce(out, inp, group=None):
    """gloo has no reduce_scatter_tensor: the same result from an all-reduce, to test the padding."""
    import torch.distributed as dist

    total = inp.clone()
    dist.all_reduce(total, group=group)
    n = out.shape[0]
    out.copy_(total[dist.get_rank(group) * n : (dist.get_rank(group) + 1) * n])


def _rank_main(rank: int, backend: str, store: str, out_dir: str, combine: str | None = None) -> None:
    if backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported in this fresh process
    import torch.distributed as dist

    from moe_eval.kernels.backends import BACKENDS
    from moe_eval.kernels.expert_parallel import DepKernel, TepKernel, shard_experts
    from moe_eval.kernels.moe_call import MoeBackend, MoeCall, Routing

    kernel = BACKENDS[MoeBackend(backend)]
    if combine == "reduce_scatter":
        dist.reduce_scatter_tensor = _reduce_scatter_over_all_reduce  # this process only
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    results = {}
    for name, E, K, D, F, per_rank, _ in CASES:
        full = make_case(sum(per_rank), E, K, D, F, dtype=DTYPE[backend], device="cpu", seed=11)
        w13, w2, emap = shard_experts(full.w13_eFD, full.w2_eDF, WORLD, rank)
        weights = kernel.to_kernel_format(w13, w2)
        routing = Routing(full.topk_weights_TK, full.topk_ids_TK)
        tep = TepKernel(kernel).apply(MoeCall(full.hidden_TD, weights, routing, emap))
        start = sum(per_rank[:rank])
        rows = slice(start, start + per_rank[rank])
        mine = Routing(full.topk_weights_TK[rows].contiguous(), full.topk_ids_TK[rows].contiguous())
        dep = DepKernel(kernel, combine=combine).apply(MoeCall(full.hidden_TD[rows], weights, mine, emap))
        results[name] = {"tep": tep, "dep": dep, "rows": (rows.start, rows.stop)}
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(results))


@pytest.mark.slow  # multi-rank (two gloo processes): the slow tier, with the plugin's other multi-rank tests
@pytest.mark.parametrize(
    ("backend", "combine"),
    [("torch", None), ("triton", None), ("torch", "reduce_scatter")],
    ids=["torch", "triton", "torch-reduce-scatter"],
)
def test_tep_and_dep_match_the_single_rank_reference(backend, combine, tmp_path):
    """combine None: gloo's default (all-reduce, keep own rows). reduce_scatter: NCCL's default
    path, with its padding to equal blocks, over an emulated collective."""
    store = str(tmp_path / "store")
    mp.spawn(_rank_main, args=(backend, store, str(tmp_path), combine), nprocs=WORLD, join=True)
    per_rank = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]
    for name, E, K, D, F, tokens, why in CASES:
        full = make_case(sum(tokens), E, K, D, F, dtype=DTYPE[backend], device="cpu", seed=11)
        ref = full.reference_fp32()
        for rank in range(WORLD):
            tep = per_rank[rank][name]["tep"]
            assert not tep.isnan().any() and rel_err(tep, ref) < TOLERANCE[backend], (name, "TEP", rank, why)
        dep = torch.cat([per_rank[r][name]["dep"] for r in range(WORLD)])
        assert dep.shape == ref.shape, (name, why)
        assert not dep.isnan().any() and rel_err(dep, ref) < TOLERANCE[backend], (name, "DEP", why)


BENCH_EP = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_ep_nccl.py"


def _run_bench_ep(out_dir: Path, *args: str) -> dict:
    import json
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(BENCH_EP.parents[1])}
    env.pop("TRITON_INTERPRET", None)  # the script's ranks pick their kernel themselves
    command = [sys.executable, str(BENCH_EP), "--out-dir", str(out_dir), *args]
    proc = subprocess.run(command, env=env, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out_dir / "ep.json").read_text())


@pytest.mark.slow  # two gloo ranks, as above
def test_ep_benchmark_script_runs_on_cpus(tmp_path):
    """The NCCL benchmark's own code path (placement, both combines' bookkeeping, report) on 2 gloo
    ranks, so the GPU-only script cannot rot between lent 2-GPU machines."""
    doc = _run_bench_ep(tmp_path, "--cpu-smoke")
    assert doc["meta"]["backend"] == "gloo" and doc["meta"]["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert sorted((r["rank"], r["M_per_rank"]) for r in doc["rows"]) == [(0, 1), (0, 3), (1, 1), (1, 3)]
    assert all(
        r["ok"] and r["rel_err_tep"] < 1e-2 and r["rel_err_dep_all_reduce"] < 1e-2 for r in doc["rows"]
    )
    assert (tmp_path / "ep.md").read_text().startswith("| rank | M/rank | TEP rel err")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
def test_tep_and_dep_over_nccl_on_two_gpus(tmp_path):
    """Qwen3-30B-A3B's layer over 2 GPUs with the Triton kernel, both DEP combines
    (docs/expert-parallel.md)."""
    doc = _run_bench_ep(tmp_path, "--m", "1", "64", "--rounds", "2")
    assert doc["meta"]["backend"] == "nccl"
    for row in doc["rows"]:
        assert row["ok"], row
        assert row["rel_err_dep_reduce_scatter"] < 1e-2 and row["rel_err_dep_all_reduce"] < 1e-2
