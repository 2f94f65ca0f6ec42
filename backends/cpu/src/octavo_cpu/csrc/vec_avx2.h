// float32 vectors of 8 lanes (AVX2 + FMA + F16C) for attention_impl.h. Included inside
// namespace octavo_cpu::avx2, after `#pragma GCC target("avx2,fma,f16c")`.
#pragma once

#define OCTAVO_INLINE inline __attribute__((always_inline))

constexpr int kWidth = 8;

struct Vec {
  __m256 v;
};

OCTAVO_INLINE Vec vzero() { return {_mm256_setzero_ps()}; }
OCTAVO_INLINE Vec vset(float x) { return {_mm256_set1_ps(x)}; }
OCTAVO_INLINE Vec vadd(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
OCTAVO_INLINE Vec vsub(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
OCTAVO_INLINE Vec vmul(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
OCTAVO_INLINE Vec vmax(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
OCTAVO_INLINE Vec vdiv(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
// |a|, and |mag| with the sign of `sign`.
OCTAVO_INLINE Vec vabs(Vec a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.v)}; }
OCTAVO_INLINE Vec vcopysign(Vec mag, Vec sign) {
  const __m256 bit = _mm256_set1_ps(-0.0f);
  return {_mm256_or_ps(_mm256_andnot_ps(bit, mag.v), _mm256_and_ps(bit, sign.v))};
}
// a * b + c
OCTAVO_INLINE Vec vfma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }

OCTAVO_INLINE Vec vload(const float* p) { return {_mm256_loadu_ps(p)}; }
OCTAVO_INLINE Vec vload(const bf16_t* p) {
  // bfloat16 is the top half of a float32: widen and shift.
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))};
}
OCTAVO_INLINE Vec vload(const f16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}

OCTAVO_INLINE void vstore(float* p, Vec a) { _mm256_storeu_ps(p, a.v); }
OCTAVO_INLINE void vstore(bf16_t* p, Vec a) {
  // Round to nearest even, NaN -> 0x7FC0: what torch's float -> bfloat16 conversion does.
  __m256i bits = _mm256_castps_si256(a.v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  __m256 is_nan = _mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q);
  rounded = _mm256_castps_si256(_mm256_blendv_ps(
      _mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), is_nan));
  __m256i halves = _mm256_srli_epi32(rounded, 16);
  // packus works within 128-bit lanes: [a0..a3 a0..a3 | a4..a7 a4..a7] -> gather lanes 0 and 2.
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(halves, halves), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
OCTAVO_INLINE void vstore(f16_t* p, Vec a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

OCTAVO_INLINE float hsum(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
OCTAVO_INLINE float hmax(Vec a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// out[0..3] = horizontal sums of a, b, c, d.
OCTAVO_INLINE void hsum4(Vec a, Vec b, Vec c, Vec d, float* out) {
  __m256 ab = _mm256_hadd_ps(a.v, b.v);
  __m256 cd = _mm256_hadd_ps(c.v, d.v);
  __m256 abcd = _mm256_hadd_ps(ab, cd);  // [a b c d | a b c d] partial sums per 128-bit lane
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}

OCTAVO_INLINE __m256 hsum8_256(__m256 a, __m256 b, __m256 c, __m256 d, __m256 e, __m256 f,
                                __m256 g, __m256 h) {
  __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  __m256 efgh = _mm256_hadd_ps(_mm256_hadd_ps(e, f), _mm256_hadd_ps(g, h));
  // abcd = [a b c d | a b c d] partial sums of each 128-bit lane; same for efgh.
  return _mm256_add_ps(_mm256_permute2f128_ps(abcd, efgh, 0x20),
                       _mm256_permute2f128_ps(abcd, efgh, 0x31));
}
// out[0..7] = horizontal sums of v[0..7].
OCTAVO_INLINE void hsum8(const Vec* v, float* out) {
  _mm256_storeu_ps(out, hsum8_256(v[0].v, v[1].v, v[2].v, v[3].v, v[4].v, v[5].v, v[6].v,
                                  v[7].v));
}

// exp(x) (softmax arguments, and SiLU's exp(-g)): Cephes expf, about 1 ulp. Inputs below -87
// give 0 (exp(-87) < 2e-38; -inf gives 0), inputs above 88 are taken as 88 (exp stays finite).
OCTAVO_INLINE Vec vexp(Vec a) {
  const __m256 x_in = a.v;
  // Constants first: min/max return their second operand when one is NaN, so NaN stays NaN.
  __m256 x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x_in));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                              _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127));
  __m256 pow2n = _mm256_castsi256_ps(_mm256_slli_epi32(n, 23));
  __m256 result = _mm256_mul_ps(y, pow2n);
  __m256 tiny = _mm256_cmp_ps(x_in, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  return {_mm256_andnot_ps(tiny, result)};
}
