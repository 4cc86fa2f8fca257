// The decoder's per-row layers: RMS norm, rotary embedding, the residual add and the MLP's SiLU gate. Each works
// row by row, so a forward of k tokens gives, row for row, the bits of k one-token forwards.
#pragma once

#include <torch/types.h>

#include <cmath>
#include <cstdint>

#include "simd.h"

namespace polyspec {

// HF's LlamaRMSNorm in fp32: x * rsqrt(mean(x^2) + eps) * weight, one row at a time (its squares summed per lane).
static inline void rms_norm(const float* x, int64_t M, int64_t H, const float* weight, float eps, float* y) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * H;
    __m256 squares = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= H; i += 8) squares = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(xr + i), squares);
    float sum = sum8(squares);
    for (; i < H; ++i) sum += xr[i] * xr[i];
    const float r = 1.f / std::sqrt(sum / static_cast<float>(H) + eps);
    for (int64_t i = 0; i < H; ++i) y[m * H + i] = weight[i] * (xr[i] * r);
  }
}

// Rotary embedding of `heads` heads of one row in place (rotate-half form), cos/sin rows of the position.
static inline void rotate(float* x, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

static inline void add(const torch::Tensor& from, torch::Tensor& into) {  // into += from, both contiguous float32
  const float* f = from.data_ptr<float>();
  float* t = into.data_ptr<float>();
  for (int64_t i = 0; i < into.numel(); ++i) t[i] += f[i];
}

// silu(gate) * up of T rows [gate | up] (N columns each: gate the first N / 2), into the first N / 2 columns of each
// row's space (row stride N / 2), in place.
static inline void silu_gate(float* wide, int64_t T, int64_t N) {
  const int64_t I = N / 2;
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (int64_t t = 0; t < T; ++t) {
    const float* g = wide + t * N;
    float* a = wide + t * I;  // row t's output lies at or before its input: safe in this order
    int64_t j = 0;
    for (; j + 8 <= I; j += 8) {
      const __m256 gj = _mm256_loadu_ps(g + j);
      const __m256 silu = _mm256_div_ps(gj, _mm256_add_ps(one, exp8(_mm256_xor_ps(gj, sign))));
      _mm256_storeu_ps(a + j, _mm256_mul_ps(silu, _mm256_loadu_ps(g + I + j)));
    }
    for (; j < I; ++j) { const float gj = g[j], uj = g[I + j]; a[j] = gj / (1.f + std::exp(-gj)) * uj; }
  }
}

}  // namespace polyspec
