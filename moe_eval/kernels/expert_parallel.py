"""Expert parallelism around the bundled kernels: which experts a rank holds, and the TEP and DEP
combines, written with torch.distributed so they run over gloo (CPU, in CI) and NCCL (GPUs).

- Placement follows vLLM's linear expert placement: E experts over W ranks, each rank a contiguous
  block, the first E % W ranks one expert more (so E need not divide evenly).
- TEP: every rank sees the same tokens and computes only its experts (expert map, -1 elsewhere);
  the partial outputs are summed across ranks (all-reduce).
- DEP: every rank has its own tokens. Tokens and routing are all-gathered, each rank computes its
  experts for all tokens, and the partial outputs are summed and scattered back, each rank keeping
  its own rows (vLLM's naive dispatch/combine: all-gather, then reduce-scatter; over gloo, which
  has no reduce-scatter, an all-reduce of which each rank keeps its rows).

TEP and DEP are wrappers around any kernel (moe_eval.kernels.moe_call.MoeKernel). Usage, in each rank's
process after init_process_group:

    w13_eFD, w2_eDF, expert_map_E = shard_experts(w13_EFD, w2_EDF, world, rank)
    kernel = BACKENDS[MoeBackend.TORCH]
    weights = kernel.to_kernel_format(w13_eFD, w2_eDF)
    out_TD = TepKernel(kernel).apply(MoeCall(hidden_TD, weights, Routing(weights_TK, ids_TK), expert_map_E))

T tokens, D hidden, F intermediate, E experts (global), e local experts, K top-k, W ranks.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from moe_eval.kernels.moe_call import MoeCall, MoeKernel, Routing, WrappedKernel


def local_experts(num_experts: int, world: int, rank: int) -> range:
    """Global ids held by `rank`: vLLM's linear placement, remainder on the first ranks."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    if num_experts < world:
        raise ValueError(f"{num_experts} experts cannot be split over {world} ranks: a rank would hold none")
    base, extra = divmod(num_experts, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def expert_map(num_experts: int, world: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 [E]: global id -> local slot on `rank`, -1 for experts held elsewhere."""
    held = local_experts(num_experts, world, rank)
    map_E = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
    map_E[held.start : held.stop] = torch.arange(len(held), dtype=torch.int32, device=device)
    return map_E


def shard_experts(
    w13_EFD: torch.Tensor, w2_EDF: torch.Tensor, world: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    held = local_experts(w13_EFD.shape[0], world, rank)
    return (
        w13_EFD[held.start : held.stop].contiguous(),
        w2_EDF[held.start : held.stop].contiguous(),
        expert_map(w13_EFD.shape[0], world, rank, w13_EFD.device),
    )


def _sum_across_ranks(partial_TD: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    # Summed in fp32: gloo has no bf16 all-reduce, and it keeps the combine out of the error budget.
    total = partial_TD.float()
    dist.all_reduce(total, group=group)
    return total


class TepKernel(WrappedKernel):
    """Same tokens on every rank; each computes its experts (the call's expert map); partial outputs
    summed."""

    def __init__(self, inner: MoeKernel, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(inner, "tep")
        self.group = group

    def apply(self, call: MoeCall) -> torch.Tensor:
        if call.expert_map_E is None:
            raise ValueError("TEP needs the call's expert map (shard_experts gives it)")
        partial_TD = self.inner.apply(call)
        return _sum_across_ranks(partial_TD, self.group).to(call.hidden_TD.dtype)


def _all_gather_rows(rows: torch.Tensor, counts: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's rows (counts[r] of them), padding to the largest count for the collective."""
    most = max(counts)
    padded = torch.zeros((most, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    padded[: rows.shape[0]] = rows
    gathered = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([g[:n] for g, n in zip(gathered, counts)])


class DepKernel(WrappedKernel):
    """Own tokens per rank: all-gather tokens and routing, local experts over all, reduce-scatter back.

    combine: "reduce_scatter" or "all_reduce" (then keep own rows); default: all_reduce on gloo,
    which has no reduce-scatter, reduce_scatter elsewhere.
    """

    def __init__(
        self, inner: MoeKernel, group: dist.ProcessGroup | None = None, combine: str | None = None
    ) -> None:
        if combine not in (None, "all_reduce", "reduce_scatter"):
            raise ValueError(f"combine must be 'all_reduce' or 'reduce_scatter', got {combine!r}")
        super().__init__(inner, "dep")
        self.group, self.combine = group, combine

    def apply(self, call: MoeCall) -> torch.Tensor:
        if call.expert_map_E is None:
            raise ValueError("DEP needs the call's expert map (shard_experts gives it)")
        group, hidden_TD = self.group, call.hidden_TD
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        count = torch.tensor([hidden_TD.shape[0]], dtype=torch.int64, device=hidden_TD.device)
        counts_t = [torch.empty_like(count) for _ in range(world)]
        dist.all_gather(counts_t, count, group=group)
        counts = [int(c.item()) for c in counts_t]
        # Gathered as fp32 (exact for bf16 and fp16, back to the same values after): gloo's all_gather
        # takes neither bf16 nor int16. Twice the bytes on the wire; NCCL could move bf16 directly.
        hidden_all = _all_gather_rows(hidden_TD.float(), counts, group).to(hidden_TD.dtype)
        weights_all = _all_gather_rows(call.routing.weights_TK.float(), counts, group).contiguous()
        ids_all = _all_gather_rows(call.routing.ids_TK, counts, group).contiguous()
        partial_all = self.inner.apply(
            replace(call, hidden_TD=hidden_all, routing=Routing(weights_all, ids_all))
        )
        start = sum(counts[:rank])
        combine = self.combine or ("all_reduce" if dist.get_backend(group) == "gloo" else "reduce_scatter")
        if combine == "all_reduce":  # the same sum; each rank keeps its own rows
            total = _sum_across_ranks(partial_all, group)
            return total[start : start + counts[rank]].to(hidden_TD.dtype)
        return _reduce_scatter_rows(partial_all, counts, group)[: counts[rank]].to(hidden_TD.dtype)


def _reduce_scatter_rows(
    rows: torch.Tensor, counts: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Sum over ranks and hand rank r its counts[r] rows (the first rows of the result).

    Each rank's block is padded to the largest count, as the collective wants equal blocks; summed in
    fp32 like the all-reduce path, so the two combines give the same numbers.
    """
    most = max(counts)
    padded = torch.zeros((len(counts) * most, *rows.shape[1:]), dtype=torch.float32, device=rows.device)
    start = 0
    for r, n in enumerate(counts):
        padded[r * most : r * most + n] = rows[start : start + n]
        start += n
    mine = torch.empty((most, *rows.shape[1:]), dtype=torch.float32, device=rows.device)
    dist.reduce_scatter_tensor(mine, padded, group=group)
    return mine
