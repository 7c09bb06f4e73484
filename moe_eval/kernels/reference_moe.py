"""The golden MoE: experts computed exactly (fp32, IEEE), for golden references only.

Never a kernel under test and never mutated: the plugin refuses `--mutate` for this backend and the
harness launches it only to make golden records (moe_eval.evaluate.golden). Each expert's weights are
upcast to fp32 on the fly (one expert at a time, so a layer needs one expert's fp32 copy beside
its bf16 weights, not the whole layer's), both GEMMs, the SiLU-and-mul, the routing weight and
the sum over the top-k run in fp32, and the result is rounded to the model's dtype once, at the
end: the correctly rounded MoE output that a bf16 kernel approximates.

How "IEEE, no TF32" is guaranteed: `exact_matmul_mode()` sets torch's fp32 matmul precision to
"highest" (cuBLAS fp32 GEMMs without TF32 on CUDA; oneDNN without bf16 down-conversion on the
CPU) and turns TF32 off for cuBLAS and cuDNN, in the server process that runs this backend only;
`exact_matmul_problem()` re-reads the flags at every call and the kernel refuses to run (raises)
if anything switched them back. The other layers of the model are bf16 and unaffected.

    out_TD = reference_moe(hidden_TD, w13_eFD, w2_eDF, topk_weights_TK, topk_ids_TK)

Same contract as `fused_moe_ref` (which it runs) and `torch_moe`.
"""

from __future__ import annotations

import torch


def exact_matmul_mode() -> None:
    """fp32 matmuls in full IEEE precision for this process (see the module docstring)."""
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def exact_matmul_problem() -> str | None:
    """Why fp32 matmuls might not be IEEE right now (None: they are)."""
    if torch.get_float32_matmul_precision() != "highest":
        return f"torch fp32 matmul precision is {torch.get_float32_matmul_precision()!r}, not 'highest'"
    if torch.backends.cuda.matmul.allow_tf32:
        return "torch.backends.cuda.matmul.allow_tf32 is True"
    return None


def reference_moe(
    hidden_TD: torch.Tensor,
    w13_eFD: torch.Tensor,
    w2_eDF: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    *,
    expert_map_E: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """fused_moe_ref (every product and sum in fp32, one expert's weights upcast at a time, output rounded
    once), refusing to run while fp32 matmuls may be inexact."""
    from moe_eval.kernels.fused_moe import fused_moe_ref

    problem = exact_matmul_problem()
    if problem is not None:
        raise RuntimeError(f"moe-eval reference MoE refuses to run inexactly: {problem}")
    return fused_moe_ref(
        hidden_TD,
        w13_eFD,
        w2_eDF,
        topk_weights_TK,
        topk_ids_TK,
        expert_map_E=expert_map_E,
        apply_router_weight_on_input=apply_router_weight_on_input,
    )
