// The GGUF matmul kernels of quant_impl.h for CPUs with AVX2, FMA and F16C: integer dot
// products through vpmaddubsw (u8 x s8 -> pairs of int16) and vpmaddwd (-> int32).
// Compiled for that instruction set by the pragma (the build passes no -m flags);
// quant_ops.cpp calls into it only after checking at run time that the CPU has it.
#include "quant_common.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#include <stdlib.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace octavo_cpu {
namespace avx2 {

// int32 lane i = sum of the products u8 x s8 of bytes 4i..4i+3 (never saturates: |u| <= 128
// and |s| <= 127 in every caller, so a pair of products fits int16).
inline __attribute__((always_inline)) __m256i qdot(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

#include "quant_impl.h"
}  // namespace avx2
}  // namespace octavo_cpu

#pragma GCC pop_options
#endif
