// The bundled CPU MoE (moe_eval/kernels/cpu_moe.py builds and loads it): torch_moe's numerics on AMX tiles.
//
// Slots are counting-sorted by local expert (slots of other ranks, id -1, dropped). Per (expert, block of
// BLOCK_M rows), one task on torch's thread pool: gather the tokens' rows, GEMM1, SiLU-and-mul in fp32
// rounded to bf16, GEMM2 into that task's rows of Y (fp32). Then per token its rows of Y, weighted by the
// router, summed in expert order (torch_moe's index_add_ order) and rounded once: no atomics, so the same
// call gives the same bits, and a token's result depends on its own routing only, not on its batch.
//
// The GEMMs are AMX tile instructions written here, one tile configuration for the whole call: torch's
// brgemm (oneDNN) took 64 output columns a call, and its per-call kernel lookup and tile reconfiguration cost
// as much as the arithmetic at these sizes. Each weight tile (from L2) serves the task's four row tiles
// before the next is loaded, and the one two steps ahead is prefetched. Each output element sums its
// products in ascending steps of 32 in one fp32 tile, as oneDNN's brgemm did: the same bits (tested against
// torch_moe).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

using at::BFloat16;
using fVec = at::vec::Vectorized<float>;

constexpr int64_t BLOCK_M = 64;  // rows a task: four tiles of 16
constexpr int64_t TILE_N = 16;   // output columns a C tile (16 fp32 = 64 bytes a row)
constexpr int64_t TILE_K = 32;   // products a tile step sums (16 bf16 pairs = 64 bytes a row)
constexpr int64_t MAX_K = 64;
constexpr int64_t PREFETCH_K = 64;  // how far ahead along Kd the weights are prefetched (32: slower, 128: same)

// Linux hands AMX tile data to a process only when asked (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA); a
// tile instruction without it is SIGILL. Asked once; false where the kernel refuses (then torch_moe serves).
bool amx_ready() {
  static const bool ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ready;
}

// w [e, N, Kd] (out features x in) -> per expert, per block of 16 outputs, W^T's [Kd, 16] as pairs along Kd
// (the B operand's layout: a tile step is 16 rows of 64 contiguous bytes): [e][N / 16][Kd / 2][16][2].
torch::Tensor pack_weights(torch::Tensor w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 3, "pack_weights: bf16 [e, N, Kd]");
  const int64_t e = w.size(0), N = w.size(1), Kd = w.size(2);
  TORCH_CHECK(N % (2 * TILE_N) == 0 && Kd % TILE_K == 0, "pack_weights: N and Kd multiples of 32, got ", N, ", ",
              Kd);
  auto src = w.contiguous();
  auto out = torch::empty({e, N / TILE_N, Kd / 2, TILE_N, 2}, w.options());
  const BFloat16* W = src.data_ptr<BFloat16>();
  BFloat16* P = out.data_ptr<BFloat16>();
  at::parallel_for(0, e, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < Kd; ++k)
          P[(((i * (N / TILE_N) + n / TILE_N) * (Kd / 2) + k / 2) * TILE_N + n % TILE_N) * 2 + k % 2] =
              W[(i * N + n) * Kd + k];
  });
  return out;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: C (4 blocks of 16 x 16 fp32); 4, 5, 7: A (16 rows x 32 bf16); 6: B (16 pairs x 16 columns).
// Every tile is 16 rows of 64 bytes, so one configuration serves both GEMMs and every block size. A static:
// g++ drops stores to a local that only ldtilecfg reads.
static const TileConfig TILES = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

__attribute__((target("amx-tile"))) static void tiles_on() { _tile_loadconfig(&TILES); }

__attribute__((target("amx-tile"))) static void tiles_off() { _tile_release(); }

