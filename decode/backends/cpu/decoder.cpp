// A Llama-family decoder, whole forward in one call, for two kinds of weights: fp32 (kernels.cpp's packed panels:
// a chain's target) and GPTQ int4 (a W4 copy). Built on first use by decode/backends/cpu/llama.py
// (decode.backends.cpu.kernels.build_extension).
//
// Eager PyTorch spends much of a small model's forward outside its weights: thousands of small aten ops per forward
// (norms, rotary, cache concatenation, casts, act-order gathers). Here a forward is one call: the layers loop in C++
// over buffers allocated once per call, keys and values go into a preallocated cache (rollback is setting a length,
// done by the caller), and every linear is `packed_linear`, which takes either kind: one layer loop for both.
//
// fp32 weights run kernels.cpp's product (one FMA chain per output over the inputs from zero, bias after).
// int4 weights on fp32 activations (w4_activations: fp32; the default int8 path is below, at the int8 tiles):
// y = x W^T with W = (q - 8) * s (4-bit codes q, one scale s per output and group of inputs,
// symmetric like GPTQModel's CPU kernel). The codes of one panel of kLanes outputs at input k are one word
// (AVX2: 8 nibbles in a uint32; AVX-512: 16 in a uint64, even lanes in the low half); a weight is dequantized
// in registers as it streams, (q * s - 8 s) in one FMA, exactly (q - 8) * s in fp32. Each output is then one FMA
// chain over the (act-order sorted) inputs from zero, as in kernels.cpp's `linear`: the bits of a row do not
// depend on how many rows or threads compute it, and equal the fp32 product with the dequantized weight.
// Attention is kernels.cpp's `attend` on views of the cache (row-exact, grouped heads read in place); tiles, the
// tile driver and the lane reductions are kernels.h's. Norms, rotary and SiLU work row by row: a forward of k
// tokens gives, row for row, the bits of k one-token forwards.
#include "kernels.h"

#if defined(__AVX512F__) && !(defined(__AVX512BW__) && defined(__AVX512VNNI__))
#error "the AVX-512 build needs AVX512-BW and AVX512-VNNI (-mavx512bw -mavx512vnni); build for AVX2 otherwise"
#endif

namespace polyspec {
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Code = uint64_t;
#else
constexpr int64_t kLanes = 8;
using Code = uint32_t;
#endif
// panels per tile: AVX-512 has 32 registers (4 x 4 accumulators, 4 weights, 8 scales, input, shift, mask),
// AVX2 16 (4 x 2 accumulators, 2 weights, input, shift, mask; scales spill to the stack, read once a group)
constexpr int kTilePanels = kLanes == 16 ? 4 : 2;

// codes [N, K] (0..15, inputs in their kernel order), scales [N, G] -> (words [P, K], scales [P, G, kLanes]),
// P = ceil(N / kLanes), padded outputs with code 8 and scale 0.
std::vector<torch::Tensor> pack_int4(const torch::Tensor& codes, const torch::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && scales.dim() == 2 && codes.size(0) == scales.size(0),
              "pack_int4: codes [N, K], scales [N, G]");
  const int64_t n = codes.size(0), k = codes.size(1), g = scales.size(1), panels = (n + kLanes - 1) / kLanes;
  auto c = codes.to(torch::kLong).contiguous();
  auto s = scales.to(torch::kFloat).contiguous();
  auto words = torch::zeros({panels, k}, torch::kLong);
  auto packed_scales = torch::zeros({panels, g, kLanes}, torch::kFloat);
  auto wp = words.data_ptr<int64_t>();
  auto sp = packed_scales.data_ptr<float>();
  const int64_t* cp = c.data_ptr<int64_t>();
  const float* ssrc = s.data_ptr<float>();
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const int64_t col = p * kLanes + lane;
      const int64_t shift = kLanes == 16 ? (lane % 2) * 32 + (lane / 2) * 4 : lane * 4;
      for (int64_t i = 0; i < k; ++i) wp[p * k + i] |= static_cast<int64_t>(col < n ? cp[col * k + i] : 8) << shift;
      for (int64_t j = 0; j < g && col < n; ++j) sp[(p * g + j) * kLanes + lane] = ssrc[col * g + j];
    }
  return {kLanes == 16 ? words : words.to(torch::kInt), packed_scales};
}

#if defined(__AVX512F__)
using Vec = __m512;
static inline Vec vzero() { return _mm512_setzero_ps(); }
static inline Vec vset(float v) { return _mm512_set1_ps(v); }
static inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline Vec vfmsub(Vec a, Vec b, Vec c) { return _mm512_fmsub_ps(a, b, c); }
static inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
#else
using Vec = __m256;
static inline Vec vzero() { return _mm256_setzero_ps(); }
static inline Vec vset(float v) { return _mm256_set1_ps(v); }
static inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline Vec vfmsub(Vec a, Vec b, Vec c) { return _mm256_fmsub_ps(a, b, c); }
static inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
#endif

