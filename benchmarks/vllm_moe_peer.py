"""vLLM's Triton fused MoE as a benchmark peer, driven as vLLM's `fused_experts` drives it.

Two sources, one driver:
  folder     the kernel and tuned configs cut from a vLLM wheel by
             benchmarks/extract_vllm_moe_peer.py (`--vllm-peer-dir DIR`, default .vllm-peer/)
  installed  an importable vLLM (`vllm.model_executor.layers.fused_moe.fused_moe`): its kernel,
             config lookup, launcher and CUDA ops

What vLLM runs as CUDA C++ (moe_align_block_size, silu_and_mul, moe_sum) cannot be loaded from
the folder on a machine whose torch differs from the wheel's, so the folder peer uses stand-ins:
  alignment   OUR `moe_align_block_size` at vLLM's BLOCK_SIZE_M (its outputs are what vLLM's
              kernel reads: slot ids with the sentinel T*K, one expert per block, the padded
              count; blocks past the count exit before reading anything, so our -1 there (vLLM
              writes 0) is never seen; slots on other ranks are dropped as vLLM's
              ignore_invalid_experts=True does). vLLM's naive small-batch rule (no alignment
              when there is no expert map and T*K*4 <= E) is reproduced exactly.
  activation  a one-pass Triton kernel with the CUDA op's arithmetic (silu in fp32, rounded,
              times up, rounded): reads 2F, writes F per row, as the CUDA op does
  top-k sum   `torch.sum(y, dim=1, out=out)`, which is vLLM's own path for top-k not in {2, 3, 4};
              for 2-4 (a templated CUDA kernel in vLLM) a one-pass Triton kernel
Every other step is vLLM's code or a line-by-line copy of it: the config file name and its
nearest-M rule, `get_default_config` for shapes without a file, the buffer layout (cache13 shared
by GEMM1's and GEMM2's outputs), the grid size EM from vLLM's padded-buffer size, the launch
arguments, the zeroing of cache3 under an expert map.

Two calls per peer (benchmarks/bench_fused_moe.py times both, interleaved with ours):
  whole_call(case)   fused_experts end to end (folder: with the stand-ins above; installed:
                     vLLM's own fused_experts, its CUDA alignment, activation and sum)
  gemms_call(case)   GEMM1 + activation + GEMM2 only, the slot assignment precomputed outside the
                     timed call (ours at vLLM's BLOCK_SIZE_M, or vLLM's naive assignment where vLLM
                     would use it), the buffers preallocated; no top-k sum

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from moe_eval.kernels.fused_moe import moe_align_block_size
from moe_eval.kernels.testing import MoeCase

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / ".vllm-peer"


# --- stand-ins for vLLM's CUDA ops (folder source only) -----------------------------------------


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # (S, 2F) GEMM1 output: gate columns [0, F), up columns [F, 2F)
    out_ptr,  # (S, F)
    F,
    stride_x,
    stride_out,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < F
    gate = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + F + offs, mask=ok, other=0.0).to(tl.float32)
    # vLLM's act_and_mul_kernel: silu in fp32 rounded to the dtype, then times up in the dtype.
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul_standin(out_SF: torch.Tensor, x_S2F: torch.Tensor) -> None:
    S, F = out_SF.shape
    if S == 0:
        return
    block = min(1024, triton.next_power_of_2(F))
    _silu_and_mul_kernel[(S, triton.cdiv(F, block))](
        x_S2F, out_SF, F, x_S2F.stride(0), out_SF.stride(0), BLOCK=block
    )


@triton.jit
def _topk_sum_kernel(
    y_ptr,  # (T, K, D)
    out_ptr,  # (T, D)
    D,
    stride_yt,
    stride_yk,
    stride_out,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < D
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + t * stride_yt + k * stride_yk + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def moe_sum_standin(y_TKD: torch.Tensor, out_TD: torch.Tensor) -> None:
    T, K, D = y_TKD.shape
    if K in (2, 3, 4) and T > 0:  # vLLM: a templated CUDA kernel, one pass
        block = min(1024, triton.next_power_of_2(D))
        _topk_sum_kernel[(T, triton.cdiv(D, block))](
            y_TKD, out_TD, D, y_TKD.stride(0), y_TKD.stride(1), out_TD.stride(0), TOP_K=K, BLOCK=block
        )
    else:  # vLLM: at::sum_out(output, input, 1)
        torch.sum(y_TKD, dim=1, out=out_TD)


# --- config lookup (a copy of vLLM's rules) -------------------------------------------------------


def config_file_name(E: int, N: int, device_name: str, dtype: str | None) -> str:
    """vLLM's get_config_file_name: N is w2.shape[2] (F per rank), E is w2.shape[0] (local experts)."""
    name = re.sub(r"[\s/]+", "_", device_name)
    if "H200" in name.split("_"):
        name = "NVIDIA_H200"
    return f"E={E},N={N},device_name={name}{'' if not dtype else f',dtype={dtype}'}.json"


