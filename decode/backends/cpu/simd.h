// The one SIMD map of the CPU kernels: the build's widest vectors (AVX-512 where the native decoder's build enables
// it, else AVX2) and their operations, and the fixed 8-lane (AVX2) helpers that every build has. Code that must be
// one width whatever the build (the fp32 panels, attention) uses __m256 and the 8-lane helpers directly; code that
// follows the build (the quantized products, the read-bandwidth probe) uses Vec, IVec and kLanes.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && !(defined(__AVX512BW__) && defined(__AVX512VNNI__))
#error "the AVX-512 build needs AVX512-BW and AVX512-VNNI (-mavx512bw -mavx512vnni); build for AVX2 otherwise"
#endif

namespace polyspec {

// 4 bytes from any address (a quantized row's inputs lie at any byte): memcpy, which compilers turn into one load
// and which, unlike a cast pointer, neither assumes alignment nor breaks strict aliasing.
static inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The build's float vector, kLanes floats; its operations are one list, the width chosen by the intrinsics' prefix.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Vec = __m512;
#define POLYSPEC_VEC(op) _mm512_##op
#else
constexpr int64_t kLanes = 8;
using Vec = __m256;
#define POLYSPEC_VEC(op) _mm256_##op
#endif
static inline Vec vzero() { return POLYSPEC_VEC(setzero_ps)(); }
static inline Vec vset(float v) { return POLYSPEC_VEC(set1_ps)(v); }
static inline Vec vload(const float* p) { return POLYSPEC_VEC(loadu_ps)(p); }
static inline Vec vload_aligned(const float* p) { return POLYSPEC_VEC(load_ps)(p); }
static inline Vec vadd(Vec a, Vec b) { return POLYSPEC_VEC(add_ps)(a, b); }
static inline Vec vfma(Vec a, Vec b, Vec c) { return POLYSPEC_VEC(fmadd_ps)(a, b, c); }
static inline Vec vfmsub(Vec a, Vec b, Vec c) { return POLYSPEC_VEC(fmsub_ps)(a, b, c); }
static inline Vec vmul(Vec a, Vec b) { return POLYSPEC_VEC(mul_ps)(a, b); }
#undef POLYSPEC_VEC

// A word's kLanes 4-bit codes as floats (AVX-512: 16 in a uint64, even lanes in the low half; AVX2: 8 in a uint32).
#if defined(__AVX512F__)
static inline Vec nibble_floats(uint64_t w) {
  const __m512i shift = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
  const __m512i word = _mm512_set1_epi64(static_cast<long long>(w));
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(word, shift), _mm512_set1_epi32(15)));
}
#else
static inline Vec nibble_floats(uint32_t w) {
  const __m256i shift = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i word = _mm256_set1_epi32(static_cast<int>(w));
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(word, shift), _mm256_set1_epi32(15)));
}
#endif

// Either width's float vector into memory (unaligned).
static inline void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
#if defined(__AVX512F__)
static inline void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
#endif

// The build's integer vector (int32 lanes, as many as Vec's) and the byte dot products of the int8-activation
// products: VNNI multiplies 4 unsigned bytes by 4 signed ones per lane in one instruction; AVX2 multiplies byte
// pairs into int16 sums and those pairs into int32 ones. `dot4` takes 4-bit codes (unsigned); `dot4_bytes` whole
// weight bytes: unsigned on VNNI (the weight + 128, its zero point subtracted by the caller), signed on AVX2 (|x|
// times the weight with x's sign: no int16 saturation).
#if defined(__AVX512VNNI__)
using IVec = __m512i;
static inline IVec ivload(const uint8_t* p) { return _mm512_loadu_si512(p); }
static inline IVec nibbles(IVec v, int shift) {
  return _mm512_and_si512(_mm512_srli_epi16(v, shift), _mm512_set1_epi8(15));
}
static inline IVec dot4(IVec acc, IVec codes, const int8_t* x) {  // acc += 4 codes (uint8) . 4 inputs (int8), per lane
  return _mm512_dpbusd_epi32(acc, codes, _mm512_set1_epi32(load_i32(x)));
}
static inline IVec dot4_bytes(IVec acc, IVec weights, const int8_t* x) { return dot4(acc, weights, x); }
static inline IVec widen_codes(IVec sums) { return sums; }  // dot4 sums in int32 already
static inline IVec ivzero() { return _mm512_setzero_si512(); }
static inline IVec ivadd(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
static inline IVec ivset(int32_t v) { return _mm512_set1_epi32(v); }
static inline Vec ivfloat(IVec v) { return _mm512_cvtepi32_ps(v); }
#else
using IVec = __m256i;
static inline IVec ivload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
static inline IVec nibbles(IVec v, int shift) {
  return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8(15));
}
static inline IVec widen_codes(IVec pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }
// acc += 4 codes (uint8) . 4 inputs (int8) per lane, as two int16 pair sums: a code is at most 15 and an input at
// most 127 in magnitude, so a pair sums to at most 3810 and a block of 16 inputs (4 calls) to 15240, inside int16.
// The tile widens them to int32 once a block (widen_codes): exactly the sum that widening every call would give.
static inline IVec dot4(IVec acc, IVec codes, const int8_t* x) {
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(codes, _mm256_set1_epi32(load_i32(x))));
}
static inline IVec dot4_bytes(IVec acc, IVec weights, const int8_t* x) {  // int8 pairs reach 32258: widened at once
  const IVec xs = _mm256_set1_epi32(load_i32(x));
  return _mm256_add_epi32(acc, widen_codes(_mm256_maddubs_epi16(_mm256_abs_epi8(xs), _mm256_sign_epi8(weights, xs))));
}
static inline IVec ivzero() { return _mm256_setzero_si256(); }
static inline IVec ivadd(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
static inline IVec ivset(int32_t v) { return _mm256_set1_epi32(v); }
static inline Vec ivfloat(IVec v) { return _mm256_cvtepi32_ps(v); }
#endif

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

// cap * tanh(x / cap) for 8 floats (a softcapped attention score): tanh|y| = (1 - e) / (1 + e), e = exp(-2|y|), the
// sign put back; exact enough for a score (absolute error ~cap * 1e-7) and a function of each lane alone.
static inline __m256 softcap8(__m256 x, float cap) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.0f / cap));
  const __m256 e = exp8(_mm256_mul_ps(_mm256_andnot_ps(sign, y), _mm256_set1_ps(-2.0f)));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  return _mm256_mul_ps(_mm256_or_ps(t, _mm256_and_ps(sign, y)), _mm256_set1_ps(cap));
}

}  // namespace polyspec
