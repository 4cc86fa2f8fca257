// CPU kernels for decoding with AVX2 + FMA, built on first use by decode/backends/cpu/kernels.py.
//
// `linear`: small-M fp32 products, y = x W^T (+ b), with W packed once into 8-column panels. Decoding forwards
// multiply 1-16 rows by weights read from memory once per forward: the product must stream W at memory speed
// whatever the row count. Each tile keeps 4 rows x 3 panels of accumulators in 12 of AVX2's 16 registers (3
// more hold the panels' weights, 1 the broadcast input), so three weight streams run per thread and a weight
// loaded once serves up to 4 rows. Threads split the panels (OpenMP, torch's thread count).
//
// `attend`: attention of a few query rows against a KV cache, grouped-query heads read in place, any
// bool/additive mask or causal. Rows of one K/V head share each key load; a row sums its weighted values in registers.
//
// Exactness: every output element of both is computed by one fixed sequence of operations that depends only
// on its own row (a linear's output: one FMA chain over k = 0..K-1 from zero, bias after; an attention row:
// its scores, softmax and weighted sum), never on how many rows, tiles or threads compute it. With them a
// model's forward of k tokens gives, row for row, the bits of k one-token forwards: a verification sees
// exactly the logits plain decoding would.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

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

// exp(x) for 8 floats: Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial), ~1 ulp; exactly
// 0 below -87 (a masked score, or one more than 87 below the row's best, contributes nothing, as with -inf).
static inline __m256 exp8(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.0f));
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(n)), keep);
}

constexpr int64_t kBlock = 8;  // query rows of one K/V head that share each key and value load

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[0 .. 8W) = sum over keys j (in order, zero weights skipped) of p[j] * v_j[0 .. 8W): one FMA chain per element,
// its W accumulators in registers across the keys.
template <int W>
static inline void weighted(const float* p, int64_t L, const float* v, int64_t stride, float* out) {
  __m256 acc[W];
#pragma GCC unroll 8
  for (int e = 0; e < W; ++e) acc[e] = _mm256_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    if (p[j] == 0.f) continue;
    const __m256 pj = _mm256_set1_ps(p[j]);
#pragma GCC unroll 8
    for (int e = 0; e < W; ++e) acc[e] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * stride + 8 * e), acc[e]);
  }
#pragma GCC unroll 8
  for (int e = 0; e < W; ++e) _mm256_store_ps(out + 8 * e, acc[e]);
}