// The fp32-activation weight format: the codes of one panel's kLanes outputs at one input, as floats; the weight is
// (code - kZero) * scale, computed by one FMA, exactly.
struct Nibbles {  // GPTQ int4 (symmetric: zero point 8), one word per input
  using Word = Code;
  static constexpr float kZero = 8.f;
  static inline Vec codes(const Word* w) {
#if defined(__AVX512F__)
    const __m512i shift = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
    const __m512i word = _mm512_set1_epi64(static_cast<long long>(*w));
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(word, shift), _mm512_set1_epi32(15)));
#else
    const __m256i shift = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i word = _mm256_set1_epi32(static_cast<int>(*w));
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(word, shift), _mm256_set1_epi32(15)));
#endif
  }
};

// One weight in a kernel's layout (Python builds it by name: PackedWeight(words=..., ...)): fp32 panels [P, K, 8]
// (kernels.cpp's `pack`; no scales), or quantized: int4 words [P, K] int32/int64 (fp32 activations), or for int8
// activations (below) int4 bytes [P, K / 8, kLanes * 4] uint8 or int8 rows [P, K / 4, kLanes * 4] int8, scales
// [P, G, kLanes]; inputs in `perm` order (none: as they come), groups of inputs [bounds[g], bounds[g + 1]) sharing
// a scale; n outputs, the bias added after the chain.
struct PackedWeight {
  torch::Tensor words, scales, bounds, perm, bias;  // scales, bounds (fp32), perm, bias: undefined when none
  int64_t n;

  // The bytes a product reads from it: every part, whole.
  int64_t nbytes() const {
    int64_t total = 0;
    for (const auto* t : {&words, &scales, &bounds, &perm, &bias}) total += t->defined() ? t->nbytes() : 0;
    return total;
  }
};

// A PackedWeight's raw view for the tiles, taken once per product (a tensor's accessors cost more than a tile's setup).
struct Panels {
  const void* words;  // `count` panels of `stride` words (int4 words, or bytes for int8 activations)
  const float* scales;
  const int64_t* bounds;
  int64_t inputs, groups, stride, count, n;
};

template <int MR, int NP>
__attribute__((always_inline)) static inline void zero_tile(Vec (&acc)[MR][NP]) {  // inlined: see store_tile
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int j = 0; j < NP; ++j) acc[m][j] = vzero();
}

// Rows row .. row + MR - 1 of fp32 x [M, K] against NP panels from panel p into y (stride ldy). NP independent
// accumulator chains per row hide the FMA latency even for one row.
template <class F, int MR, int NP>
struct Fp32Tile {
  static void run(int64_t row, int64_t p, const float* x, const Panels& w, float* y, int64_t ldy) {
    const int64_t K = w.inputs, groups = w.groups;
    const auto* wp = static_cast<const typename F::Word*>(w.words) + p * w.stride;
    const float* s = w.scales + p * groups * kLanes;
    const int64_t* bounds = w.bounds;
    x += row * K;
    Vec acc[MR][NP];
    zero_tile(acc);
    for (int64_t g = 0; g < groups; ++g) {
      Vec sc[NP], s8[NP];
#pragma GCC unroll 16
      for (int j = 0; j < NP; ++j) {
        sc[j] = vload(s + (j * groups + g) * kLanes);
        s8[j] = vmul(sc[j], vset(F::kZero));
      }
      for (int64_t k = bounds[g]; k < bounds[g + 1]; ++k) {
        Vec wk[NP];
#pragma GCC unroll 16
        for (int j = 0; j < NP; ++j) wk[j] = vfmsub(F::codes(wp + j * K + k), sc[j], s8[j]);
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) {
          const Vec xk = vset(x[m * K + k]);
#pragma GCC unroll 16
          for (int j = 0; j < NP; ++j) acc[m][j] = vfma(xk, wk[j], acc[m][j]);
        }
      }
    }
    store_tile<kLanes>(acc, y + row * ldy + p * kLanes, ldy, std::min<int64_t>(NP * kLanes, w.n - p * kLanes));
  }
};
template <int MR, int NP> using NibbleTile = Fp32Tile<Nibbles, MR, NP>;

