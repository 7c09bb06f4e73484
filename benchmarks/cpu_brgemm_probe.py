"""Probe (issue 56, the CPU path): how close can a compiled MoE of our own come to vLLM's CPU kernel on this
CPU's AMX tiles, with the torch path's numerics (bf16 operands, fp32 sums, the GEMM2 input rounded to bf16,
the top-k sum in fp32 in a fixed order, the output rounded once)?

The kernel here is small C++ built at first use (torch.utils.cpp_extension.load_inline; g++ and ninja), on
torch's own brgemm (`at::native::cpublas::brgemm`: oneDNN's AMX micro-kernel, bf16 x bf16 -> fp32, weights
packed once into its VNNI layout): slots sorted by expert (counting sort), per (expert, block of 32 rows) one
GEMM1, SiLU-and-mul, one GEMM2 scaled by the router weight into the slot's row; then each token's K rows
summed in k order. Threads: torch's intra-op pool over the (expert, block) tasks.

Not the product's kernel: a measurement of what one would reach. Prints the error against the fp32 oracle
beside torch_moe's, then torch_moe, this probe and vLLM's CPU kernel timed interleaved (bench_torch_moe's
method: 8 rotated inputs, medians).

    PYTHONPATH=.:benchmarks python benchmarks/cpu_brgemm_probe.py [--threads 2] [--tokens 1 8 40 100 512 2048]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from bench_torch_moe import medians_us, table_cells, vllm_cpu_kernel

from moe_eval.kernels.fused_moe import fused_moe_ref
from moe_eval.kernels.testing import MoeCase
from moe_eval.kernels.torch_moe import torch_moe

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <cmath>
#include <vector>

using at::BFloat16;
using fVec = at::vec::Vectorized<float>;
namespace cpublas = at::native::cpublas;
constexpr int64_t BLOCK_M = 32;

// w [e, N, Kd] (out features x in): per expert and per block of BLOCK_N output features, W^T's [Kd, BLOCK_N]
// packed to brgemm's VNNI layout (oneDNN's packed B takes a leading dimension of 16-64):
// [e][N / BLOCK_N][Kd][BLOCK_N].
constexpr int64_t BLOCK_N = 64;
torch::Tensor pack_weights(torch::Tensor w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 3);
  const int64_t e = w.size(0), N = w.size(1), Kd = w.size(2);
  TORCH_CHECK(N % BLOCK_N == 0 && Kd % 2 == 0, "N a multiple of 32, Kd even");
  auto out = torch::empty({e, N / BLOCK_N, Kd, BLOCK_N}, w.options());
  for (int64_t i = 0; i < e; ++i) {
    auto wt = w[i].t().contiguous();  // [Kd, N]
    for (int64_t nb = 0; nb < N / BLOCK_N; ++nb)
      cpublas::pack(Kd, BLOCK_N, N, BLOCK_N, at::kBFloat16, at::kBFloat16,
                    wt.data_ptr<BFloat16>() + nb * BLOCK_N, out[i][nb].data_ptr());
  }
  return out;
}

// C [m, N] (ld N) = A [m, Kd] (ld Kd) x the packed expert's W^T, block by block of output features.
static void gemm(int64_t m, int64_t N, int64_t Kd, const BFloat16* A, const BFloat16* Wp, float* C) {
  for (int64_t nb = 0; nb < N / BLOCK_N; ++nb)
    cpublas::brgemm(m, BLOCK_N, Kd, Kd, BLOCK_N, N, false, A, Wp + nb * Kd * BLOCK_N, C + nb * BLOCK_N);
}

bool could_pack() { return cpublas::could_pack(at::kBFloat16); }

torch::Tensor moe(torch::Tensor x, torch::Tensor w13p, torch::Tensor w2p, torch::Tensor topk_w,
                  torch::Tensor topk_ids) {
  const int64_t T = x.size(0), D = x.size(1), K = topk_ids.size(1);
  const int64_t e = w13p.size(0), F2 = w13p.size(1) * w13p.size(3), F = F2 / 2;
  auto ids = topk_ids.to(torch::kLong).contiguous();
  auto wts = topk_w.to(torch::kFloat).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* wt = wts.data_ptr<float>();
  const int64_t S = T * K;
  // counting sort of the slots by expert; within an expert, slot order (token, k)
  std::vector<int64_t> start(e + 1, 0), order(S);
  for (int64_t s = 0; s < S; ++s) start[id[s] + 1]++;
  for (int64_t i = 0; i < e; ++i) start[i + 1] += start[i];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t s = 0; s < S; ++s) order[fill[id[s]]++] = s;
  }
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (expert, first row)
  for (int64_t i = 0; i < e; ++i)
    for (int64_t r = start[i]; r < start[i + 1]; r += BLOCK_M) tasks.emplace_back(i, r);
  auto y = torch::empty({S, D}, x.options().dtype(torch::kFloat));  // per slot, weighted
  float* Y = y.data_ptr<float>();
  const BFloat16* X = x.data_ptr<BFloat16>();
  const BFloat16* W13 = w13p.data_ptr<BFloat16>();
  const BFloat16* W2 = w2p.data_ptr<BFloat16>();
  at::parallel_for(0, (int64_t)tasks.size(), 1, [&](int64_t b, int64_t f) {
    std::vector<BFloat16> xa(BLOCK_M * D), h(BLOCK_M * F);
    std::vector<float> c1(BLOCK_M * F2), c2(BLOCK_M * D);
    for (int64_t t = b; t < f; ++t) {
      const int64_t ex = tasks[t].first, r0 = tasks[t].second;
      const int64_t m = std::min(BLOCK_M, start[ex + 1] - r0);
      for (int64_t r = 0; r < m; ++r)
        std::memcpy(&xa[r * D], X + (order[r0 + r] / K) * D, D * sizeof(BFloat16));
      gemm(m, F2, D, xa.data(), W13 + ex * D * F2, c1.data());
      for (int64_t r = 0; r < m; ++r) {
        float* row = &c1[r * F2];
        for (int64_t j = 0; j < F; j += fVec::size()) {  // F a multiple of 16 (pack_weights: of 32)
          const fVec g = fVec::loadu(row + j), u = fVec::loadu(row + F + j);
          (g / (fVec(1.0f) + g.neg().exp()) * u).store(row + j);  // in place: the gate's half is done with
        }
        for (int64_t j = 0; j < F; ++j) h[r * F + j] = BFloat16(row[j]);
      }
      gemm(m, D, F, h.data(), W2 + ex * F * D, c2.data());
      for (int64_t r = 0; r < m; ++r) {
        const int64_t s = order[r0 + r];
        const fVec w(wt[s]);
        for (int64_t d = 0; d < D; d += fVec::size()) (fVec::loadu(&c2[r * D + d]) * w).store(Y + s * D + d);
      }
    }
    cpublas::brgemm_release();
  });
  auto out = torch::empty({T, D}, x.options());
  BFloat16* O = out.data_ptr<BFloat16>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t f) {
    for (int64_t t = b; t < f; ++t)
      for (int64_t d = 0; d < D; d += fVec::size()) {  // D a multiple of 32 (pack_weights)
        fVec acc = fVec::loadu(Y + t * K * D + d);
        for (int64_t k = 1; k < K; ++k) acc = acc + fVec::loadu(Y + (t * K + k) * D + d);  // k order
        float sum[fVec::size()];
        acc.store(sum);
        for (int64_t i = 0; i < fVec::size(); ++i) O[t * D + d + i] = BFloat16(sum[i]);
      }
  });
  return out;
}
"""


