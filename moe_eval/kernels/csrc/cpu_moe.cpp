// The bundled CPU MoE (moe_eval/kernels/cpu_moe.py builds and loads it): torch_moe's numerics on torch's own
// AMX micro-kernel (at::native::cpublas::brgemm, oneDNN: bf16 x bf16 -> fp32).
//
// Slots are counting-sorted by local expert (slots of other ranks, id -1, dropped). Per (expert, block of
// BLOCK_M rows), one task on torch's thread pool: gather the tokens' rows, GEMM1, SiLU-and-mul in fp32
// rounded to bf16, GEMM2 into that task's rows of Y (fp32). Then per token its rows of Y, weighted by the
// router, summed in expert order (torch_moe's index_add_ order) and rounded once: no atomics, so the same
// call gives the same bits, and a token's result depends on its own routing only, not on its batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstring>
#include <vector>

using at::BFloat16;
using fVec = at::vec::Vectorized<float>;
namespace cpublas = at::native::cpublas;

constexpr int64_t BLOCK_M = 32;  // rows a task (two AMX tiles of 16)
constexpr int64_t BLOCK_N = 64;  // output features a brgemm call: oneDNN's packed B takes a leading dimension of 16-64
constexpr int64_t MAX_K = 64;

bool could_pack() { return cpublas::could_pack(at::kBFloat16); }

// w [e, N, Kd] (out features x in) -> per expert and block of BLOCK_N outputs, W^T's [Kd, BLOCK_N] in brgemm's
// VNNI layout: [e][N / BLOCK_N][Kd][BLOCK_N].
torch::Tensor pack_weights(torch::Tensor w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 3, "pack_weights: bf16 [e, N, Kd]");
  const int64_t e = w.size(0), N = w.size(1), Kd = w.size(2);
  TORCH_CHECK(N % BLOCK_N == 0 && Kd % 2 == 0, "pack_weights: N a multiple of 64 and Kd even, got ", N, ", ", Kd);
  auto out = torch::empty({e, N / BLOCK_N, Kd, BLOCK_N}, w.options());
  for (int64_t i = 0; i < e; ++i) {
    auto wt = w[i].t().contiguous();  // [Kd, N]
    for (int64_t nb = 0; nb < N / BLOCK_N; ++nb)
      cpublas::pack(Kd, BLOCK_N, N, BLOCK_N, at::kBFloat16, at::kBFloat16, wt.data_ptr<BFloat16>() + nb * BLOCK_N,
                    out[i][nb].data_ptr());
  }
  return out;
}

// C [m, N] (leading dimension ldc) = A [m, Kd] x the packed expert's W^T, block by block of outputs.
static void gemm(int64_t m, int64_t N, int64_t Kd, const BFloat16* A, const BFloat16* Wp, float* C, int64_t ldc) {
  for (int64_t nb = 0; nb < N / BLOCK_N; ++nb)
    cpublas::brgemm(m, BLOCK_N, Kd, Kd, BLOCK_N, ldc, false, A, Wp + nb * Kd * BLOCK_N, C + nb * BLOCK_N);
}

template <typename T>
static T* scratch(std::vector<T>& v, size_t n) {  // grown, never shrunk: no allocation (page faults) per call
  if (v.size() < n) v.resize(n);
  return v.data();
}