// The int8-activation product (W4A8): y = x W^T with each row of x quantized to int8 per block of 16 inputs
// (symmetric, absmax / 127, round to nearest even; wider blocks change more of the greedy tokens: docs/design.md),
// then integer dot products of the 4-bit codes with the int8 inputs, exact in int32 from -8 * sum(x_q), and in fp32
// per block part += dot * s_x, per weight group acc += part * s_w. The weight stream costs 3 instructions per 16
// outputs x 8 inputs and each row one integer dot product per 4 inputs, where fp32 activations cost a dequantization
// per weight and an FMA per weight and row: the forward is bound by memory at 1 row. Each row's quantization and fp32
// sequence depend on that row alone: row exactness holds as in the fp32 product. Layout: per panel, per 8 inputs,
// kLanes x 4 bytes, byte (lane, i) holding input i's code in its low nibble and input 4 + i's in its high one.
constexpr int kA8Panels = kLanes == 16 ? 2 : 1;  // panels per tile: 4 rows x panels of int32 and fp32 accumulators
constexpr int64_t kA8Block = 16;                 // inputs per activation scale (weight groups are whole blocks)

// codes [N, K] (0..15, kernel order), scales [N, G] -> (bytes [P, K / 8, kLanes * 4] uint8, scales [P, G, kLanes]).
std::vector<torch::Tensor> pack_int4_a8(const torch::Tensor& codes, const torch::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.size(1) % kA8Block == 0, "pack_int4_a8: codes [N, K] with K a multiple of 16");
  const int64_t n = codes.size(0), k = codes.size(1), panels = (n + kLanes - 1) / kLanes;
  auto c = torch::full({panels * kLanes, k}, 8, torch::kByte);
  c.narrow(0, 0, n).copy_(codes.to(torch::kByte));
  // [P, lanes, K / 8, 2, 4] -> [P, K / 8, lanes, 4, 2]: (low, high) nibbles of each byte side by side
  auto grouped = c.view({panels, kLanes, k / 8, 2, 4}).permute({0, 2, 1, 4, 3}).contiguous();
  auto bytes = grouped.select(4, 0).bitwise_or(grouped.select(4, 1).bitwise_left_shift(4));
  bytes = bytes.reshape({panels, k / 8, kLanes * 4});
  auto s = torch::zeros({panels * kLanes, scales.size(1)}, torch::kFloat);
  s.narrow(0, 0, n).copy_(scales.to(torch::kFloat));
  return {bytes.contiguous(), s.view({panels, kLanes, scales.size(1)}).transpose(1, 2).contiguous()};
}

// Rows of x [M, K] -> int8 codes, one scale and the sum of the codes per row and block of kA8Block inputs.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sum;
};

// One block of 16 inputs at a time, as two AVX2 vectors (the conversion rounds to nearest even, as nearbyint does).
static void quantize_rows(const float* x, int64_t M, int64_t K, QuantizedRows& out) {
  static_assert(kA8Block == 16, "quantize_rows handles blocks of two 8-float vectors");
  const int64_t blocks = K / kA8Block;
  out.q.resize(M * K);
  out.scale.resize(M * blocks);
  out.sum.resize(M * blocks);
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < M * blocks; ++b) {
    const __m256 lo = _mm256_loadu_ps(x + b * kA8Block), hi = _mm256_loadu_ps(x + b * kA8Block + 8);
    const float most = max8(_mm256_max_ps(_mm256_andnot_ps(sign, lo), _mm256_andnot_ps(sign, hi)));
    const __m256 inverse = _mm256_set1_ps(most > 0.f ? 127.f / most : 0.f);
    const __m256i qlo = _mm256_cvtps_epi32(_mm256_mul_ps(lo, inverse));
    const __m256i qhi = _mm256_cvtps_epi32(_mm256_mul_ps(hi, inverse));
    const __m128i first = _mm_packs_epi32(_mm256_castsi256_si128(qlo), _mm256_extracti128_si256(qlo, 1));
    const __m128i second = _mm_packs_epi32(_mm256_castsi256_si128(qhi), _mm256_extracti128_si256(qhi, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q.data() + b * kA8Block), _mm_packs_epi16(first, second));
    out.scale[b] = most / 127.f;
    out.sum[b] = sum8(_mm256_add_epi32(qlo, qhi));
  }
}

#if defined(__AVX512VNNI__)
using IVec = __m512i;
static inline IVec ivload(const uint8_t* p) { return _mm512_loadu_si512(p); }
static inline IVec nibbles(IVec v, int shift) {
  return _mm512_and_si512(_mm512_srli_epi16(v, shift), _mm512_set1_epi8(15));
}
static inline IVec dot4(IVec acc, IVec codes, const int8_t* x) {  // acc += 4 codes (uint8) . 4 inputs (int8), per lane
  return _mm512_dpbusd_epi32(acc, codes, _mm512_set1_epi32(load_i32(x)));
}
static inline IVec ivset(int32_t v) { return _mm512_set1_epi32(v); }
static inline Vec ivfloat(IVec v) { return _mm512_cvtepi32_ps(v); }
#else
using IVec = __m256i;
static inline IVec ivload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
static inline IVec nibbles(IVec v, int shift) {
  return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8(15));
}
static inline IVec add_pairs(IVec acc, IVec pairs) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
static inline IVec dot4(IVec acc, IVec codes, const int8_t* x) {  // codes <= 15: the int16 pair sums cannot saturate
  return add_pairs(acc, _mm256_maddubs_epi16(codes, _mm256_set1_epi32(load_i32(x))));
}
static inline IVec ivset(int32_t v) { return _mm256_set1_epi32(v); }
static inline Vec ivfloat(IVec v) { return _mm256_cvtepi32_ps(v); }
#endif

