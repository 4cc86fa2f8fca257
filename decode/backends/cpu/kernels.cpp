// The fp32 kernels for decoding with AVX2 + FMA (entry points: kernels.h; vectors: simd.h; tile driver: tiles.h),
// built on first use by decode/backends/cpu/kernels.py into two extensions: alone (kernels_module.cpp), and inside
// the native decoder (decoder_module.cpp).
//
// `linear`: small-M fp32 products, y = x W^T (+ b), with W packed once into 8-column panels (`pack`, pack.cpp).
// Decoding forwards multiply 1-16 rows by weights read from memory once per forward: the product must stream W at
// memory speed whatever the row count. Each tile keeps 4 rows x 3 panels of accumulators in 12 of AVX2's 16
// registers (3 more hold the panels' weights, 1 the broadcast input), so three weight streams run per thread and a
// weight loaded once serves up to 4 rows; 5 or 6 rows (a 4-token draft's verification) run as one tile of 6 x 2.
// Threads split the panels (OpenMP, torch's thread count). The first step of each cache line prefetches the same line
// of the next panels, so memory keeps streaming while a second row tile computes from cache.
//
// `attend` (tensors) and `attend_views` (plain pointers and strides, the native decoder's per layer): attention of a
// few query rows against a KV cache, grouped-query heads read in place, any bool/additive mask or causal. The rows of
// one K/V head share each chunk of 8 keys and values (read once, from L1 for all but the first row); a row scores a
// chunk's 8 keys at once, 8 independent FMA chains.
//
// `stream_sum`: the read-bandwidth probe (infra.timing.read_bandwidth times it), a buffer read once the way a
// memory-bound forward streams its weights: every one of torch's threads sums one contiguous, cache-line aligned chunk
// with the widest loads the build has (AVX-512 in the native decoder's build where the CPU has it, else AVX2), four
// streams at once into 8 independent accumulators, so no load waits on an add.
//
// Exactness: every output element of both is computed by one fixed sequence of operations that depends only
// on its own row (a linear's output: one FMA chain over k = 0..K-1 from zero, bias after; an attention row:
// its scores, softmax and weighted sum), never on how many rows, tiles or threads compute it. With them a
// model's forward of k tokens gives, row for row, the bits of k one-token forwards: a verification sees
// exactly the logits plain decoding would.
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "pack.h"
#include "simd.h"
#include "tiles.h"

namespace polyspec {

constexpr int kPanels = 3;  // panels per tile: 4 x 3 accumulators + 3 weights + 1 broadcast = 16 registers
constexpr int kTallRows = 6;  // 5-6 rows: one tile of them all, 6 x 2 accumulators + 2 weights + 1 broadcast
constexpr int kTallPanels = 2;

// Rows row .. row + MR - 1 of x [M, K] against NP panels from panel p: one FMA chain per output over k. A panel's cache
// line holds kLineSteps inputs: only the first of them asks for lines ahead. A request is a load, and with one every
// input a 4-row step (3 weights, 4 broadcast inputs, 6 requests) waits on the load ports, not on its 12 FMAs
// (BENCHMARKS.md, "fp32 tiles").
template <int MR, int NP>
struct DenseTile {
  static constexpr int64_t kLineSteps = kLineBytes / (kPanel * static_cast<int64_t>(sizeof(float)));

