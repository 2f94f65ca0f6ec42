// SiLU-and-mul of one float32 row with AVX2 and FMA, for layer_ops.cpp (glibc's scalar expf
// was most of that op's time). Compiled for that instruction set by the pragma below, like
// attention_avx2.cpp, and called only after layer_ops.cpp checked the CPU at run time; its exp
// is the attention kernels' vexp (vec_avx2.h).
#include "common.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#include <math.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace octavo_cpu {
namespace avx2 {

#include "vec_avx2.h"

// y = silu(g) * u for the first d - d % 8 values (the caller does the tail); returns how many.
int64_t silu_mul_row(const float* g, const float* u, float* y, int64_t d) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256 v = _mm256_loadu_ps(g + i);
    const __m256 e = vexp({_mm256_xor_ps(v, sign)}).v;  // exp(-v)
    const __m256 silu = _mm256_div_ps(v, _mm256_add_ps(one, e));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
  }
  return i;
}

}  // namespace avx2
}  // namespace octavo_cpu

#pragma GCC pop_options
#endif
