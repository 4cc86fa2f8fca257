// The quantized tile products of the native decoder (packed_linear.cpp runs them): int4 weights on fp32
// activations, and on int8 activations int4 weights (W4A8) or int8 rows (an LM head), each a Tile for tiles.h's
// driver, in the build's vectors (simd.h) over pack.h's layouts.
//
// int4 weights on fp32 activations (w4_activations: fp32; the default int8 path is below, at the int8 tiles):
// y = x W^T with W = (q - 8) * s (4-bit codes q, one scale s per output and group of inputs,
// symmetric like GPTQModel's CPU kernel). The codes of one panel of kLanes outputs at input k are one word
// (AVX2: 8 nibbles in a uint32; AVX-512: 16 in a uint64, even lanes in the low half); a weight is dequantized
// in registers as it streams, (q * s - 8 s) in one FMA, exactly (q - 8) * s in fp32. Each output is then one FMA
// chain over the (act-order sorted) inputs from zero, as in kernels.cpp's `linear`: the bits of a row do not
// depend on how many rows or threads compute it, and equal the fp32 product with the dequantized weight.
#pragma once

#include <algorithm>
#include <cstdint>

#include "pack.h"
#include "packed_linear.h"
#include "simd.h"
#include "tiles.h"

namespace polyspec {

// panels per tile: AVX-512 has 32 registers (4 x 4 accumulators, 4 weights, 8 scales, input, shift, mask),
// AVX2 16 (4 x 2 accumulators, 2 weights, input, shift, mask; scales spill to the stack, read once a group)
constexpr int kTilePanels = kLanes == 16 ? 4 : 2;

// The fp32-activation weight format: the codes of one panel's kLanes outputs at one input, as floats; the weight is
// (code - kZero) * scale, computed by one FMA, exactly.
struct Nibbles {  // GPTQ int4 (symmetric: zero point 8), one word per input
  using Word = Code;
  static constexpr float kZero = 8.f;
  static inline Vec codes(const Word* w) { return nibble_floats(*w); }
};

// A PackedWeight's raw view for the tiles, taken once per product (a tensor's accessors cost more than a tile's setup).
struct Panels {
  const void* words;  // `count` panels of `stride` words (int4 words, or bytes for int8 activations)
  const float* scales;
  const int64_t* bounds;
  int64_t inputs, groups, stride, count, n;
};

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
// Panels per task of over_panels, and the accumulators (rows x panels) a tile keeps in registers: the int32 block
// sums, the fp32 group parts and the fp32 totals, one each per row and panel (AVX-512 has 32 vector registers, AVX2
// 16). A tile wider than its rows allow runs as narrower tiles: 1 row on 2 panels gives a core two independent
// chains of dependent products, where 1 row on 1 panel leaves it waiting on one (BENCHMARKS.md, "A8 tiles").
constexpr int kA8Panels = 2;
constexpr int kA8Accumulators = kLanes == 16 ? 8 : 4;

// One block of 16 inputs at a time, as two AVX2 vectors (the conversion rounds to nearest even, as nearbyint does).
static inline void quantize_rows(const float* x, int64_t M, int64_t K, QuantizedRows& out) {
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

// The int8-activation weight formats: a chunk of kStep inputs x kLanes outputs in kLanes x 4 bytes, and the zero
// point the integer dot product starts from (-kZero * sum(x_q)).
struct A8Nibbles {  // GPTQ int4: byte (lane, i) = input i's code | input 4 + i's << 4
  static constexpr int64_t kStep = kNibbleStep;
  static constexpr int32_t kZero = 8;
  struct Codes { IVec low, high; };
  static inline Codes unpack(const uint8_t* w) { const IVec v = ivload(w); return {nibbles(v, 0), nibbles(v, 4)}; }
  static inline IVec dot(IVec acc, const Codes& c, const int8_t* x) { return dot4(dot4(acc, c.low, x), c.high, x + 4); }
  static inline IVec widen(IVec sums) { return widen_codes(sums); }  // AVX2: a block's int16 pair sums to int32
  static_assert(kA8Block / kStep * 2 <= 4, "AVX2's int16 pair sums hold at most 4 dot4 calls a block (simd.h)");
};

struct A8Bytes {  // int8 rows (an LM head): byte (lane, i) = input i's weight + kByteZero (128 on AVX-512: VNNI
                  // multiplies unsigned by signed bytes; 0 on AVX2, which multiplies signed ones: simd.h's dot4_bytes)
  static constexpr int64_t kStep = kByteStep;
  static constexpr int32_t kZero = kByteZero;
  struct Codes { IVec v; };
  static inline Codes unpack(const uint8_t* w) { return {ivload(w)}; }
  static inline IVec dot(IVec acc, const Codes& c, const int8_t* x) { return dot4_bytes(acc, c.v, x); }
  static inline IVec widen(IVec sums) { return sums; }  // int32 already
};

// Rows row .. row + MR - 1 of the quantized x against NP panels from panel p into y (stride ldy). Each step also
// prefetches the same line of the panels `Ahead` panels on (a thread's next task, or its next rows' panels: a tile
// split into narrower ones still asks for its task's successor): on its own the stream leaves memory idle while a
// later row tile computes from cache; the first row tile also its own panels kAheadBytes ahead (tiles.h).
template <class F, int MR, int NP, int Ahead = NP>
struct A8Tile {
  static void run(int64_t row, int64_t p, const QuantizedRows& x, const Panels& w, float* y, int64_t ldy) {
    constexpr int kFit = kA8Accumulators / MR > 0 ? kA8Accumulators / MR : 1;  // panels this many rows keep
    if constexpr (NP > kFit) {
      static_assert(NP % kFit == 0, "a wide tile splits into tiles of kFit panels");
      for (int j = 0; j < NP; j += kFit) A8Tile<F, MR, kFit, NP>::run(row, p + j, x, w, y, ldy);
    } else {
      tile(row, p, x, w, y, ldy);
    }
  }

  // The rows' inputs, sums and scales are addressed from pointers taken once a tile and a block counter: otherwise a
  // signed division per block and row, and the vectors' data pointers reread after every store, sit in the inner loop.
  static void tile(int64_t row, int64_t p, const QuantizedRows& x, const Panels& w, float* y, int64_t ldy) {
    const int64_t K = w.inputs, groups = w.groups, panel = w.stride, row_blocks = K / kA8Block;
    const uint8_t* wp = static_cast<const uint8_t*>(w.words) + p * panel;
    const float* s = w.scales + p * groups * kLanes;
    const int64_t* bounds = w.bounds;
    const int8_t* xq = x.q.data() + row * K;
    const int32_t* sums = x.sum.data() + row * row_blocks;
    const float* x_scales = x.scale.data() + row * row_blocks;
    Vec acc[MR][NP];
    zero_tile(acc);
    for (int64_t g = 0; g < groups; ++g) {
      Vec part[MR][NP];  // this group's sum over its blocks of dot * s_x, scaled by s_w once at its end
      zero_tile(part);
      for (int64_t b = bounds[g] / kA8Block; b < bounds[g + 1] / kA8Block; ++b) {
        IVec dot[MR][NP];  // the block's sums of code x input, in F::dot's own form until F::widen
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
          for (int j = 0; j < NP; ++j) dot[m][j] = ivzero();
        // the block's chunks, a constant count: fully unrolled, the addresses moved by constants
        const uint8_t* wb = wp + b * (kA8Block / F::kStep) * kLanes * 4;
        const int8_t* xb = xq + b * kA8Block;
#pragma GCC unroll 16
        for (int step = 0; step < kA8Block / F::kStep; ++step) {
          typename F::Codes codes[NP];
#pragma GCC unroll 16
          for (int j = 0; j < NP; ++j) {
            const uint8_t* at = wb + j * panel + step * kLanes * 4;
            codes[j] = F::unpack(at);
            _mm_prefetch(reinterpret_cast<const char*>(at + Ahead * panel), _MM_HINT_T1);
            if (row == 0) _mm_prefetch(reinterpret_cast<const char*>(at + kAheadBytes), _MM_HINT_T1);
          }
#pragma GCC unroll 16
          for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 16
            for (int j = 0; j < NP; ++j) dot[m][j] = F::dot(dot[m][j], codes[j], xb + m * K + step * F::kStep);
          }
        }
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) {
          const IVec zero_point = ivset(-F::kZero * sums[m * row_blocks + b]);  // sum (q - z) x = sum q x - z sum x
          const Vec xs = vset(x_scales[m * row_blocks + b]);
#pragma GCC unroll 16
          for (int j = 0; j < NP; ++j)
            part[m][j] = vfma(ivfloat(ivadd(F::widen(dot[m][j]), zero_point)), xs, part[m][j]);
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

}  // namespace polyspec