  template <bool Ask>
  __attribute__((always_inline)) static inline void step(int64_t row, int64_t k, int64_t K, const float* x,
                                                         const float* w, __m256 (&acc)[MR][NP]) {
    __m256 wk[NP];
#pragma GCC unroll 16
    for (int j = 0; j < NP; ++j) {
      wk[j] = _mm256_loadu_ps(w + (j * K + k) * kPanel);
      if (Ask) {
        _mm_prefetch(reinterpret_cast<const char*>(w + ((NP + j) * K + k) * kPanel), _MM_HINT_T1);
        if (row == 0)  // the first row tile streams: its own panels kAheadBytes ahead too (tiles.h)
          _mm_prefetch(reinterpret_cast<const char*>(w + (j * K + k) * kPanel) + kAheadBytes, _MM_HINT_T1);
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m256 xk = _mm256_broadcast_ss(x + m * K + k);
#pragma GCC unroll 16
      for (int j = 0; j < NP; ++j) acc[m][j] = _mm256_fmadd_ps(xk, wk[j], acc[m][j]);
    }
  }

  static void run(int64_t row, int64_t p, const float* x, const DensePanels& panels, float* y, int64_t ldy) {
    const int64_t K = panels.inputs;
    const float* w = panels.data + p * K * kPanel;
    x += row * K;
    __m256 acc[MR][NP];
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
      for (int j = 0; j < NP; ++j) acc[m][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + kLineSteps <= K; k += kLineSteps) {  // a panel starting mid-line (odd K) still asks once a line
      step<true>(row, k, K, x, w, acc);
#pragma GCC unroll 16
      for (int64_t s = 1; s < kLineSteps; ++s) step<false>(row, k + s, K, x, w, acc);
    }
    for (; k < K; ++k) step<true>(row, k, K, x, w, acc);
    store_tile<kPanel>(acc, y + row * ldy + p * kPanel, ldy, std::min<int64_t>(NP * kPanel, panels.n - p * kPanel));
  }
};

// y[:, :w.n] (row stride ldy) = x [M, K] W^T; threads take at least ~64k multiply-adds each.
void dense_linear(const float* x, int64_t M, const DensePanels& w, float* y, int64_t ldy) {
  const auto grain = [&](int64_t panels) {
    return std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, M * w.inputs * panels * kPanel));
  };
  // 5-6 rows as a 4-row tile and then a 1-2 row one cost what 8 rows do: the second tile computes from cache while
  // memory idles. One tile of them all loads each weight once; beyond 6 rows, 6-row tiles gain nothing over 4-row
  // ones (BENCHMARKS.md, "5-6 rows as one 6 x 2 tile").
  if (M > kTileRows && M <= kTallRows) {
    over_panels<DenseTile, kTallPanels, kTallRows>(M, w.count, grain(kTallPanels), x, w, y, ldy);
  } else {
    over_panels<DenseTile, kPanels>(M, w.count, grain(kPanels), x, w, y, ldy);
  }
}

// x [M, K] float32, panels from `pack`, n = W's row count; returns [M, n].
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                     const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && panels.dim() == 3 && panels.size(1) == x.size(1) &&
              panels.scalar_type() == torch::kFloat && panels.is_contiguous() && n <= panels.size(0) * kPanel,
              "linear: x [M, K] float32 and panels [P, K, 8]");
  const auto input = x.contiguous();
  auto y = torch::empty({input.size(0), n}, input.options());
  dense_linear(input.data_ptr<float>(), input.size(0), {panels.data_ptr<float>(), input.size(1), panels.size(0), n},
               y.data_ptr<float>(), n);
  if (bias.has_value()) y.add_(*bias);
  return y;
}

constexpr int64_t kKeys = 8;        // keys per chunk: one score vector, the keys and values a block of rows shares
constexpr int64_t kMaxRows = 8;     // query rows of one K/V head per block, at most
constexpr int64_t kAheadKeys = 32;  // keys (and values) requested ahead of the chunk being read: 4 chunks

// The dot products of q with keys j0 .. j0 + 7 (keys past `last` read as key `last`, never out of bounds): per key one
// FMA chain over the head dim, then a fixed tree over its 8 lanes, so a key's score does not depend on its chunk.
static inline __m256 dots8(const float* q, const float* k, int64_t stride, int64_t j0, int64_t last, int64_t DV) {
  const float* kj[kKeys];
  for (int64_t e = 0; e < kKeys; ++e) kj[e] = k + std::min(j0 + e, last) * stride;
  __m256 a[kKeys];
  const __m256 q0 = _mm256_loadu_ps(q);
#pragma GCC unroll 8
  for (int e = 0; e < kKeys; ++e) a[e] = _mm256_mul_ps(q0, _mm256_loadu_ps(kj[e]));
  for (int64_t d = 1; d < DV; ++d) {
    const __m256 qd = _mm256_loadu_ps(q + 8 * d);
#pragma GCC unroll 8
    for (int e = 0; e < kKeys; ++e) a[e] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kj[e] + 8 * d), a[e]);
  }
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// out[0 .. 8W) += p[j] * v_j[0 .. 8W) over `count` keys in order, zero weights skipped, and returns total + the sum
// of those p[j] in the same order: one FMA chain per element and one sum, continued across chunks (in registers
// within one).
template <int W>
static inline float weighted(const float* p, int64_t count, const float* v, int64_t stride, float* out, float total) {
  __m256 acc[W];
#pragma GCC unroll 8
  for (int e = 0; e < W; ++e) acc[e] = _mm256_load_ps(out + 8 * e);
  __m256 sum = _mm256_set1_ps(total);
  for (int64_t j = 0; j < count; ++j) {
    if (p[j] == 0.f) continue;
    const __m256 pj = _mm256_set1_ps(p[j]);
    sum = _mm256_add_ps(sum, pj);
#pragma GCC unroll 8
    for (int e = 0; e < W; ++e) acc[e] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * stride + 8 * e), acc[e]);
  }