// x [T, D] bf16; w13p, w2p from pack_weights; topk_w [T, K] fp32; local_ids [T, K] int64, -1: a slot
// of another rank. silu_slope != 1: the deliberate bug of `--mutate silu_slope`. on_input: the router weight
// scales x (rounded to bf16) instead of y.
torch::Tensor moe(torch::Tensor x, torch::Tensor w13p, torch::Tensor w2p, torch::Tensor topk_w,
                  torch::Tensor local_ids, double silu_slope, bool on_input) {
  // GEMM2's output, BLOCK_M rows a task (its padded rows are its own). Per calling thread: pybind holds the
  // GIL through the call, but a buffer shared by two callers would be one released GIL away from a race.
  thread_local std::vector<float> Y_buf;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "moe: x [T, D] bf16 contiguous");
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(local_ids.dim() == 2 && local_ids.size(0) == T && local_ids.scalar_type() == at::kLong &&
              local_ids.is_contiguous(), "moe: local ids [T, K] int64 contiguous");
  const int64_t K = local_ids.size(1), S = T * K;
  TORCH_CHECK(topk_w.scalar_type() == at::kFloat && topk_w.is_contiguous() && topk_w.numel() == S,
              "moe: topk weights [T, K] fp32 contiguous");
  TORCH_CHECK(w13p.dim() == 4 && w2p.dim() == 4 && w13p.scalar_type() == at::kBFloat16 &&
              w2p.scalar_type() == at::kBFloat16 && w13p.size(0) == w2p.size(0), "moe: packed bf16 weights");
  const int64_t e = w13p.size(0), F2 = w13p.size(1) * w13p.size(3), F = F2 / 2;
  TORCH_CHECK(w13p.size(2) == D && w2p.size(1) * w2p.size(3) == D && w2p.size(2) == F, "moe: weight shapes");
  TORCH_CHECK(K <= MAX_K && F % fVec::size() == 0, "moe: K <= 64 and F a multiple of 16");
  const int64_t* id = local_ids.data_ptr<int64_t>();
  const float* wt = topk_w.data_ptr<float>();
  // counting sort by expert; within an expert, slot order (token, k)
  std::vector<int64_t> start(e + 1, 0), order(S);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(id[s] >= -1 && id[s] < e, "moe: local expert id ", id[s], " not in -1..", e - 1);
    if (id[s] >= 0) start[id[s] + 1]++;
  }
  for (int64_t i = 0; i < e; ++i) start[i + 1] += start[i];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t s = 0; s < S; ++s)
      if (id[s] >= 0) order[fill[id[s]]++] = s;
  }
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (expert, first sorted row)
  for (int64_t i = 0; i < e; ++i)
    for (int64_t r = start[i]; r < start[i + 1]; r += BLOCK_M) tasks.emplace_back(i, r);
  const int64_t ntask = tasks.size();
  float* Y = scratch(Y_buf, std::max<int64_t>(ntask, 1) * BLOCK_M * D);
  std::vector<int64_t> yrow(S, -1);  // a slot's row in Y
  for (int64_t t = 0; t < ntask; ++t) {
    const int64_t ex = tasks[t].first, r0 = tasks[t].second, m = std::min(BLOCK_M, start[ex + 1] - r0);
    for (int64_t r = 0; r < m; ++r) yrow[order[r0 + r]] = t * BLOCK_M + r;
  }
  const BFloat16* X = x.data_ptr<BFloat16>();
  const BFloat16* W13 = w13p.data_ptr<BFloat16>();
  const BFloat16* W2 = w2p.data_ptr<BFloat16>();
  const float slope = static_cast<float>(silu_slope);
  at::parallel_for(0, ntask, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<BFloat16> xa_buf, h_buf;
    thread_local std::vector<float> c1_buf, xf_buf;
    BFloat16* xa = scratch(xa_buf, BLOCK_M * D);
    BFloat16* h = scratch(h_buf, BLOCK_M * F);
    float* c1 = scratch(c1_buf, BLOCK_M * F2);
    float* xf = scratch(xf_buf, D);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t ex = tasks[t].first, r0 = tasks[t].second;
      const int64_t m = std::min(BLOCK_M, start[ex + 1] - r0);
      // AMX tiles hold 16 rows: a short block is padded to 16 or 32 rows (their results never read), so
      // every call of a GEMM uses one of two kernels and the tile configuration is not reloaded per size.
      const int64_t mp = std::min(BLOCK_M, (m + 15) / 16 * 16);
      for (int64_t r = 0; r < m; ++r) {
        const int64_t s = order[r0 + r];
        if (on_input) {  // torch_moe: (x.float() * w).to(bf16)
          at::vec::convert(X + (s / K) * D, xf, D);
          const fVec w(wt[s]);
          for (int64_t d = 0; d < D; d += fVec::size()) (fVec::loadu(xf + d) * w).store(xf + d);
          at::vec::convert(xf, xa + r * D, D);
        } else {
          std::memcpy(xa + r * D, X + (s / K) * D, D * sizeof(BFloat16));
        }
      }
      gemm(mp, F2, D, xa, W13 + ex * D * F2, c1, F2);
      for (int64_t r = 0; r < m; ++r) {
        float* row = c1 + r * F2;
        for (int64_t j = 0; j < F; j += fVec::size()) {  // in place: the gate's half is done with
          const fVec g = fVec::loadu(row + j), u = fVec::loadu(row + F + j);
          const fVec z = slope == 1.0f ? g : g * fVec(slope);
          (g / (fVec(1.0f) + z.neg().exp()) * u).store(row + j);
        }
        at::vec::convert(row, h + r * F, F);
      }
      gemm(mp, D, F, h, W2 + ex * F * D, Y + t * BLOCK_M * D, D);
    }
    cpublas::brgemm_release();
  });
  auto out = torch::empty({T, D}, x.options());
  BFloat16* O = out.data_ptr<BFloat16>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> acc_buf;
    float* acc = scratch(acc_buf, D);
    int64_t rows[MAX_K];  // row in Y * MAX_K + k: sorted, the rows come in expert order with their k
    for (int64_t t = begin; t < end; ++t) {
      int64_t n = 0;
      for (int64_t k = 0; k < K; ++k)
        if (yrow[t * K + k] >= 0) rows[n++] = yrow[t * K + k] * MAX_K + k;
      std::sort(rows, rows + n);
      for (int64_t d = 0; d < D; d += fVec::size()) {
        fVec a(0.0f);
        for (int64_t i = 0; i < n; ++i) {
          const fVec y = fVec::loadu(Y + (rows[i] / MAX_K) * D + d);
          a = a + (on_input ? y : y * fVec(wt[t * K + rows[i] % MAX_K]));
        }
        a.store(acc + d);
      }
      at::vec::convert(acc, O + t * D, D);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("could_pack", &could_pack, "whether torch's brgemm packs bf16 on this CPU (AMX)");
  m.def("pack_weights", &pack_weights, "weights [e, N, Kd] to brgemm's VNNI blocks");
  m.def("moe", &moe, "the MoE call");
}
