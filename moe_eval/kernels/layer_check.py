"""The layer check: the MoE calls a server really makes, compared with the exact MoE of the same inputs.

Inside every vLLM process that runs a bundled kernel, `LayerCheck.observe` looks at the calls as the plugin
serves them: vLLM's hidden states, routing (top-k ids and weights) and expert map as handed to apply(), the
layer's weights as vLLM loaded them (before any conversion to the kernel's layout and before a `--mutate`
bug), and the output the served path returned (so a plugin, layout or routing bug counts like a kernel bug).
For a sampled call it takes R rows spread over the call (row_r = r (T-1) // (R-1); R = 4, or 16 from 64
tokens), computes each slot's exact contribution y (fp32, IEEE, routing weight included) and sums per
dispatch range (the call's token count M, plugin_protocol.LAYER_RANGE_EDGES) and per global expert:

- per range: sampled calls and rows, sum |served - exact|^2, sum |exact|^2, and sum |incumbent - exact|^2
  where "incumbent" is vLLM's fused_experts' arithmetic on the same rows, computed here: bf16 operands, fp32
  sums, h rounded to bf16, each slot's weighted output rounded to bf16, the K slots summed in fp32 and
  rounded once. vLLM's kernel itself cannot run here (inside a CUDA graph it would run at every replay; on
  the CPU its packed weights belong to its own method), so its rounding model stands in for it;
- per (range, expert): n slots and the sums of a = <served - exact, y>, b = <y, y>,
  vb = sum_d y_d^2 (served - exact)_d^2, a_inc = <incumbent - exact, y> and
  vd = sum_d y_d^2 (served - incumbent)_d^2. A kernel whose expert e is off by a factor (1 + s) leaves
  served - exact = s y_e + rounding, so sum a / sum b estimates s; a_inc gives the same estimate for the
  incumbent's arithmetic on the same slots (its rounding alone), and vd the variance of their difference
  that the rows' own residuals imply (moe_eval.gates.layer_gate: an expert fails when it is off beyond a
  bound, further off than the incumbent, and the difference is not noise).

Sampling: the first `burst` calls of each range, then every `period`-th (period 7 is prime to any layer
count a model has, so the sampled layer rotates). On a CUDA device the decision, the exact MoE and the sums
all run on the device (moe_eval.kernels._layer_check_kernels): a captured call is checked when its graph is
replayed, with no host work per call, and a call not sampled costs four near-empty launches. On the CPU
(eager servers) the same arithmetic runs in torch (`call_sums`, also the definition the GPU kernels are
tested against). A flusher thread (kernels/stats_file.py) writes <run dir>/layer-check/<pid>.json.

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k, R sampled rows,
NR dispatch ranges, V slots of this rank among the sampled ones.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F_nn

from moe_eval.core.plugin_protocol import LAYER_RANGE_EDGES, layer_range_index, layer_range_names
from moe_eval.kernels.stats_file import StatsFile

# Rows compared per sampled call: the first, the last and some between; more in large calls, which are few
# (a sweep makes a handful of >= 1024-token calls) and where one expert needs enough slots to be judged.
ROWS_SMALL_CALL, ROWS_LARGE_CALL, LARGE_CALL = 4, 16, 64
SAMPLE_BURST = 28  # every call of a range is sampled until it has seen this many (7 steps of a 4-layer model)
SAMPLE_PERIOD = 7  # then every 7th: prime to the layer count, so the sampled layer rotates
RANGE_FIELDS = ("calls", "rows", "sq_res", "sq_exact", "sq_ref", "nonfinite")
EXPERT_FIELDS = ("n", "a", "b", "vb", "a_inc", "vd")
NUM_RANGES = len(LAYER_RANGE_EDGES)


def rows_per_call(tokens: int) -> int:
    """R for a call of `tokens` tokens (a kernel constant: two variants, both compiled at warm-up)."""
    return ROWS_LARGE_CALL if tokens >= LARGE_CALL else ROWS_SMALL_CALL


def sample_rows(tokens: int) -> list[int]:
    """The rows a sampled call of `tokens` tokens compares: r (T-1) // (R-1), each row once."""
    if tokens <= 0:
        return []
    count = rows_per_call(tokens)
    rows = [r * (tokens - 1) // (count - 1) for r in range(count)]
    return list(dict.fromkeys(rows))


@dataclass
class CallSums:
    """One call's contribution: `range_sums` (RANGE_FIELDS, calls = 1) and per global expert the
    EXPERT_FIELDS (fp64 on the host)."""

    range_sums: list[float]
    expert_sums: dict[int, list[float]]


def call_sums(
    hidden_TD: torch.Tensor,
    out_TD: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    expert_map_E: torch.Tensor | None,
    w13_eFD: torch.Tensor,
    w2_eDF: torch.Tensor,
    apply_router_weight_on_input: bool,
) -> CallSums:
    """The layer check's arithmetic for one call, in torch (the CPU path and the GPU kernels' definition)."""
    T = hidden_TD.shape[0]
    rows = sample_rows(T)
    F = w2_eDF.shape[2]
    index_R = torch.tensor(rows, dtype=torch.long, device=hidden_TD.device)
    x_RD = hidden_TD[index_R].float()
    ids_RK = topk_ids_TK[index_R].long()
    weights_RK = topk_weights_TK[index_R].float()
    local_RK = expert_map_E.long()[ids_RK] if expert_map_E is not None else ids_RK
    R, K = ids_RK.shape
    D = x_RD.shape[1]
    y_RKD = torch.zeros(R, K, D, dtype=torch.float32, device=x_RD.device)
    q_RKD = torch.zeros_like(y_RKD)
    for r in range(R):
        for k in range(K):
            local = int(local_RK[r, k])
            if local < 0:  # another rank's expert: its contribution is served there
                continue
            x_D = x_RD[r] * weights_RK[r, k] if apply_router_weight_on_input else x_RD[r]
            gate_up_2F = w13_eFD[local].float() @ x_D
            h_F = F_nn.silu(gate_up_2F[:F]) * gate_up_2F[F:]
            w2_DF = w2_eDF[local].float()
            y_D = w2_DF @ h_F
            q_D = w2_DF @ h_F.to(hidden_TD.dtype).float()  # the incumbent's rounded GEMM2 input
            if not apply_router_weight_on_input:
                y_D, q_D = y_D * weights_RK[r, k], q_D * weights_RK[r, k]
            y_RKD[r, k], q_RKD[r, k] = y_D, q_D.to(hidden_TD.dtype).float()  # each slot's output rounded
    exact_RD = y_RKD.sum(1)
    ref_RD = q_RKD.sum(1).to(hidden_TD.dtype).float()
    served_RD = out_TD[index_R].float()
    # Elements whose exact value is not finite come from rows of garbage input (a CUDA graph's padding rows
    # can hold NaN hidden states): left out. A served value that is not finite where the exact one is, is a
    # kernel bug: counted ("nonfinite"), and the range fails on it.
    exact_ok = torch.isfinite(exact_RD)
    served_ok = torch.isfinite(served_RD)
    keep = exact_ok & served_ok
    zero = torch.zeros((), dtype=torch.float32)
    res_RD = torch.where(keep, served_RD - exact_RD, zero)
    inc_RD = torch.where(exact_ok, ref_RD - exact_RD, zero)
    diff_RD = torch.where(keep, served_RD - ref_RD, zero)
    exact_RD = torch.where(exact_ok, exact_RD, zero)
    y_RKD = torch.where(exact_ok[:, None, :], y_RKD, zero).double()
    a_RK = (y_RKD * res_RD.double()[:, None, :]).sum(-1)
    b_RK = (y_RKD * y_RKD).sum(-1)
    vb_RK = (y_RKD**2 * res_RD.double()[:, None, :] ** 2).sum(-1)
    a_inc_RK = (y_RKD * inc_RD.double()[:, None, :]).sum(-1)
    vd_RK = (y_RKD**2 * diff_RD.double()[:, None, :] ** 2).sum(-1)
    range_sums = [
        1.0,
        float(R),
        float(res_RD.double().pow(2).sum()),
        float(exact_RD.double().pow(2).sum()),
        float(inc_RD.double().pow(2).sum()),
        float((exact_ok & ~served_ok).sum()),
    ]
    expert_sums: dict[int, list[float]] = {}
    for r in range(R):
        for k in range(K):
            if int(local_RK[r, k]) < 0:
                continue
            cell = expert_sums.setdefault(int(ids_RK[r, k]), [0.0] * len(EXPERT_FIELDS))
            values = (a_RK[r, k], b_RK[r, k], vb_RK[r, k], a_inc_RK[r, k], vd_RK[r, k])
            for i, value in enumerate((1.0, *map(float, values))):
                cell[i] += value
    return CallSums(range_sums, expert_sums)


class LayerCheck:
    """One per process (vLLM runs one per rank), shared by every MoE layer of the model."""

    def __init__(
        self,
        backend: str,
        num_experts: int,
        path: Path | None,
        rank: dict[str, Any],
        max_tokens: int,
        period: int = SAMPLE_PERIOD,
        burst: int = SAMPLE_BURST,
    ) -> None:
        self.backend = backend
        self.num_experts = num_experts
        self.rank = rank
        self.max_tokens = max_tokens
        self.period = period
        self.burst = burst
        self.device = None  # set by attach_device (CUDA); None: the torch path on the host
        self.seen = [0] * NUM_RANGES
        self.range_sums = [[0.0] * len(RANGE_FIELDS) for _ in range(NUM_RANGES)]
        self.expert_sums = [
            [[0.0] * len(EXPERT_FIELDS) for _ in range(num_experts)] for _ in range(NUM_RANGES)
        ]
        self._lock = threading.Lock()
        self.file = StatsFile(path, self.snapshot, "moe-eval-layer-check")
        self._scratch: dict[tuple, tuple[torch.Tensor, ...]] = {}

    # --- observing (hot path) ---

    def observe(
        self,
        hidden_TD: torch.Tensor,
        out_TD: torch.Tensor,
        topk_weights_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        expert_map_E: torch.Tensor | None,
        w13_eFD: torch.Tensor,
        w2_eDF: torch.Tensor,
        apply_router_weight_on_input: bool,
    ) -> None:
        T = hidden_TD.shape[0]
        if T == 0:
            return
        range_index = layer_range_index(T)
        if self.device is not None:
            self._observe_on_device(
                range_index,
                hidden_TD,
                out_TD,
                topk_weights_TK,
                topk_ids_TK,
                expert_map_E,
                w13_eFD,
                w2_eDF,
                apply_router_weight_on_input,
            )
        else:
            seen = self.seen[range_index]
            self.seen[range_index] = seen + 1
            if seen < self.burst or seen % self.period == 0:
                sums = call_sums(
                    hidden_TD,
                    out_TD,
                    topk_weights_TK,
                    topk_ids_TK,
                    expert_map_E,
                    w13_eFD,
                    w2_eDF,
                    apply_router_weight_on_input,
                )
                with self._lock:
                    self._add(range_index, sums)
        self.file.start()

    def _add(self, range_index: int, sums: CallSums) -> None:
        for i, value in enumerate(sums.range_sums):
            self.range_sums[range_index][i] += value
        for expert, cell in sums.expert_sums.items():
            for i, value in enumerate(cell):
                self.expert_sums[range_index][expert][i] += value

    # --- the CUDA path ---

    def attach_device(self, device: torch.device, pin: bool = True) -> None:
        """Device tables and the host mirror the kernels write; before vLLM's warm-up and graph capture.
        pin=False: a plain host tensor for the mirror (Triton's interpreter on a machine without CUDA)."""
        self.device = device
        self.d_seen = torch.zeros(NUM_RANGES, dtype=torch.int64, device=device)
        self.d_flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.d_range = torch.zeros(NUM_RANGES, len(RANGE_FIELDS), dtype=torch.float64, device=device)
        self.d_expert = torch.zeros(
            NUM_RANGES, self.num_experts, len(EXPERT_FIELDS), dtype=torch.float64, device=device
        )
        size = self.d_range.numel() + self.d_expert.numel() + NUM_RANGES
        self.mirror = torch.zeros(size, dtype=torch.float64)
        if pin:
            self.mirror = self.mirror.pin_memory()  # the device writes it directly; the flusher only reads

    def prepare(
        self, w13_eFD: torch.Tensor, w2_eDF: torch.Tensor, top_k: int, expert_map_E: Any, on_input: bool
    ) -> None:
        """Scratch for one layer shape and the kernels compiled for it (a sampled call on random inputs,
        then the tables zeroed): nothing compiles while the server serves."""
        if self.device is None:
            return
        D, F = w2_eDF.shape[1], w2_eDF.shape[2]
        self._buffers(F, D, top_k)
        for T in (3, LARGE_CALL):  # both row counts
            hidden = torch.randn(T, D, device=self.device).to(w13_eFD.dtype)
            ids = torch.randint(0, self.num_experts, (T, top_k), device=self.device, dtype=torch.int32)
            weights = torch.rand(T, top_k, device=self.device, dtype=torch.float32)
            out = torch.zeros(T, D, device=self.device, dtype=w13_eFD.dtype)
            self._observe_on_device(0, hidden, out, weights, ids, expert_map_E, w13_eFD, w2_eDF, on_input)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for table in (self.d_seen, self.d_flag, self.d_range, self.d_expert):
            table.zero_()
        self.mirror.zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _buffers(self, F: int, D: int, K: int) -> tuple[torch.Tensor, ...]:
        key = (F, D, K)
        if key not in self._scratch:
            R = ROWS_LARGE_CALL
            self._scratch[key] = (
                torch.zeros(R * K * F, dtype=torch.float32, device=self.device),
                torch.zeros(R * K * D, dtype=torch.float32, device=self.device),
                torch.zeros(R * K * D, dtype=torch.float32, device=self.device),
            )
        return self._scratch[key]

    def _observe_on_device(
        self,
        range_index: int,
        hidden_TD: torch.Tensor,
        out_TD: torch.Tensor,
        topk_weights_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        expert_map_E: torch.Tensor | None,
        w13_eFD: torch.Tensor,
        w2_eDF: torch.Tensor,
        on_input: bool,
    ) -> None:
        import triton

        from moe_eval.kernels._layer_check_kernels import (
            _exact_h_kernel,
            _exact_y_kernel,
            _stats_kernel,
            _tick_kernel,
        )

        T, D = hidden_TD.shape
        K = topk_ids_TK.shape[1]
        F = w2_eDF.shape[2]
        R = rows_per_call(T)
        assert hidden_TD.is_contiguous() and out_TD.is_contiguous(), "hidden and output must be contiguous"
        assert w13_eFD.stride(2) == 1 and w2_eDF.stride(2) == 1, "weights must be row-major in their last dim"
        # No-ops when vLLM already hands int32 ids and fp32 weights (it does): one kernel variant each.
        ids = topk_ids_TK.to(torch.int32).contiguous()
        weights = topk_weights_TK.to(torch.float32).contiguous()
        emap = expert_map_E.to(torch.int32) if expert_map_E is not None else self.d_flag
        h, y, q = self._buffers(F, D, K)
        _tick_kernel[(1,)](self.d_seen, self.d_flag, range_index, self.period, self.burst, num_warps=1)
        block_f, block_d = 32, 128
        _exact_h_kernel[(R * K, triton.cdiv(F, block_f))](
            self.d_flag,
            hidden_TD,
            ids,
            weights,
            emap,
            w13_eFD,
            h,
            T,
            D,
            F,
            w13_eFD.stride(0),
            w13_eFD.stride(1),
            K=K,
            R=R,
            HAS_MAP=expert_map_E is not None,
            WEIGHT_ON_INPUT=on_input,
            BLOCK_F=block_f,
            BLOCK_D=block_d,
            num_warps=4,
        )
        _exact_y_kernel[(R * K, triton.cdiv(D, 64))](
            self.d_flag,
            ids,
            weights,
            emap,
            w2_eDF,
            h,
            y,
            q,
            T,
            D,
            F,
            w2_eDF.stride(0),
            w2_eDF.stride(1),
            K=K,
            R=R,
            HAS_MAP=expert_map_E is not None,
            WEIGHT_ON_INPUT=on_input,
            BLOCK_F=64,
            BLOCK_D=64,
            num_warps=4,
        )
        _stats_kernel[(1,)](
            self.d_flag,
            out_TD,
            ids,
            emap,
            y,
            q,
            self.d_range,
            self.d_expert,
            self.d_seen,
            self.mirror,
            T,
            D,
            self.num_experts,
            range_index,
            K=K,
            R=R,
            NR=NUM_RANGES,
            HAS_MAP=expert_map_E is not None,
            BLOCK_D=128,
            BLOCK_K=triton.next_power_of_2(K),
            BLOCK_COPY=1024,
            num_warps=4,
        )

    # --- reading ---

    def snapshot(self) -> dict[str, Any]:
        if self.device is not None:
            values = self.mirror.tolist()  # plain host memory the device wrote: no CUDA call
            n_range = NUM_RANGES * len(RANGE_FIELDS)
            n_expert = NUM_RANGES * self.num_experts * len(EXPERT_FIELDS)
            width_r, width_e = len(RANGE_FIELDS), len(EXPERT_FIELDS)
            range_sums = [values[i * width_r : (i + 1) * width_r] for i in range(NUM_RANGES)]
            flat = values[n_range : n_range + n_expert]
            expert_sums = [
                [
                    flat[(i * self.num_experts + e) * width_e : (i * self.num_experts + e + 1) * width_e]
                    for e in range(self.num_experts)
                ]
                for i in range(NUM_RANGES)
            ]
            seen = [int(v) for v in values[n_range + n_expert :]]
            counted_on = "device"
        else:
            with self._lock:
                range_sums = [list(row) for row in self.range_sums]
                expert_sums = [[list(cell) for cell in row] for row in self.expert_sums]
                seen = list(self.seen)
            counted_on = "host"
        return {
            "backend": self.backend,
            "pid": os.getpid(),
            "rank": self.rank,
            "max_tokens": self.max_tokens,
            "rows_per_call": [ROWS_SMALL_CALL, ROWS_LARGE_CALL, LARGE_CALL],
            "burst": self.burst,
            "period": self.period,
            "counted_on": counted_on,
            "ranges": list(layer_range_names()),
            "range_fields": list(RANGE_FIELDS),
            "expert_fields": list(EXPERT_FIELDS),
            "seen": seen,
            "range_sums": range_sums,
            # Only the experts this rank sampled (n > 0): the file stays small at 128 experts.
            "expert_sums": [
                {str(e): cell for e, cell in enumerate(row) if cell[0] > 0} for row in expert_sums
            ],
        }

    def flush(self) -> None:
        self.file.flush()