#pragma GCC unroll 8
  for (int e = 0; e < W; ++e) _mm256_store_ps(out + 8 * e, acc[e]);
  return _mm256_cvtss_f32(sum);
}

// One query row of a task: where it reads and writes, the keys it sees ([0, span) minus what its mask removes).
struct QueryRow {
  const float* q;
  const bool* allowed;  // bool mask row or null
  const float* bias;    // additive mask row or null
  float* out;
  int64_t span;
};

// Requests the kKeys rows of `width` floats from `first` (row stride `stride`) into L2, a line at a time: a thread
// reads one head's keys (then values) as a single stream, which on its own leaves memory idle (as a product's would).
static inline void prefetch_chunk(const float* first, int64_t stride, int64_t width) {
  for (int64_t e = 0; e < kKeys; ++e)
    for (int64_t d = 0; d < width; d += 16)
      _mm_prefetch(reinterpret_cast<const char*>(first + e * stride + d), _MM_HINT_T1);
}

// What a row's mask adds to the scores of keys j0 .. j0 + 7: its additive mask, or -inf where the key is hidden or
// past the row's span (0 for a causal row's whole chunks: the same sum, scores unchanged).
static inline __m256 mask8(const QueryRow& r, int64_t j0, int64_t mask_stride) {
  if (!r.allowed && !r.bias && j0 + kKeys <= r.span) return _mm256_setzero_ps();
  alignas(32) float add[kKeys];
  for (int64_t e = 0; e < kKeys; ++e) {
    const int64_t j = j0 + e;
    const bool seen = j < r.span && (!r.allowed || r.allowed[j * mask_stride]);
    add[e] = !seen ? -std::numeric_limits<float>::infinity() : r.bias ? r.bias[j * mask_stride] : 0.f;
  }
  return _mm256_load_ps(add);
}

// Scores of `n` rows against keys [0, max span) of one K/V head into s [n, ld] (ld >= the span rounded up to 8),
// chunk by chunk (a chunk's keys are read once for all rows), softcapped where `softcap` > 0 (Gemma 2: before the
// mask), then each row's softmax numerators in place (-inf scores giving exactly 0).
static void numerators(const QueryRow* rows, int64_t n, const float* k, int64_t stride, int64_t DV, float scale,
                       float softcap, int64_t mask_stride, float* s, int64_t ld) {
  const __m256 vscale = _mm256_set1_ps(scale);
  int64_t most = 0;
  for (int64_t i = 0; i < n; ++i) most = std::max(most, rows[i].span);
  __m256 best[kMaxRows];
  for (int64_t i = 0; i < n; ++i) best[i] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = 0; j0 < most; j0 += kKeys) {
    if (j0 + kAheadKeys < most) prefetch_chunk(k + (j0 + kAheadKeys) * stride, stride, 8 * DV);
    for (int64_t i = 0; i < n; ++i) {
      if (j0 >= rows[i].span) continue;
      const __m256 dot = dots8(rows[i].q, k, stride, j0, rows[i].span - 1, DV);
      const __m256 scaled = _mm256_mul_ps(dot, vscale);
      const __m256 score = _mm256_add_ps(softcap > 0.f ? softcap8(scaled, softcap) : scaled,
                                         mask8(rows[i], j0, mask_stride));
      _mm256_storeu_ps(s + i * ld + j0, score);
      best[i] = _mm256_max_ps(best[i], score);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    float* si = s + i * ld;
    const float top = max8(best[i]);
    if (top == -std::numeric_limits<float>::infinity()) { std::fill(si, si + rows[i].span, 0.f); continue; }
    for (int64_t j0 = 0; j0 < rows[i].span; j0 += kKeys)
      _mm256_storeu_ps(si + j0, exp8(_mm256_sub_ps(_mm256_loadu_ps(si + j0), _mm256_set1_ps(top))));
  }
}

