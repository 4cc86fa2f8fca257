// The helpers every CPU kernel shares (kernels.cpp: the packed fp32 product and attention; decoder.cpp: the native
// decoder and its quantized products), and kernels.cpp's entry points. Built on first use by
// decode/backends/cpu/kernels.py (AVX2 + FMA; the native decoder adds AVX-512 where the CPU has it).
//
// Exactness: every output element of a product is one fixed sequence of operations that depends only on its own
// row, never on how many rows, tiles or threads compute it: `over_panels` only decides which tile computes which
// rows and panels, and each tile computes its rows alone.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace polyspec {

constexpr int64_t kPanel = 8;  // output columns per panel of the fp32 product: one AVX2 register
constexpr int kTileRows = 4;   // rows per tile, every product

// 4 bytes from any address (a quantized row's inputs lie at any byte): memcpy, which compilers turn into one load
// and which, unlike a cast pointer, neither assumes alignment nor breaks strict aliasing.
static inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A fixed tree over a vector's 8 lanes: their sum, their maximum (a float vector), their sum (int32 lanes).
static inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

static inline int32_t sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

// exp(x) for 8 floats: Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial), ~1 ulp; exactly
// 0 below -87 (a masked score, or one more than 87 below the row's best, contributes nothing, as with -inf).
static inline __m256 exp8(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.0f));
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
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

static inline void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
#if defined(__AVX512F__)
static inline void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
#endif

// A tile's accumulators (MR rows x NP panels of `Lanes` outputs) into y (row stride ldy), only the first `width`
// columns: a product's last panel may be padding, which must not spill into the next sibling's outputs. Inlined
// and unrolled: an accumulator read at a run-time index (or through a call) would live in memory through the tile,
// written back at every step.
template <int64_t Lanes, class V, int MR, int NP>
__attribute__((always_inline)) static inline void store_tile(const V (&acc)[MR][NP], float* y, int64_t ldy,
                                                             int64_t width) {
  alignas(64) float out[NP * Lanes];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    if (width == NP * Lanes) {
#pragma GCC unroll 16
      for (int j = 0; j < NP; ++j) store(y + m * ldy + j * Lanes, acc[m][j]);
      continue;
    }
#pragma GCC unroll 16
    for (int j = 0; j < NP; ++j) store(out + j * Lanes, acc[m][j]);
    for (int64_t j = 0; j < width; ++j) y[m * ldy + j] = out[j];
  }
}

// All M rows against panel p and the NP - 1 after it: tiles of kTileRows rows, then the remainder (the panels stay
// in cache across row tiles). `Tile<MR, NP>::run(row, p, x, w, y, ldy)` computes rows row .. row + MR - 1.
template <template <int, int> class Tile, int NP, class X, class W>
static inline void over_rows(int64_t M, int64_t p, const X& x, const W& w, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + kTileRows <= M; m += kTileRows) Tile<kTileRows, NP>::run(m, p, x, w, y, ldy);
  switch (M - m) {
    case 1: Tile<1, NP>::run(m, p, x, w, y, ldy); break;
    case 2: Tile<2, NP>::run(m, p, x, w, y, ldy); break;
    case 3: Tile<3, NP>::run(m, p, x, w, y, ldy); break;
    default: break;
  }
}

// Every row against each of `panels` panels, threads splitting the panels NP at a time (the last few one by one),
// at least `grain` groups of NP per task.
template <template <int, int> class Tile, int NP, class X, class W>
static void over_panels(int64_t M, int64_t panels, int64_t grain, const X& x, const W& w, float* y, int64_t ldy) {
  at::parallel_for(0, (panels + NP - 1) / NP, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      if ((t + 1) * NP <= panels) {
        over_rows<Tile, NP>(M, t * NP, x, w, y, ldy);
      } else {
        for (int64_t p = t * NP; p < panels; ++p) over_rows<Tile, 1>(M, p, x, w, y, ldy);
      }
    }
  });
}

// A weight packed by `pack`: [P, K, 8] fp32 panels (the last zero-padded) of n outputs.
struct DensePanels {
  const float* data;
  int64_t inputs, count, n;
};

// kernels.cpp
torch::Tensor pack(const torch::Tensor& weight);
void dense_linear(const float* x, int64_t M, const DensePanels& w, float* y, int64_t ldy);
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                     const c10::optional<torch::Tensor>& bias);
double stream_sum(const torch::Tensor& data);
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const c10::optional<torch::Tensor>& mask, double scale, bool causal);

}  // namespace polyspec