// q [B, Hq, T, D], k/v [B, Hkv, L, D] (unit stride in D), mask: none, bool (true = attend) or additive float,
// broadcastable to [B, Hq, T, L]; causal (used without a mask): query t sees keys j <= L - T + t.
// Returns [B, T, Hq, D]. Each (b, head, t) row is computed alone, in one fixed order.
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const c10::optional<torch::Tensor>& mask, double scale, bool causal) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attend: 4-D q, k, v");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat,
              "attend: float32 q, k, v");
  TORCH_CHECK(D % 8 == 0 && D <= 256 && Hkv > 0 && Hq % Hkv == 0 && q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "attend: head dim a multiple of 8 up to 256, query heads a multiple of K/V heads, unit stride");
  const int64_t groups = Hq / Hkv, DV = D / 8;
  auto out = torch::empty({B, T, Hq, D}, q.options());
  torch::Tensor m;
  const bool has_mask = mask.has_value();
  bool is_bool = false;
  if (has_mask) {
    m = mask->expand({B, Hq, T, L});
    is_bool = m.scalar_type() == torch::kBool;
    TORCH_CHECK(is_bool || m.scalar_type() == torch::kFloat, "attend: a bool or float32 mask");
  }
  const float fscale = static_cast<float>(scale);
  const float* qd = q.data_ptr<float>(); const float* kd = k.data_ptr<float>(); const float* vd = v.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const int64_t rows = groups * T;                 // query rows that read one K/V head
  const int64_t blocks = (rows + kBlock - 1) / kBlock;
  at::parallel_for(0, B * Hkv * blocks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> s(kBlock * L);
    alignas(32) float acc[kBlock][256];
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t b = task / (Hkv * blocks), kh = (task / blocks) % Hkv, first = (task % blocks) * kBlock;
      const int64_t n = std::min<int64_t>(kBlock, rows - first);
      const float* kp = kd + b * k.stride(0) + kh * k.stride(1);
      const float* vp = vd + b * v.stride(0) + kh * v.stride(1);
      const float* qp[kBlock]; const bool* mb[kBlock]; const float* mf[kBlock]; int64_t visible[kBlock], hs[kBlock], ts[kBlock];
      for (int64_t i = 0; i < n; ++i) {
        const int64_t h = kh * groups + (first + i) / T, t = (first + i) % T;
        hs[i] = h; ts[i] = t;
        qp[i] = qd + b * q.stride(0) + h * q.stride(1) + t * q.stride(2);
        visible[i] = (causal && !has_mask) ? L - T + t + 1 : L;
        const int64_t mo = has_mask ? b * m.stride(0) + h * m.stride(1) + t * m.stride(2) : 0;
        mb[i] = has_mask && is_bool ? m.data_ptr<bool>() + mo : nullptr;
        mf[i] = has_mask && !is_bool ? m.data_ptr<float>() + mo : nullptr;
      }
      const int64_t ms = has_mask ? m.stride(3) : 0;
      const float neg = -std::numeric_limits<float>::infinity();
      float best[kBlock];
      for (int64_t i = 0; i < n; ++i) best[i] = neg;
      for (int64_t j = 0; j < L; ++j) {                 // scores: k_j loaded once for the block's rows
        const float* kj = kp + j * k.stride(2);
        for (int64_t i = 0; i < n; ++i) {
          float score = neg;
          if (j < visible[i] && (!mb[i] || mb[i][j * ms])) {
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qp[i]), _mm256_loadu_ps(kj));
            for (int64_t d = 1; d < DV; ++d) a = _mm256_fmadd_ps(_mm256_loadu_ps(qp[i] + 8 * d), _mm256_loadu_ps(kj + 8 * d), a);
            score = hsum(a) * fscale + (mf[i] ? mf[i][j * ms] : 0.f);
          }
          s[i * L + j] = score;
          best[i] = std::max(best[i], score);
        }
      }
      float norm[kBlock];
      for (int64_t i = 0; i < n; ++i) {                 // softmax numerators, one row at a time
        float* si = &s[i * L];
        if (best[i] == neg) { norm[i] = 0.f; for (int64_t j = 0; j < L; ++j) si[j] = 0.f; continue; }
        const __m256 top = _mm256_set1_ps(best[i]);
        for (int64_t j = 0; j < L; j += 8) {            // elementwise: a key's value does not depend on its lane
          alignas(32) float chunk[8];
          const int64_t w = std::min<int64_t>(8, L - j);
          for (int64_t e = 0; e < 8; ++e) chunk[e] = e < w ? si[j + e] : neg;
          _mm256_store_ps(chunk, exp8(_mm256_sub_ps(_mm256_load_ps(chunk), top)));
          for (int64_t e = 0; e < w; ++e) si[j + e] = chunk[e];
        }
        float total = 0.f;                              // in key order over the keys that count, like the weighted sum
        for (int64_t j = 0; j < L; ++j) if (si[j] != 0.f) total += si[j];
        norm[i] = 1.f / total;
      }
      for (int64_t i = 0; i < n; ++i) {                 // weighted values: a row's slice of accumulators in registers
        int64_t d = 0;
        for (; d + 8 <= DV; d += 8) weighted<8>(&s[i * L], L, vp + 8 * d, v.stride(2), acc[i] + 8 * d);
        for (; d + 2 <= DV; d += 2) weighted<2>(&s[i * L], L, vp + 8 * d, v.stride(2), acc[i] + 8 * d);
        for (; d < DV; ++d) weighted<1>(&s[i * L], L, vp + 8 * d, v.stride(2), acc[i] + 8 * d);
      }
      for (int64_t i = 0; i < n; ++i) {
        float* op = od + ((b * T + ts[i]) * Hq + hs[i]) * D;
        const __m256 nv = _mm256_set1_ps(norm[i]);
        for (int64_t d = 0; d < DV; ++d) _mm256_storeu_ps(op + 8 * d, _mm256_mul_ps(_mm256_load_ps(acc[i] + 8 * d), nv));
      }
    }
  });
  return out;
}

#ifndef POLYSPEC_KERNELS_NO_MODULE  // set by a file that #includes these kernels into its own extension
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "W [N, K] -> 8-column panels");
  m.def("linear", &linear, "x W^T (+ b) through packed panels");
  m.def("attend", &attend, "attention of query rows against K/V heads, [B, T, Hq, D] out");
}
#endif