def build():
    from torch.utils.cpp_extension import load_inline

    t0 = time.perf_counter()
    module = load_inline(
        "moe_brgemm_probe",
        SOURCE,
        functions=["pack_weights", "moe", "could_pack"],
        # ATen's Vectorized<float> with AVX-512 and Sleef (torch ships sleef.h): without the define, its exp
        # is a scalar loop, and the SiLU and the sums took more than both GEMMs together (T = 2048, canary).
        extra_cflags=["-O3", "-march=native", "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"],
        verbose=False,
    )
    print(
        f"built in {time.perf_counter() - t0:.0f} s; brgemm packs bf16 here: {module.could_pack()}",
        flush=True,
    )
    return module


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", nargs="*", type=int, default=[2])
    parser.add_argument("--tokens", nargs="*", type=int, default=[1, 8, 40, 100, 512, 2048])
    parser.add_argument("--repeats", type=int, default=41)
    args = parser.parse_args(argv)
    module = build()
    print("| E | K | D | F | T | threads | err torch_moe | err probe | torch_moe us | probe us | vLLM CPU us "
          "| probe / vLLM |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for threads, (E, K, D, F), T, cases in table_cells(args.threads, args.tokens):
        first = cases[0]
        w13p, w2p = module.pack_weights(first.w13_eFD), module.pack_weights(first.w2_eDF)

        def probe(c: MoeCase) -> torch.Tensor:
            return module.moe(c.hidden_TD, w13p, w2p, c.topk_weights_TK, c.topk_ids_TK)

        ref = fused_moe_ref(*first.args(), **first.kwargs())
        errors = (
            rel_err(torch_moe(*first.args(), **first.kwargs()), ref),
            rel_err(probe(first), ref),
        )
        kernels = {"torch_moe": lambda c: torch_moe(*c.args(), **c.kwargs()), "probe": probe}
        vllm = vllm_cpu_kernel(first)
        if vllm is not None:
            kernels["vllm"] = vllm
        us = medians_us(kernels, cases, args.repeats)
        peer = us.get("vllm")
        cells = [
            f"{errors[0]:.2e}",
            f"{errors[1]:.2e}",
            f"{us['torch_moe']:.0f}",
            f"{us['probe']:.0f}",
            f"{peer:.0f}" if peer else "-",
            f"x{us['probe'] / peer:.2f}" if peer else "-",
        ]
        print(f"| {E} | {K} | {D} | {F} | {T} | {threads} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