// The int8-activation weight formats: a chunk of kStep inputs x kLanes outputs in kLanes x 4 bytes, and the zero
// point the integer dot product starts from (-kZero * sum(x_q)).
struct A8Nibbles {  // GPTQ int4: byte (lane, i) = input i's code | input 4 + i's << 4
  static constexpr int64_t kStep = 8;
  static constexpr int32_t kZero = 8;
  struct Codes { IVec low, high; };
  static inline Codes unpack(const uint8_t* w) { const IVec v = ivload(w); return {nibbles(v, 0), nibbles(v, 4)}; }
  static inline IVec dot(IVec acc, const Codes& c, const int8_t* x) { return dot4(dot4(acc, c.low, x), c.high, x + 4); }
};

struct A8Bytes {  // int8 rows (an LM head): byte (lane, i) = input i's weight, + 128 on AVX-512 (VNNI multiplies
                  // unsigned by signed bytes); AVX2 multiplies |x| by the weight with x's sign (no int16 saturation)
  static constexpr int64_t kStep = 4;
  static constexpr int32_t kZero = kLanes == 16 ? 128 : 0;
  struct Codes { IVec v; };
  static inline Codes unpack(const uint8_t* w) { return {ivload(w)}; }
  static inline IVec dot(IVec acc, const Codes& c, const int8_t* x) {
#if defined(__AVX512VNNI__)
    return dot4(acc, c.v, x);
#else
    const IVec xs = _mm256_set1_epi32(load_i32(x));
    return add_pairs(acc, _mm256_maddubs_epi16(_mm256_abs_epi8(xs), _mm256_sign_epi8(c.v, xs)));
#endif
  }
};

// Rows row .. row + MR - 1 of the quantized x against NP panels from panel p into y (stride ldy). Each step also
// prefetches the same line of the next NP panels (a thread's next tile, or its next rows' panels): on its own the
// stream leaves memory idle while a later row tile computes from cache.
template <class F, int MR, int NP>
struct A8Tile {
  static void run(int64_t row, int64_t p, const QuantizedRows& x, const Panels& w, float* y, int64_t ldy) {
    const int64_t K = w.inputs, groups = w.groups, panel = w.stride;
    const uint8_t* wp = static_cast<const uint8_t*>(w.words) + p * panel;
    const float* s = w.scales + p * groups * kLanes;
    const int64_t* bounds = w.bounds;
    Vec acc[MR][NP];
    zero_tile(acc);
    for (int64_t g = 0; g < groups; ++g) {
      Vec part[MR][NP];  // this group's sum over its blocks of dot * s_x, scaled by s_w once at its end
      zero_tile(part);
      for (int64_t block = bounds[g]; block < bounds[g + 1]; block += kA8Block) {
        IVec dot[MR][NP];
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) {
          // sum (q - z) x = sum q x - z sum x
          const IVec start = ivset(-F::kZero * x.sum[((row + m) * K + block) / kA8Block]);
#pragma GCC unroll 16
          for (int j = 0; j < NP; ++j) dot[m][j] = start;
        }
#pragma GCC unroll 4
        for (int64_t k = block; k < block + kA8Block; k += F::kStep) {
          typename F::Codes codes[NP];
#pragma GCC unroll 16
          for (int j = 0; j < NP; ++j) {
            codes[j] = F::unpack(wp + j * panel + k / F::kStep * kLanes * 4);
            _mm_prefetch(reinterpret_cast<const char*>(wp + (NP + j) * panel + k / F::kStep * kLanes * 4), _MM_HINT_T1);
          }
#pragma GCC unroll 16
          for (int m = 0; m < MR; ++m) {
            const int8_t* xr = x.q.data() + (row + m) * K + k;
#pragma GCC unroll 16
            for (int j = 0; j < NP; ++j) dot[m][j] = F::dot(dot[m][j], codes[j], xr);
          }
        }
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) {
          const Vec xs = vset(x.scale[((row + m) * K + block) / kA8Block]);
#pragma GCC unroll 16
          for (int j = 0; j < NP; ++j) part[m][j] = vfma(ivfloat(dot[m][j]), xs, part[m][j]);
        }
      }
#pragma GCC unroll 16
      for (int j = 0; j < NP; ++j) {
        const Vec sc = vload(s + (j * groups + g) * kLanes);
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) acc[m][j] = vfma(part[m][j], sc, acc[m][j]);
      }
    }
    store_tile<kLanes>(acc, y + row * ldy + p * kLanes, ldy, std::min<int64_t>(NP * kLanes, w.n - p * kLanes));
  }
};

