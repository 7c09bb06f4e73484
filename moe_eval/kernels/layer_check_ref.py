"""The layer check's arithmetic in torch: the definition the device kernels (_layer_check_kernels.py) are
tested against, and the path eager CPU servers run.

For each compared row of an MoE call and each of its K slots (the row's top-k experts on this rank):

1. the slot's exact contribution y (fp32 products and sums, IEEE; routing weight included), the incumbent's
   rounding of it q (vLLM's fused_experts: h rounded to bf16, the slot's weighted output rounded to bf16),
   and the SiLU slope direction v: the change of y when the SiLU's slope moves, d/ds of
   W2 (g sigmoid(s g) u) at s = 1, which is W2 (g^2 sigmoid(g) (1 - sigmoid(g)) u);
2. the row's exact output sum_k y_k, the incumbent's bf16(sum_k q_k), the served output, and their
   differences res = served - exact, inc = incumbent - exact, diff = served - incumbent;
3. the row's joint least squares res ~ sum_k s_k y_k + eps V (V = sum_k v_k): each slot's direction
   y~_k = y_k made orthogonal to the row's other slot outputs (Frisch-Waugh-Lovell: the row of G^-1 Y
   scaled by 1 / (G^-1)_kk, G = Y Y^T), and V~ = V made orthogonal to every y_k. A scale error s in one
   expert then reads s in that expert's slot and nothing in another's, however correlated their outputs
   are (projecting on y_k alone read a +0.5 % error of expert 6 as +5.3 % in expert 5, CPU canary);
4. per slot the sums core/layer_cells.CELL_FIELDS names (with y~), per row ROW_FIELDS (with V~).

Elements whose exact value is not finite come from rows of garbage input (a CUDA graph's padding rows can
hold NaN hidden states): left out. A served value that is not finite where the exact one is, is a kernel
bug: counted ("nonfinite").

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k, R compared rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F_nn

from moe_eval.kernels.moe_call import MoeCall

ROW_STRIDE = 7919  # needy rows are searched from a start that moves by this prime each call


@dataclass
class RowSums:
    """R compared rows: per slot (R, K) its global expert, whether it counts here, and the six slot sums
    CELL_FIELDS[1:] (fp64); per row ROW_FIELDS[1:] (fp64: rows = 1 each)."""

    experts_RK: torch.Tensor
    valid_RK: torch.Tensor
    slot_RK6: torch.Tensor
    row_R11: torch.Tensor


def spread_rows(tokens: int, count: int) -> list[int]:
    """`count` rows spread over a call of `tokens` tokens: the first, the last and evenly between."""
    if count <= 1:
        return [0][:count]
    return [r * (tokens - 1) // (count - 1) for r in range(count)]


def pick_rows(tokens: int, seen: int, needy_T: torch.Tensor, cap: int, burst: int, period: int) -> list[int]:
    """The rows a call compares (the device's _pick_rows_kernel follows this).

    A background call (the layer's first `burst` calls of the range, then every `period`-th) compares
    min(T, cap) rows spread over it, so every part of a call is looked at. Any other call compares its
    needy rows, those with a slot of an expert whose cell (layer, range, expert) has fewer slots than the
    target, up to `cap`, searched from a start that moves each call: evidence goes where it is missing, and
    stops costing once every cell holds its slots.
    """
    count = min(tokens, cap)
    if seen < burst or seen % period == 0:
        return spread_rows(tokens, count)
    start = (seen * ROW_STRIDE) % tokens
    order = [(start + i) % tokens for i in range(tokens)]
    needy = needy_T.tolist()
    return [t for t in order if needy[t]][:count]


def slot_vectors(
    hidden_TD: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    expert_map_E: torch.Tensor | None,
    w13_eFD: torch.Tensor,
    w2_eDF: torch.Tensor,
    apply_router_weight_on_input: bool,
    rows: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """y, q, v (R, K, D) fp32 for the compared rows, each slot's global expert (R, K) and whether this rank
    holds it (another rank's expert contributes nothing here: its vectors are 0)."""
    index_R = torch.tensor(rows, dtype=torch.long, device=hidden_TD.device)
    x_RD = hidden_TD[index_R].float()
    ids_RK = topk_ids_TK[index_R].long()
    weights_RK = topk_weights_TK[index_R].float()
    local_RK = expert_map_E.long()[ids_RK] if expert_map_E is not None else ids_RK
    held_RK = local_RK >= 0
    slot_local = torch.where(held_RK, local_RK, 0).reshape(-1)
    F = w2_eDF.shape[2]
    R, K = ids_RK.shape
    x_SD = x_RD[:, None, :].expand(R, K, -1).reshape(R * K, -1)
    w_S1 = weights_RK.reshape(-1, 1)
    if apply_router_weight_on_input:
        x_SD = x_SD * w_S1
    w13_S2FD = w13_eFD[slot_local].float()
    gate_up_S2F = torch.bmm(w13_S2FD, x_SD[:, :, None])[:, :, 0]
    g_SF, u_SF = gate_up_S2F[:, :F], gate_up_S2F[:, F:]
    h_SF = F_nn.silu(g_SF) * u_SF
    sig_SF = torch.sigmoid(g_SF)
    hs_SF = g_SF * g_SF * sig_SF * (1 - sig_SF) * u_SF
    w2_SDF = w2_eDF[slot_local].float()
    y_SD = torch.bmm(w2_SDF, h_SF[:, :, None])[:, :, 0]
    q_SD = torch.bmm(w2_SDF, h_SF.to(hidden_TD.dtype).float()[:, :, None])[:, :, 0]
    v_SD = torch.bmm(w2_SDF, hs_SF[:, :, None])[:, :, 0]
    if not apply_router_weight_on_input:
        y_SD, q_SD, v_SD = y_SD * w_S1, q_SD * w_S1, v_SD * w_S1
    q_SD = q_SD.to(hidden_TD.dtype).float()  # the incumbent stores each slot's output in bf16
    held_S1 = held_RK.reshape(-1, 1)
    zero = torch.zeros((), dtype=torch.float32, device=y_SD.device)
    vectors = [torch.where(held_S1, t, zero).reshape(R, K, -1) for t in (y_SD, q_SD, v_SD)]
    return vectors[0], vectors[1], vectors[2], ids_RK, held_RK


def row_sums(
    y_RKD: torch.Tensor,
    q_RKD: torch.Tensor,
    v_RKD: torch.Tensor,
    ids_RK: torch.Tensor,
    held_RK: torch.Tensor,
    served_RD: torch.Tensor,
    dtype: torch.dtype,
) -> RowSums:
    """Steps 2-4 of the module docstring for R rows (dtype: the served output's, bf16 or fp16)."""
    exact_RD = y_RKD.sum(1)
    ref_RD = q_RKD.sum(1).to(dtype).float()
    served_RD = served_RD.float()
    exact_ok = torch.isfinite(exact_RD)
    served_ok = torch.isfinite(served_RD)
    keep = exact_ok & served_ok
    zero = torch.zeros((), dtype=torch.float32, device=exact_RD.device)
    res = torch.where(keep, served_RD - exact_RD, zero).double()
    inc = torch.where(exact_ok, ref_RD - exact_RD, zero).double()
    diff = torch.where(keep, served_RD - ref_RD, zero).double()
    exact = torch.where(exact_ok, exact_RD, zero).double()
    Y = torch.where(exact_ok[:, None, :], y_RKD, zero).double()
    V = torch.where(exact_ok, v_RKD.sum(1), zero).double()
    # The joint least squares: G over the slots that count here and carry an output; the others get the
    # identity (their y~ is 0, they take no part in the others' directions).
    G_RKK = Y @ Y.transpose(1, 2)
    valid_RK = held_RK & (torch.diagonal(G_RKK, dim1=1, dim2=2) > 0)
    pair = valid_RK[:, :, None] & valid_RK[:, None, :]
    eye = torch.eye(Y.shape[1], dtype=torch.float64, device=Y.device)
    G_RKK = torch.where(pair, G_RKK, 0.0) + torch.diag_embed((~valid_RK).double()) * eye
    Ginv_RKK = torch.linalg.inv(G_RKK)
    diag_RK = torch.diagonal(Ginv_RKK, dim1=1, dim2=2)
    Yt = (Ginv_RKK @ Y) / torch.where(valid_RK, diag_RK, 1.0)[:, :, None]
    Yt = torch.where(valid_RK[:, :, None], Yt, 0.0)
    c_RK = (Ginv_RKK @ (Y @ V[:, :, None]))[:, :, 0]
    Vt = V - (torch.where(valid_RK, c_RK, 0.0)[:, :, None] * Y).sum(1)

    def sums(direction, along_y) -> list[torch.Tensor]:
        """a, b, vb, a_inc, vd, vd2 of one direction against the row's residuals (over the last dim)."""
        res_, inc_, diff_ = (t[:, None, :] if direction.dim() == 3 else t for t in (res, inc, diff))
        vd_terms = direction**2 * diff_**2
        return [
            (direction * res_).sum(-1),
            (direction * along_y).sum(-1),
            (direction**2 * res_**2).sum(-1),
            (direction * inc_).sum(-1),
            vd_terms.sum(-1),
            (vd_terms**2).sum(-1),
        ]

    slot_RK6 = torch.stack(sums(Yt, Y), dim=-1)
    slot_RK6 = torch.where(valid_RK[:, :, None], slot_RK6, 0.0)
    R = Y.shape[0]
    row_R11 = torch.stack(
        [
            torch.ones(R, dtype=torch.float64, device=Y.device),
            res.pow(2).sum(-1),
            exact.pow(2).sum(-1),
            inc.pow(2).sum(-1),
            (exact_ok & ~served_ok).sum(-1).double(),
            *sums(Vt, V),
        ],
        dim=-1,
    )
    return RowSums(ids_RK, valid_RK, slot_RK6, row_R11)


def call_row_sums(call: MoeCall, out_TD: torch.Tensor, rows: list[int]) -> RowSums:
    """The whole definition for the given rows of one call (its weights in the checkpoint's layout)."""
    y, q, v, ids, held = slot_vectors(
        call.hidden_TD,
        call.routing.weights_TK,
        call.routing.ids_TK,
        call.expert_map_E,
        call.weights.w13_eFD,
        call.weights.w2_eDF,
        call.options.apply_router_weight_on_input,
        rows,
    )
    index_R = torch.tensor(rows, dtype=torch.long, device=out_TD.device)
    return row_sums(y, q, v, ids, held, out_TD[index_R], call.hidden_TD.dtype)
