// Small-M fp32 products for CPU inference, y = x W^T (+ b), with W packed once into 8-column panels.
//
// Decoding forwards multiply 1-16 rows by weights read from memory once per forward: the product must stream
// W at memory speed whatever the row count. Each tile keeps 4 rows x 3 panels of accumulators in 12 of AVX2's
// 16 registers (3 more hold the panels' weights, 1 the broadcast input), so three weight streams run per thread
// and a weight loaded once serves up to 4 rows. Threads split the panels (OpenMP, torch's thread count).
//
// Exactness: every output element is one FMA chain over k = 0..K-1, started from zero, whatever the row count,
// the tiling or the thread count; the bias is added after. A row's result never depends on how many rows are
// computed with it, so a verification of k tokens gives the target's 1-token logits bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

constexpr int64_t kPanel = 8;   // output columns per panel: one AVX register
constexpr int kRows = 4;        // rows per tile
constexpr int kPanels = 3;      // panels per tile: 4 x 3 accumulators + 3 weights + 1 broadcast = 16 registers

// W [N, K] -> panels [ceil(N / 8), K, 8], the last one zero-padded.
torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat, "pack: a 2-D float32 weight");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

template <int MR, int NP>
static inline void tile(const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
  __m256 acc[MR][NP];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int j = 0; j < NP; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wk[NP];
#pragma GCC unroll 16
    for (int j = 0; j < NP; ++j) wk[j] = _mm256_loadu_ps(w + (j * K + k) * kPanel);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m256 xk = _mm256_broadcast_ss(x + m * K + k);
#pragma GCC unroll 16
      for (int j = 0; j < NP; ++j) acc[m][j] = _mm256_fmadd_ps(xk, wk[j], acc[m][j]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int j = 0; j < NP; ++j) _mm256_storeu_ps(y + m * ldy + j * kPanel, acc[m][j]);
}

// All M rows against NP consecutive panels (the panels stay in cache across row tiles).
template <int NP>
static void rows(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile<kRows, NP>(x + m * K, K, w, y + m * ldy, ldy);
  switch (M - m) {
    case 1: tile<1, NP>(x + m * K, K, w, y + m * ldy, ldy); break;
    case 2: tile<2, NP>(x + m * K, K, w, y + m * ldy, ldy); break;
    case 3: tile<3, NP>(x + m * K, K, w, y + m * ldy, ldy); break;
    default: break;
  }
}

// x [M, K] float32, panels from `pack`, n = W's row count; returns [M, n].
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t n, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && panels.dim() == 3 && panels.size(1) == x.size(1),
              "linear: x [M, K] float32 and panels [P, K, 8]");
  const auto input = x.contiguous();
  const int64_t M = input.size(0), K = input.size(1), P = panels.size(0), ldy = P * kPanel;
  auto y = torch::empty({M, ldy}, input.options());
  const float* xp = input.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t groups = (P + kPanels - 1) / kPanels;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, M * K * kPanels * kPanel));
  at::parallel_for(0, groups, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t g = lo; g < hi; ++g) {
      const int64_t first = g * kPanels;
      if (first + kPanels <= P) {
        rows<kPanels>(xp, M, K, wp + first * K * kPanel, yp + first * kPanel, ldy);
      } else {
        for (int64_t j = first; j < P; ++j) rows<1>(xp, M, K, wp + j * K * kPanel, yp + j * kPanel, ldy);
      }
    }
  });
  if (ldy != n) y = y.narrow(1, 0, n).contiguous();
  if (bias.has_value()) y.add_(*bias);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "W [N, K] -> 8-column panels");
  m.def("linear", &linear, "x W^T (+ b) through packed panels");
}