// Each row's weighted sum of the values, chunk by chunk (a chunk's values read once for all rows), divided by the
// sum of its weights into the row's output. Both sums run in key order over the keys that count, so a key's place
// (a tree's hole before it, or none) does not change them.
static void weighted_rows(const QueryRow* rows, int64_t n, const float* v, int64_t stride, int64_t ld, int64_t D,
                          const float* s) {
  alignas(32) float acc[kMaxRows][256];
  float total[kMaxRows];
  int64_t most = 0;
  for (int64_t i = 0; i < n; ++i) {
    most = std::max(most, rows[i].span);
    std::fill(acc[i], acc[i] + D, 0.f);
    total[i] = 0.f;
  }
  for (int64_t j0 = 0; j0 < most; j0 += kKeys) {
    if (j0 + kAheadKeys < most) prefetch_chunk(v + (j0 + kAheadKeys) * stride, stride, D);
    for (int64_t i = 0; i < n; ++i) {
      if (j0 >= rows[i].span) continue;
      const int64_t count = std::min(kKeys, rows[i].span - j0);
      const float* p = s + i * ld + j0;
      const float* vj = v + j0 * stride;
      const float before = total[i];  // every slice sums the same weights: any one's total will do
      int64_t d = 0;
      for (; d + 64 <= D; d += 64) total[i] = weighted<8>(p, count, vj + d, stride, acc[i] + d, before);
      for (; d + 16 <= D; d += 16) total[i] = weighted<2>(p, count, vj + d, stride, acc[i] + d, before);
      for (; d < D; d += 8) total[i] = weighted<1>(p, count, vj + d, stride, acc[i] + d, before);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const __m256 nv = _mm256_set1_ps(total[i] > 0.f ? 1.f / total[i] : 0.f);
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(rows[i].out + d, _mm256_mul_ps(_mm256_load_ps(acc[i] + d), nv));
  }
}

void check_heads(int64_t head_dim, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(head_dim % 8 == 0 && head_dim <= 256 && kv_heads > 0 && heads % kv_heads == 0,
              "attention takes head dims that are multiples of 8 up to 256, query heads a multiple of K/V heads");
}

void set_mask(Attention& a, const c10::optional<torch::Tensor>& mask, torch::Tensor& expanded) {
  a.mask = {nullptr, 0, 0, 0, 0};
  a.mask_is_bool = false;
  if (!mask.has_value()) return;
  expanded = mask->expand({a.B, a.Hq, a.T, a.L});
  a.mask_is_bool = expanded.scalar_type() == torch::kBool;
  TORCH_CHECK(a.mask_is_bool || expanded.scalar_type() == torch::kFloat, "attend: a bool or float32 mask");
  a.mask = {expanded.data_ptr(), expanded.stride(0), expanded.stride(1), expanded.stride(2), expanded.stride(3)};
}

// The attention of `a` (kernels.h), causal where asked (used without a mask: query t sees keys j <= L - T + t).
// Each (b, head, t) row is computed alone, in one fixed order over the keys it can see: its bits do not depend on L
// beyond them, on the other rows, or on the threads. Every thread takes an equal share of the rows (K/V head by K/V
// head), in blocks of at most kMaxRows rows of one head. Plain pointers: the native decoder calls it once a layer.
void attend_views(const Attention& a, double scale, bool causal) {
  const int64_t groups = a.Hq / a.Hkv, T = a.T, L = a.L;
  const bool has_mask = a.mask.data != nullptr;
  const float* qd = static_cast<const float*>(a.q.data);
  const float* kd = static_cast<const float*>(a.k.data);
  const float* vd = static_cast<const float*>(a.v.data);
  const int64_t rows = groups * T, all = a.B * a.Hkv * rows;  // `rows` query rows read each K/V head
  const int64_t shares = std::min<int64_t>(at::get_num_threads(), all);
  const int64_t ld = (L + kKeys - 1) / kKeys * kKeys;  // a row of scores, whole chunks
  at::parallel_for(0, shares, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> s(kMaxRows * ld);
    for (int64_t r = all * lo / shares, end = all * hi / shares; r < end;) {
      const int64_t head = r / rows, first = r % rows, n = std::min({kMaxRows, rows - first, end - r});
      const int64_t b = head / a.Hkv, kh = head % a.Hkv;
      r += n;
      QueryRow block[kMaxRows];
      for (int64_t i = 0; i < n; ++i) {
        const int64_t h = kh * groups + (first + i) / T, t = (first + i) % T;
        const int64_t mo = b * a.mask.batch + h * a.mask.head + t * a.mask.row;
        block[i] = {qd + b * a.q.batch + h * a.q.head + t * a.q.row,
                    has_mask && a.mask_is_bool ? static_cast<const bool*>(a.mask.data) + mo : nullptr,
                    has_mask && !a.mask_is_bool ? static_cast<const float*>(a.mask.data) + mo : nullptr,
                    a.out + ((b * T + t) * a.Hq + h) * a.D, (causal && !has_mask) ? L - T + t + 1 : L};
      }
      numerators(block, n, kd + b * a.k.batch + kh * a.k.head, a.k.row, a.D / 8, static_cast<float>(scale),
                 a.softcap, a.mask.column, s.data(), ld);
      weighted_rows(block, n, vd + b * a.v.batch + kh * a.v.head, a.v.row, ld, a.D, s.data());
    }
  });
}