def default_config(M: int, E: int) -> dict[str, int]:
    """vLLM's get_default_config for bf16 / fp16 / fp32 on CUDA (0.26.0 and 0.32.0 agree)."""
    block_m = 16 if M <= 32 else 32 if M <= 96 else 64 if M <= 512 else 128
    return {
        "BLOCK_SIZE_M": block_m,
        "BLOCK_SIZE_N": 64 if M <= 64 else 128,
        "BLOCK_SIZE_K": 128 if M <= 64 else 64,
        "GROUP_SIZE_M": 16 if M // max(E, 1) > 128 else 1,
        "SPLIT_K": 1,
        "num_warps": 4 if M <= 128 else 8,
        "num_stages": 4 if M <= 32 else 3,
    }


def dtype_selector(dtype: torch.dtype) -> str | None:
    """vLLM's _get_config_dtype_str for unquantized weights: no selector but for fp32."""
    return "float32" if dtype == torch.float32 else None


def nearest(configs: dict[int, dict], M: int) -> dict:
    # vLLM: configs[min(configs.keys(), key=lambda x: abs(x - M))] (linear distance; ties to the first key)
    return configs[min(configs.keys(), key=lambda x: abs(x - M))]


# --- the peer -------------------------------------------------------------------------------------


@dataclass
class VllmPeer:
    """vLLM's fused MoE from one source; see the module docstring."""

    source: str  # "folder <path>" or "installed"
    version: str
    kernel: Any  # fused_moe_kernel (a triton JITFunction)
    config_dir: Path | None = None  # folder source
    native: Any = None  # installed source: the vllm fused_moe module
    ops: Any = None  # installed source: vllm._custom_ops
    notes: dict = field(default_factory=dict)
    _configs: dict = field(default_factory=dict, repr=False)

    @property
    def installed(self) -> bool:
        return self.native is not None

    # -- pieces of fused_experts_impl

    def config(self, w13_eFD: torch.Tensor, w2_eDF: torch.Tensor, top_k: int, M: int) -> dict:
        dtype = dtype_selector(w13_eFD.dtype)
        if self.installed:
            return self.native.try_get_optimal_moe_config(w13_eFD.size(), w2_eDF.size(), top_k, dtype, M)
        e, _, F = w2_eDF.shape
        device = torch.cuda.get_device_name(w13_eFD.device) if w13_eFD.is_cuda else w13_eFD.device.type
        configs = self._file_configs(config_file_name(e, F, device, dtype))
        return dict(nearest(configs, M)) if configs else default_config(M, e)

    def _file_configs(self, name: str) -> dict[int, dict] | None:
        """vLLM's get_moe_configs (read once per file, as its lru_cache does)."""
        if name not in self._configs:
            path = self.config_dir / "configs" / name
            body = json.loads(path.read_text()) if path.is_file() else None
            if body is not None:
                body.pop("triton_version", None)
                body = {int(k): v for k, v in body.items()}
            self._configs[name] = body
            self.notes.setdefault("config_files" if body else "default_config_for", []).append(name)
        return self._configs[name]

    def assignment(
        self, topk_ids_TK: torch.Tensor, block_m: int, num_local_experts: int, global_num_experts: int,
        expert_map_E: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, int]:  # fmt: skip
        """(sorted_token_ids, expert_ids, num_tokens_post_padded, padded size vLLM's buffer would have).

        vLLM's _prepare_expert_assignment: naive when there is no expert map and T*K*4 <= E;
        else moe_align_block_size (here: ours, see the module docstring).
        """
        T, K = topk_ids_TK.shape
        slots = T * K
        if expert_map_E is None and slots * 4 <= global_num_experts:
            ntpp = torch.full((1,), slots * block_m, dtype=torch.int32, device=topk_ids_TK.device)
            return None, topk_ids_TK.view(-1), ntpp, slots * block_m
        align = moe_align_block_size(topk_ids_TK, block_m, num_local_experts, expert_map_E)
        # vLLM's buffer: numel + E * (BM - 1), or numel * BM when numel < E (moe_align_block_size.py);
        # it sets the grid (EM), ours is never larger, and rows past the padded count are never read.
        padded = slots + global_num_experts * (block_m - 1)
        if slots < global_num_experts:
            padded = min(slots * block_m, padded)
        return align.sorted_ids_P, align.expert_ids_B, align.num_post_pad_1, padded

    def gemm(
        self, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, topk_weights_TK: torch.Tensor,
        sorted_ids: torch.Tensor | None, expert_ids: torch.Tensor, ntpp: torch.Tensor, padded: int,
        mul_routed_weight: bool, top_k: int, config: dict,
    ) -> None:  # fmt: skip
        """One fused_moe_kernel launch, with invoke_fused_moe_triton_kernel's arguments (unquantized)."""
        compute_type = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[
            A.dtype
        ]
        if self.installed:
            if sorted_ids is not None and sorted_ids.numel() < padded:
                # vLLM sizes its grid from this buffer's length: give it the length vLLM's align has.
                full = sorted_ids.new_empty(padded)
                full[: sorted_ids.numel()] = sorted_ids
                sorted_ids = full
            self.native.invoke_fused_moe_triton_kernel(
                A, B, C, None, None, topk_weights_TK, sorted_ids, expert_ids, ntpp, mul_routed_weight, top_k,
                config, compute_type=compute_type, use_fp8_w8a8=False, use_int8_w8a8=False,
                use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=False, block_shape=None,
            )  # fmt: skip
            return
        M = A.size(0)
        block_m = config["BLOCK_SIZE_M"]
        if sorted_ids is not None:
            EM = padded
            if M < block_m:  # "optimize for small batch_size"
                EM = min(padded, M * top_k * block_m)
        else:
            EM = M * top_k * block_m
        config = dict(config)
        config["SPLIT_K"] = 1
        block_k = config.pop("BLOCK_SIZE_K")
        grid = (triton.cdiv(EM, block_m) * triton.cdiv(B.size(1), config["BLOCK_SIZE_N"]),)
        extra = {"USE_TD": False} if "USE_TD" in self.kernel.arg_names else {}
        self.kernel[grid](
            A, B, C, None, None, None, topk_weights_TK, sorted_ids, expert_ids, ntpp,
            B.size(1), B.size(2), EM, M * top_k,
            A.stride(0), A.stride(1), B.stride(0), B.stride(2), B.stride(1), C.stride(1), C.stride(2),
            0, 0, 0, 0, 0,  # scale strides: no scales
            0, 0,  # bias strides: no bias
            0, 0,  # group_n, group_k: no block quantization
            MUL_ROUTED_WEIGHT=mul_routed_weight, top_k=top_k, compute_type=compute_type,
            use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False,
            naive_block_assignment=sorted_ids is None, HAS_BIAS=False, BLOCK_SIZE_K=block_k, SWAP_AB=False,
            **extra, **config,
        )  # fmt: skip

    def silu_and_mul(self, out_SF: torch.Tensor, x_S2F: torch.Tensor) -> None:
        if self.installed:
            torch.ops._C.silu_and_mul(out_SF, x_S2F)
        else:
            silu_and_mul_standin(out_SF, x_S2F)

    def moe_sum(self, y_TKD: torch.Tensor, out_TD: torch.Tensor) -> None:
        if self.installed:
            self.ops.moe_sum(y_TKD, out_TD)
        else:
            moe_sum_standin(y_TKD, out_TD)

    # -- the two timed calls

    def whole_call(self, case: MoeCase, global_num_experts: int) -> Callable[[], torch.Tensor]:
        """fused_experts(x, w13, w2, topk_weights, topk_ids, ...) end to end."""
        if self.installed:
            fused_experts = self.native.fused_experts
            return lambda: fused_experts(
                case.hidden_TD, case.w13_eFD, case.w2_eDF, case.topk_weights_TK, case.topk_ids_TK,
                apply_router_weight_on_input=case.apply_router_weight_on_input,
                global_num_experts=global_num_experts, expert_map=case.expert_map_E,
            )  # fmt: skip
        return lambda: self._fused_experts_folder(case, global_num_experts)

    def _fused_experts_folder(self, case: MoeCase, global_num_experts: int) -> torch.Tensor:
        """fused_experts_impl, unquantized, line by line (0.26.0 and 0.32.0 agree), stand-ins marked."""
        x, w1, w2 = case.hidden_TD, case.w13_eFD, case.w2_eDF
        T = x.size(0)
        E, N, _ = w1.size()
        H = w2.size(1)
        top_k = case.topk_ids_TK.size(1)
        config = self.config(w1, w2, top_k, T)
        cache13 = torch.empty(T * top_k * max(N, H), device=x.device, dtype=x.dtype)
        cache1 = cache13[: T * top_k * N].view(T, top_k, N)
        cache3 = cache13[: T * top_k * H].view(T, top_k, H)
        cache2 = torch.empty((T * top_k, N // 2), device=x.device, dtype=x.dtype)
        out = torch.empty_like(x)
        if T == 0:
            return out
        sorted_ids, expert_ids, ntpp, padded = self.assignment(  # stand-in: our alignment
            case.topk_ids_TK, config["BLOCK_SIZE_M"], E, global_num_experts, case.expert_map_E
        )
        on_input = case.apply_router_weight_on_input
        self.gemm(
            x, w1, cache1, case.topk_weights_TK, sorted_ids, expert_ids, ntpp, padded, on_input, top_k, config
        )
        self.silu_and_mul(cache2, cache1.view(-1, N))  # stand-in
        if case.expert_map_E is not None:
            cache3.zero_()
        self.gemm(cache2, w2, cache3, case.topk_weights_TK, sorted_ids, expert_ids, ntpp, padded,
                  not on_input, 1, config)  # fmt: skip
        self.moe_sum(cache3, out)  # stand-in
        return out

    def gemms_call(
        self, case: MoeCase, global_num_experts: int
    ) -> tuple[Callable[[], None], Callable[[], torch.Tensor]]:
        """(timed call, finish): GEMM1 + activation + GEMM2 on a precomputed assignment and buffers;
        `finish` sums over K outside the timing (fp32) so the result can be checked."""
        x, w1, w2 = case.hidden_TD, case.w13_eFD, case.w2_eDF
        T = x.size(0)
        E, N, _ = w1.size()
        H = w2.size(1)
        top_k = case.topk_ids_TK.size(1)
        config = self.config(w1, w2, top_k, T)
        sorted_ids, expert_ids, ntpp, padded = self.assignment(
            case.topk_ids_TK, config["BLOCK_SIZE_M"], E, global_num_experts, case.expert_map_E
        )
        if self.installed and sorted_ids is not None and sorted_ids.numel() < padded:
            full = sorted_ids.new_empty(padded)  # once, outside the timed call (see gemm)
            full[: sorted_ids.numel()] = sorted_ids
            sorted_ids = full
        cache13 = torch.empty(T * top_k * max(N, H), device=x.device, dtype=x.dtype)
        cache1 = cache13[: T * top_k * N].view(T, top_k, N)
        cache3 = cache13[: T * top_k * H].view(T, top_k, H)
        cache2 = torch.empty((T * top_k, N // 2), device=x.device, dtype=x.dtype)
        on_input = case.apply_router_weight_on_input
        keep = (sorted_ids, expert_ids, ntpp)  # the graph replays these pointers: keep them alive

        def call() -> None:
            self.gemm(x, w1, cache1, case.topk_weights_TK, *keep, padded, on_input, top_k, config)
            self.silu_and_mul(cache2, cache1.view(-1, N))
            if case.expert_map_E is not None:
                cache3.zero_()
            self.gemm(cache2, w2, cache3, case.topk_weights_TK, *keep, padded, not on_input, 1, config)

        return call, lambda: cache3.float().sum(dim=1)


def load_folder(path: Path) -> VllmPeer:
    """The kernel cut by extract_vllm_moe_peer.py, imported from its file (triton.jit reads the source)."""
    path = Path(path)
    manifest = json.loads((path / "MANIFEST.json").read_text())
    name = f"_vllm_peer_kernel_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path / "fused_moe_kernel.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return VllmPeer(f"folder {path}", manifest["vllm_version"], module.fused_moe_kernel, config_dir=path,
                    notes={"wheel_sha256": manifest["wheel_sha256"]})  # fmt: skip


def load_installed() -> VllmPeer:
    """vLLM's own module; raises ImportError (with vLLM's reason) where it cannot be imported."""
    import vllm
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.fused_moe import fused_moe as native

    return VllmPeer("installed", vllm.__version__, native.fused_moe_kernel, native=native, ops=ops)


def load(path: Path | None) -> VllmPeer:
    """The folder if given (or the default .vllm-peer/ if it exists), else the installed vLLM."""
    if path is not None:
        return load_folder(path)
    if (DEFAULT_DIR / "MANIFEST.json").is_file():
        return load_folder(DEFAULT_DIR)
    return load_installed()