// C [16 * BLOCKS, N] (leading dimension ldc) = A [16 * BLOCKS, Kd] x the packed expert's W^T; A's rows past the
// caller's m are padding, their results never read. Each B tile (the weights, from L2) serves every block of
// rows before the next is loaded; the A tiles (the block's rows, in L1) are loaded again for each.
template <int BLOCKS>
__attribute__((target("amx-tile,amx-bf16"))) static void gemm(int64_t N, int64_t Kd, const BFloat16* A,
                                                               const BFloat16* Wp, float* C, int64_t ldc) {
  const int64_t block = (Kd / 2) * TILE_N * 2;  // one packed block of 16 outputs
  const int64_t lda = Kd * sizeof(BFloat16), stride = ldc * sizeof(float);
  for (int64_t n = 0; n < N; n += TILE_N) {
    const BFloat16* B = Wp + (n / TILE_N) * block;
    _tile_zero(0);
    if (BLOCKS > 1) _tile_zero(1);
    if (BLOCKS > 2) _tile_zero(2);
    if (BLOCKS > 3) _tile_zero(3);
    for (int64_t k = 0; k < Kd; k += TILE_K) {
      const char* ahead = reinterpret_cast<const char*>(B + (k + PREFETCH_K) * TILE_N);
      for (int line = 0; line < 16; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
      _tile_loadd(6, B + k * TILE_N, 64);
      _tile_loadd(4, A + k, lda);
      _tile_dpbf16ps(0, 4, 6);
      if (BLOCKS > 1) {
        _tile_loadd(5, A + 16 * Kd + k, lda);
        _tile_dpbf16ps(1, 5, 6);
      }
      if (BLOCKS > 2) {
        _tile_loadd(7, A + 32 * Kd + k, lda);
        _tile_dpbf16ps(2, 7, 6);
      }
      if (BLOCKS > 3) {
        _tile_loadd(4, A + 48 * Kd + k, lda);
        _tile_dpbf16ps(3, 4, 6);
      }
    }
    _tile_stored(0, C + n, stride);
    if (BLOCKS > 1) _tile_stored(1, C + 16 * ldc + n, stride);
    if (BLOCKS > 2) _tile_stored(2, C + 32 * ldc + n, stride);
    if (BLOCKS > 3) _tile_stored(3, C + 48 * ldc + n, stride);
  }
}

static void gemm(int64_t mp, int64_t N, int64_t Kd, const BFloat16* A, const BFloat16* Wp, float* C, int64_t ldc) {
  switch (mp / 16) {
    case 1: return gemm<1>(N, Kd, A, Wp, C, ldc);
    case 2: return gemm<2>(N, Kd, A, Wp, C, ldc);
    case 3: return gemm<3>(N, Kd, A, Wp, C, ldc);
    default: return gemm<4>(N, Kd, A, Wp, C, ldc);
  }
}

// Grown, never shrunk: no allocation (page faults) per call. 64-byte aligned: a tile row, and a vector, is then
// one cache line, not two (std::vector's 16-byte alignment moved the call's time by 20 % between builds).
template <typename T>
static T* scratch(std::vector<T>& v, size_t n) {
  const size_t pad = 64 / sizeof(T);
  if (v.size() < n + pad) v.resize(n + pad);
  const auto address = reinterpret_cast<uintptr_t>(v.data());
  return reinterpret_cast<T*>((address + 63) & ~uintptr_t(63));
}

// x [T, D] bf16; w13p, w2p from pack_weights; topk_w [T, K] fp32; local_ids [T, K] int32 (the router's, taken as
// it is: no conversion op per call) or int64, -1: a slot of another rank. silu_slope != 1: the deliberate bug of
// `--mutate silu_slope`. on_input: the router weight scales x (rounded to bf16) instead of y.
torch::Tensor moe(torch::Tensor x, torch::Tensor w13p, torch::Tensor w2p, torch::Tensor topk_w,
                  torch::Tensor local_ids, double silu_slope, bool on_input) {
  // GEMM2's output, BLOCK_M rows a task (its padded rows are its own). Per calling thread: pybind holds the
  // GIL through the call, but a buffer shared by two callers would be one released GIL away from a race.
  thread_local std::vector<float> Y_buf;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "moe: x [T, D] bf16 contiguous");
  const int64_t T = x.size(0), D = x.size(1);
  const bool ids32 = local_ids.scalar_type() == at::kInt;
  TORCH_CHECK(local_ids.dim() == 2 && local_ids.size(0) == T && (ids32 || local_ids.scalar_type() == at::kLong) &&
              local_ids.is_contiguous(), "moe: local ids [T, K] int32 or int64 contiguous");
  const int64_t K = local_ids.size(1), S = T * K;
  TORCH_CHECK(topk_w.scalar_type() == at::kFloat && topk_w.is_contiguous() && topk_w.numel() == S,
              "moe: topk weights [T, K] fp32 contiguous");
  TORCH_CHECK(w13p.dim() == 5 && w2p.dim() == 5 && w13p.scalar_type() == at::kBFloat16 &&
              w2p.scalar_type() == at::kBFloat16 && w13p.size(0) == w2p.size(0), "moe: packed bf16 weights");
  const int64_t e = w13p.size(0), F2 = w13p.size(1) * TILE_N, F = F2 / 2;
  TORCH_CHECK(w13p.size(2) * 2 == D && w2p.size(1) * TILE_N == D && w2p.size(2) * 2 == F, "moe: weight shapes");
  TORCH_CHECK(amx_ready(), "moe: this process may not use AMX tiles");
  TORCH_CHECK(K <= MAX_K, "moe: K <= 64");
  const int32_t* id32 = ids32 ? local_ids.data_ptr<int32_t>() : nullptr;
  const int64_t* id64 = ids32 ? nullptr : local_ids.data_ptr<int64_t>();
  auto id = [&](int64_t s) -> int64_t { return ids32 ? id32[s] : id64[s]; };
  const float* wt = topk_w.data_ptr<float>();
  // counting sort by expert; within an expert, slot order (token, k)
  std::vector<int64_t> start(e + 1, 0), order(S);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(id(s) >= -1 && id(s) < e, "moe: local expert id ", id(s), " not in -1..", e - 1);
    if (id(s) >= 0) start[id(s) + 1]++;
  }
  for (int64_t i = 0; i < e; ++i) start[i + 1] += start[i];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t s = 0; s < S; ++s)
      if (id(s) >= 0) order[fill[id(s)]++] = s;
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
    tiles_on();
    for (int64_t t = begin; t < end; ++t) {
      const int64_t ex = tasks[t].first, r0 = tasks[t].second;
      const int64_t m = std::min(BLOCK_M, start[ex + 1] - r0);
      // A tile holds 16 rows: a block is padded to 16, 32, 48 or 64 (the padding's results never read).
      const int64_t mp = (m + 15) / 16 * 16;
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
    tiles_off();
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
  m.def("amx_ready", &amx_ready, "whether this process may use AMX tiles (asks the kernel once)");
  m.def("pack_weights", &pack_weights, "weights [e, N, Kd] to the tile kernel's B layout");
  m.def("moe", &moe, "the MoE call");
}
