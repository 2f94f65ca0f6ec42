// float32 vectors of 16 lanes (AVX-512 F/BW/VL/DQ) for attention_impl.h. Included inside
// namespace octavo_cpu::avx512 (or ::avx512bf16), after the matching `#pragma GCC target`.
#pragma once

#define OCTAVO_INLINE inline __attribute__((always_inline))

constexpr int kWidth = 16;

struct Vec {
  __m512 v;
};

OCTAVO_INLINE Vec vzero() { return {_mm512_setzero_ps()}; }
OCTAVO_INLINE Vec vset(float x) { return {_mm512_set1_ps(x)}; }
OCTAVO_INLINE Vec vadd(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
OCTAVO_INLINE Vec vsub(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
OCTAVO_INLINE Vec vmul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
OCTAVO_INLINE Vec vmax(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
// a * b + c
OCTAVO_INLINE Vec vfma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
OCTAVO_INLINE Vec vdiv(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
// |a|, and |mag| with the sign of `sign`.
OCTAVO_INLINE Vec vabs(Vec a) { return {_mm512_abs_ps(a.v)}; }
OCTAVO_INLINE Vec vcopysign(Vec mag, Vec sign) {
  const __m512i bit = _mm512_set1_epi32(int(0x80000000u));
  const __m512i m = _mm512_andnot_si512(bit, _mm512_castps_si512(mag.v));
  const __m512i s = _mm512_and_si512(bit, _mm512_castps_si512(sign.v));
  return {_mm512_castsi512_ps(_mm512_or_si512(m, s))};
}

OCTAVO_INLINE Vec vload(const float* p) { return {_mm512_loadu_ps(p)}; }
OCTAVO_INLINE Vec vload(const bf16_t* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
OCTAVO_INLINE Vec vload(const f16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}

OCTAVO_INLINE void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
OCTAVO_INLINE void vstore(bf16_t* p, Vec a) {
  // Round to nearest even, NaN -> 0x7FC0: what torch's float -> bfloat16 conversion does.
  __m512i bits = _mm512_castps_si512(a.v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  __mmask16 is_nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, is_nan, _mm512_set1_epi32(0x7FC00000));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
OCTAVO_INLINE void vstore(f16_t* p, Vec a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

OCTAVO_INLINE float hsum(Vec a) { return _mm512_reduce_add_ps(a.v); }
OCTAVO_INLINE float hmax(Vec a) { return _mm512_reduce_max_ps(a.v); }

OCTAVO_INLINE __m256 fold256(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
}
// out[0..3] = horizontal sums of a, b, c, d.
OCTAVO_INLINE void hsum4(Vec a, Vec b, Vec c, Vec d, float* out) {
  __m256 ab = _mm256_hadd_ps(fold256(a.v), fold256(b.v));
  __m256 cd = _mm256_hadd_ps(fold256(c.v), fold256(d.v));
  __m256 abcd = _mm256_hadd_ps(ab, cd);
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}

// out[0..7] = horizontal sums of v[0..7].
OCTAVO_INLINE void hsum8(const Vec* v, float* out) {
  __m256 f[8];
  for (int i = 0; i < 8; ++i) f[i] = fold256(v[i].v);
  __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(f[0], f[1]), _mm256_hadd_ps(f[2], f[3]));
  __m256 efgh = _mm256_hadd_ps(_mm256_hadd_ps(f[4], f[5]), _mm256_hadd_ps(f[6], f[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(abcd, efgh, 0x20),
                                      _mm256_permute2f128_ps(abcd, efgh, 0x31)));
}

// exp(x) for x <= 0 (softmax arguments; -inf gives 0): Cephes expf, about 1 ulp. Inputs below
// -87 give 0 (exp(-87) < 2e-38, nothing next to the row maximum's exp(0) = 1).
OCTAVO_INLINE Vec vexp(Vec a) {
  const __m512 x_in = a.v;
  // Constants first: min/max return their second operand when one is NaN, so NaN stays NaN.
  __m512 x = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x_in));
  __m512 fx = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  __m512i n = _mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127));
  __m512 result = _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(n, 23)));
  __mmask16 tiny = _mm512_cmp_ps_mask(x_in, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  return {_mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), result)};
}