template <int MR, int NP> using A8NibbleTile = A8Tile<A8Nibbles, MR, NP>;
template <int MR, int NP> using A8ByteTile = A8Tile<A8Bytes, MR, NP>;

struct Scratch {  // per forward: inputs gathered into act order, quantized inputs
  std::vector<float> gathered;
  QuantizedRows rows;
};

// The input width K of a packed weight (fp32 panels [P, K, 8]: K).
static int64_t input_width(const torch::Tensor& words) {
  if (words.scalar_type() == torch::kByte) return words.size(1) * A8Nibbles::kStep;
  if (words.scalar_type() == torch::kChar) return words.size(1) * A8Bytes::kStep;
  return words.size(1);
}

// y[:, :w.n] (row stride ldy) = x [M, K] W^T for an int4 or int8 weight; x is first gathered in act order if w has
// a perm.
static void quantized_linear(const float* x, int64_t M, const PackedWeight& w, float* y, int64_t ldy,
                             Scratch& scratch) {
  const int64_t K = input_width(w.words);
  const Panels panels{w.words.data_ptr(), w.scales.data_ptr<float>(), w.bounds.data_ptr<int64_t>(), K,
                      w.bounds.numel() - 1, w.words.numel() / w.words.size(0), w.words.size(0), w.n};
  if (w.perm.defined()) {
    scratch.gathered.resize(M * K);
    const int64_t* perm = w.perm.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) scratch.gathered[m * K + k] = x[m * K + perm[k]];
    x = scratch.gathered.data();
  }
  if (w.words.scalar_type() == torch::kByte || w.words.scalar_type() == torch::kChar) {
    quantize_rows(x, M, K, scratch.rows);
    if (w.words.scalar_type() == torch::kByte) {
      over_panels<A8NibbleTile, kA8Panels>(M, panels.count, 1, scratch.rows, panels, y, ldy);
    } else {
      over_panels<A8ByteTile, kA8Panels>(M, panels.count, 1, scratch.rows, panels, y, ldy);
    }
  } else {
    over_panels<NibbleTile, kTilePanels>(M, panels.count, 1, x, panels, y, ldy);
  }
}

// y[:, :w.n] (row stride ldy) = x [M, K] W^T (+ bias, after the chain) for a weight of either kind.
static void packed_linear(const float* x, int64_t M, const PackedWeight& w, float* y, int64_t ldy,
                          Scratch& scratch) {
  if (w.words.scalar_type() == torch::kFloat) {
    dense_linear(x, M, {w.words.data_ptr<float>(), input_width(w.words), w.words.size(0), w.n}, y, ldy);
  } else {
    quantized_linear(x, M, w, y, ldy, scratch);
  }
  if (w.bias.defined()) {
    const float* b = w.bias.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < w.n; ++j) y[m * ldy + j] += b[j];
  }
}

// q [N, K] int8 (-127..127), scales [N] -> (bytes [P, K / 4, kLanes * 4] int8 in A8Bytes' layout,
// scales [P, 1, kLanes]), padded outputs 0.
std::vector<torch::Tensor> pack_int8(const torch::Tensor& q, const torch::Tensor& scales) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && scales.numel() == q.size(0) &&
              q.size(1) % kA8Block == 0,
              "pack_int8: q [N, K] int8 with K a multiple of 16, scales [N]");
  const int64_t n = q.size(0), k = q.size(1), panels = (n + kLanes - 1) / kLanes;
  auto padded = torch::zeros({panels * kLanes, k}, torch::kInt);
  padded.narrow(0, 0, n).copy_(q);
  padded.add_(A8Bytes::kZero);  // two's complement bytes of w + 128: the unsigned bytes VNNI reads
  auto bytes = padded.to(torch::kByte).view({panels, kLanes, k / 4, 4}).permute({0, 2, 1, 3}).contiguous();
  bytes = bytes.view(torch::kChar);
  auto s = torch::zeros({panels * kLanes}, torch::kFloat);
  s.narrow(0, 0, n).copy_(scales.reshape(-1));
  return {bytes.reshape({panels, k / 4, kLanes * 4}), s.view({panels, 1, kLanes})};
}