// q [B, Hq, T, D], k/v [B, Hkv, L, D] (unit stride in D), mask: none, bool (true = attend) or additive float,
// broadcastable to [B, Hq, T, L]; causal (used without a mask); softcap > 0: scores capped at +-softcap (tanh).
// Returns [B, T, Hq, D] (attend_views).
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const c10::optional<torch::Tensor>& mask, double scale, bool causal, double softcap) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attend: 4-D q, k, v");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat,
              "attend: float32 q, k, v");
  check_heads(D, Hq, Hkv);
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "attend: unit stride in the head dim");
  auto out = torch::empty({B, T, Hq, D}, q.options());
  Attention a{{q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), 1},
              {k.data_ptr(), k.stride(0), k.stride(1), k.stride(2), 1},
              {v.data_ptr(), v.stride(0), v.stride(1), v.stride(2), 1},
              {},
              false,
              out.data_ptr<float>(),
              B, Hq, Hkv, T, L, D,
              static_cast<float>(softcap)};
  torch::Tensor expanded;
  set_mask(a, mask, expanded);
  attend_views(a, scale, causal);
  return out;
}

// The sum of a contiguous float32 CPU tensor (64-byte aligned, as torch allocates) in the build's widest vectors
// (Vec, simd.h), each lane and chunk summed in float32: exact where those partial sums are (small integers). A thread
// reads its chunk as kStreams quarters side by side, as the packed product reads several panels at once: one
// sequential stream per core leaves memory idle on some hosts (its prefetcher runs too few lines ahead).
double stream_sum(const torch::Tensor& data) {
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == torch::kFloat && data.is_contiguous() &&
              reinterpret_cast<uintptr_t>(data.data_ptr()) % 64 == 0,
              "stream_sum: a contiguous, 64-byte aligned float32 CPU tensor");
  constexpr int64_t kStreams = 4, kPer = 2, kLine = 16, kStep = kPer * kLanes;  // a stream's floats per step
  const float* p = data.data_ptr<float>();
  const int64_t n = data.numel(), threads = at::get_num_threads();
  std::vector<double> partial(threads, 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t begin = n * t / threads / kLine * kLine;
      const int64_t end = t + 1 == threads ? n : n * (t + 1) / threads / kLine * kLine;
      const int64_t quarter = (end - begin) / kStreams / kStep * kStep;
      Vec acc[kStreams][kPer];
#pragma GCC unroll 8
      for (int s = 0; s < kStreams; ++s)
#pragma GCC unroll 8
        for (int a = 0; a < kPer; ++a) acc[s][a] = vzero();
      for (int64_t i = begin; i < begin + quarter; i += kStep) {
#pragma GCC unroll 8
        for (int s = 0; s < kStreams; ++s)
#pragma GCC unroll 8
          for (int a = 0; a < kPer; ++a) acc[s][a] = vadd(acc[s][a], vload_aligned(p + i + s * quarter + a * kLanes));
      }
      double sum = 0.0;
      for (int64_t i = begin + kStreams * quarter; i < end; ++i) sum += p[i];
      alignas(64) float lanes[kLanes];
      for (int s = 0; s < kStreams; ++s)
        for (int a = 0; a < kPer; ++a) {
          store(lanes, acc[s][a]);
          for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
        }
      partial[t] = sum;
    }
  });
  double total = 0.0;
  for (const double s : partial) total += s;
  return total;
}

}  // namespace polyspec