// x [M, K] float32 through one packed weight (fp32, int4 or int8): [M, n] (an LM head, and the product alone for
// tests).
torch::Tensor packed_mm(const torch::Tensor& x, const PackedWeight& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) == input_width(w.words),
              "packed_mm: x [M, K] float32");
  const auto input = x.contiguous();
  auto y = torch::empty({input.size(0), w.n}, input.options());
  Scratch scratch;
  packed_linear(input.data_ptr<float>(), input.size(0), w, y.data_ptr<float>(), w.n, scratch);
  return y;
}

// HF's LlamaRMSNorm in fp32: x * rsqrt(mean(x^2) + eps) * weight, one row at a time (its squares summed per lane).
static void rms_norm(const float* x, int64_t M, int64_t H, const float* weight, float eps, float* y) {
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
static void rotate(float* x, int64_t heads, int64_t D, const float* cos, const float* sin) {
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

static void add(const torch::Tensor& from, torch::Tensor& into) {  // into += from, both contiguous float32
  const float* f = from.data_ptr<float>();
  float* t = into.data_ptr<float>();
  for (int64_t i = 0; i < into.numel(); ++i) t[i] += f[i];
}

struct Layer {
  torch::Tensor input_norm, post_norm;
  std::vector<PackedWeight> qkv, gate_up;  // one fused weight, or the siblings one by one (act orders that differ)
  PackedWeight o, down;
};

// A PackedWeight from its named parts, checked once here (the tiles trust the layout): Python's only way to make one.
static PackedWeight packed_weight(const torch::Tensor& words, int64_t n, const c10::optional<torch::Tensor>& scales,
                                  const c10::optional<torch::Tensor>& bounds, const c10::optional<torch::Tensor>& perm,
                                  const c10::optional<torch::Tensor>& bias) {
  const auto kind = words.scalar_type();
  const bool dense = kind == torch::kFloat;
  TORCH_CHECK(words.is_contiguous() && words.dim() >= 2 &&
              (dense || kind == torch::kInt || kind == torch::kLong || kind == torch::kByte || kind == torch::kChar),
              "PackedWeight: words from kernels' pack, pack_int4, pack_int4_a8 or pack_int8");
  const int64_t lanes = dense ? kPanel : kLanes;
  TORCH_CHECK(n > 0 && n <= words.size(0) * lanes, "PackedWeight: n outputs within the panels");
  TORCH_CHECK(!bias || bias->numel() == n, "PackedWeight: bias [n]");
  const auto bias_or_none = bias ? bias->to(torch::kFloat).contiguous() : torch::Tensor();
  if (dense) {
    TORCH_CHECK(words.dim() == 3 && words.size(2) == kPanel && !scales && !bounds && !perm,
                "PackedWeight: fp32 panels [P, K, 8] take no scales, bounds or perm");
    return {words, torch::Tensor(), torch::Tensor(), torch::Tensor(), bias_or_none, n};
  }
  TORCH_CHECK(scales && scales->is_contiguous() && scales->scalar_type() == torch::kFloat && scales->dim() == 3 &&
              scales->size(0) == words.size(0) && scales->size(2) == kLanes,
              "PackedWeight: scales [P, G, lanes] float32");
  TORCH_CHECK(bounds && bounds->is_contiguous() && bounds->scalar_type() == torch::kLong &&
              bounds->numel() == scales->size(1) + 1, "PackedWeight: bounds [G + 1] long");
  TORCH_CHECK(!perm || (perm->scalar_type() == torch::kLong && perm->numel() == input_width(words)),
              "PackedWeight: perm [K] long");
  return {words, *scales, *bounds, perm ? perm->contiguous() : torch::Tensor(), bias_or_none, n};
}

// Siblings that read the same input, their outputs side by side in y [M, ldy].
static void siblings(const float* x, int64_t M, const std::vector<PackedWeight>& ws, float* y, int64_t ldy,
                          Scratch& scratch) {
  int64_t offset = 0;
  for (const auto& w : ws) { packed_linear(x, M, w, y + offset, ldy, scratch); offset += w.n; }
}

static int64_t width(const std::vector<PackedWeight>& ws) {
  int64_t n = 0;
  for (const auto& w : ws) n += w.n;
  return n;
}

// The decoder: embeddings, layers, final norm. The KV cache is the caller's ([layers, kv heads, capacity, head dim]
// for keys and for values, one per runner): `forward` appends after `cached` positions.
class Decoder {
 public:
  Decoder(torch::Tensor embed, torch::Tensor final_norm, torch::Tensor cos, torch::Tensor sin, int64_t heads,
          int64_t kv_heads, double eps, int64_t layers)
      : embed_(embed.contiguous()), final_norm_(final_norm.contiguous()), cos_(cos.contiguous()),
        sin_(sin.contiguous()), heads_(heads), kv_heads_(kv_heads), head_dim_(cos.size(1)), layers_wanted_(layers),
        eps_(static_cast<float>(eps)) {}

  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, const std::vector<PackedWeight>& qkv,
                 const PackedWeight& o, const std::vector<PackedWeight>& gate_up, const PackedWeight& down) {
    TORCH_CHECK(static_cast<int64_t>(layers_.size()) < layers_wanted_, "add_layer: more layers than the model has");
    layers_.push_back({input_norm.contiguous(), post_norm.contiguous(), qkv, gate_up, o, down});
  }

  int64_t head_dim() const { return head_dim_; }

  // The bytes of the weights every forward reads whole, from the buffers it runs on: each layer's norms and packed
  // weights, the final norm (the embedding, rotary tables and KV cache are the caller's to count: a row per token).
  int64_t weight_bytes() const {
    int64_t total = final_norm_.nbytes();
    for (const auto& layer : layers_) {
      total += layer.input_norm.nbytes() + layer.post_norm.nbytes() + layer.o.nbytes() + layer.down.nbytes();
      for (const auto& w : layer.qkv) total += w.nbytes();
      for (const auto& w : layer.gate_up) total += w.nbytes();
    }
    return total;
  }

  // ids [T] long after `cached` cached positions, positions [T] long (rotary), mask: none (causal) or additive
  // float32 broadcastable to [1, heads, T, cached + T]. Returns the final-norm hidden states [T, hidden]. With
  // `aux_layers` (EAGLE-3), `aux` [T, aux_layers * hidden] float32 receives the states entering those layers.
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& positions,
                        const c10::optional<torch::Tensor>& mask, int64_t cached, const torch::Tensor& keys,
                        const torch::Tensor& values, const c10::optional<torch::Tensor>& aux,
                        const std::vector<int64_t>& aux_layers) {
    const int64_t T = ids.numel(), H = embed_.size(1), L = cached + T;
    TORCH_CHECK(static_cast<int64_t>(layers_.size()) == layers_wanted_, "forward: the model has not all its layers");
    TORCH_CHECK(keys.dim() == 4 && keys.size(0) == layers_wanted_ && keys.size(1) == kv_heads_ &&
                keys.size(3) == head_dim_ && keys.is_contiguous() && values.sizes() == keys.sizes() &&
                values.is_contiguous() && keys.scalar_type() == torch::kFloat,
                "forward: a float32 cache [layers, kv heads, capacity, head dim] for keys and for values");
    TORCH_CHECK(L <= keys.size(2), "forward: ", L, " positions exceed the KV cache's capacity of ", keys.size(2));
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_.size(0), "forward: position out of range");
    auto h = embed_.index_select(0, ids.to(torch::kLong)).to(torch::kFloat).contiguous();
    auto normed = torch::empty({T, H});
    auto step = torch::empty({T, H});
    Scratch scratch;
    std::vector<float> wide;
    const int64_t aux_width = H * static_cast<int64_t>(aux_layers.size());
    TORCH_CHECK(aux_layers.empty() || (aux.has_value() && aux->is_contiguous() &&
                                       aux->scalar_type() == torch::kFloat && aux->size(0) == T &&
                                       aux->size(1) == aux_width),
                "forward: aux must be float32 [T, ", aux_layers.size(), " * hidden]");
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      for (size_t k = 0; k < aux_layers.size(); ++k) {
        if (aux_layers[k] == static_cast<int64_t>(i)) aux->narrow(1, k * H, H).copy_(h);
      }
      rms_norm(h.data_ptr<float>(), T, H, layer.input_norm.data_ptr<float>(), eps_, normed.data_ptr<float>());
      const auto attended = attention(static_cast<int64_t>(i), normed.data_ptr<float>(), T, pos, mask, cached,
                                      keys[i], values[i], scratch, wide);
      packed_linear(attended.data_ptr<float>(), T, layer.o, step.data_ptr<float>(), H, scratch);
      add(step, h);
      rms_norm(h.data_ptr<float>(), T, H, layer.post_norm.data_ptr<float>(), eps_, normed.data_ptr<float>());
      mlp(layer, normed.data_ptr<float>(), T, step.data_ptr<float>(), scratch, wide);
      add(step, h);
    }
    rms_norm(h.data_ptr<float>(), T, H, final_norm_.data_ptr<float>(), eps_, normed.data_ptr<float>());
    return normed;
  }

 private:
  // q/k/v of T rows, rotary, keys and values into the cache after `cached`, attention: [T, heads * head dim].
  // Each layer's keys/values: [kv heads, capacity, head dim].
  torch::Tensor attention(int64_t i, const float* x, int64_t T, const int64_t* pos,
                          const c10::optional<torch::Tensor>& mask, int64_t cached, const torch::Tensor& keys,
                          const torch::Tensor& values, Scratch& scratch, std::vector<float>& qkv) {
    const Layer& layer = layers_[i];
    const int64_t D = head_dim_, Q = heads_ * D, KV = kv_heads_ * D, N = width(layer.qkv), cap = keys.size(1);
    TORCH_CHECK(N == Q + 2 * KV, "attention: q/k/v widths do not match the heads");
    qkv.resize(T * N);
    siblings(x, T, layer.qkv, qkv.data(), N, scratch);
    float* kc = keys.data_ptr<float>();
    float* vc = values.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      float* row = qkv.data() + t * N;
      rotate(row, heads_ + kv_heads_, D, cos_.data_ptr<float>() + pos[t] * D, sin_.data_ptr<float>() + pos[t] * D);
      for (int64_t h = 0; h < kv_heads_; ++h) {
        std::copy(row + Q + h * D, row + Q + (h + 1) * D, kc + (h * cap + cached + t) * D);
        std::copy(row + Q + KV + h * D, row + Q + KV + (h + 1) * D, vc + (h * cap + cached + t) * D);
      }
    }
    const auto q = torch::from_blob(qkv.data(), {1, heads_, T, D}, {T * N, D, N, 1}, torch::kFloat);
    const auto k = keys.narrow(1, 0, cached + T).unsqueeze(0);
    const auto v = values.narrow(1, 0, cached + T).unsqueeze(0);
    return attend(q, k, v, mask, 1.0 / std::sqrt(static_cast<double>(D)), !mask.has_value() && T > 1);
  }

  // down(silu(gate(x)) * up(x)) of T rows into y [T, hidden].
  void mlp(const Layer& layer, const float* x, int64_t T, float* y, Scratch& scratch, std::vector<float>& wide) {
    const int64_t N = width(layer.gate_up), I = N / 2;
    wide.resize(T * N);
    siblings(x, T, layer.gate_up, wide.data(), N, scratch);
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (int64_t t = 0; t < T; ++t) {  // silu(gate) * up, packed into the first I columns of each row's space
      const float* g = wide.data() + t * N;
      float* a = wide.data() + t * I;  // row t's output lies at or before its input: safe in this order
      int64_t j = 0;
      for (; j + 8 <= I; j += 8) {
        const __m256 gj = _mm256_loadu_ps(g + j);
        const __m256 silu = _mm256_div_ps(gj, _mm256_add_ps(one, exp8(_mm256_xor_ps(gj, sign))));
        _mm256_storeu_ps(a + j, _mm256_mul_ps(silu, _mm256_loadu_ps(g + I + j)));
      }
      for (; j < I; ++j) { const float gj = g[j], uj = g[I + j]; a[j] = gj / (1.f + std::exp(-gj)) * uj; }
    }
    packed_linear(wide.data(), T, layer.down, y, embed_.size(1), scratch);
  }

  torch::Tensor embed_, final_norm_, cos_, sin_;
  int64_t heads_, kv_heads_, head_dim_, layers_wanted_;
  float eps_;
  std::vector<Layer> layers_;
};

}  // namespace polyspec

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace polyspec;
  m.def("pack_int4", &pack_int4, "codes [N, K], scales [N, G] -> panel words and scales");
  m.def("pack_int8", &pack_int8, "int8 rows [N, K], scales [N] -> panel bytes and scales");
  m.def("pack_int4_a8", &pack_int4_a8, "codes [N, K], scales [N, G] -> panel bytes and scales for int8 activations");
  py::class_<PackedWeight>(m, "PackedWeight")
      .def(py::init(&packed_weight), py::arg("words"), py::arg("n"), py::arg("scales") = py::none(),
           py::arg("bounds") = py::none(), py::arg("perm") = py::none(), py::arg("bias") = py::none())
      .def_readonly("words", &PackedWeight::words)
      .def_readonly("n", &PackedWeight::n)
      .def_property_readonly("nbytes", &PackedWeight::nbytes);
  m.def("packed_mm", &packed_mm, "x W^T (+ b) through a PackedWeight of either kind");
  m.def("lanes", [] { return kLanes; }, "outputs per panel (8: AVX2, 16: AVX-512)");
  m.def("stream_sum", &stream_sum, "sum of a float32 buffer streamed by all threads (bandwidth probe)");
  py::class_<Decoder>(m, "Decoder")
      .def(py::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, double, int64_t>())
      .def("add_layer", &Decoder::add_layer)
      .def("head_dim", &Decoder::head_dim)
      .def("weight_bytes", &Decoder::weight_bytes)
      .def("forward", &Decoder::forward, py::arg("ids"), py::arg("positions"), py::arg("mask"), py::arg("cached"),
           py::arg("keys"), py::arg("values"), py::arg("aux") = py::none(),
           py::arg("aux_layers") = std::vector<int64_t>{});
}
