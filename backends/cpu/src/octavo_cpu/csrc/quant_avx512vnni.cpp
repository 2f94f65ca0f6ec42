// The GGUF matmul kernels of quant_impl.h for CPUs with AVX-512 VNNI (and VL): the integer
// dot products are one vpdpbusd each (u8 x s8, four products summed into int32, no int16
// saturation), on 256-bit vectors (the tiles of quant_impl.h are 256-bit; VL gives vpdpbusd
// that width without the clock penalty some CPUs pay for 512-bit vectors).
// Compiled for that instruction set by the pragma (the build passes no -m flags);
// quant_ops.cpp calls into it only after checking at run time that the CPU has it.
#include "quant_common.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#include <stdlib.h>

#define OCTAVO_QUANT_VNNI 1

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

namespace octavo_cpu {
namespace avx512vnni {

inline __attribute__((always_inline)) __m256i qdot(__m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}

#include "quant_impl.h"
}  // namespace avx512vnni
}  // namespace octavo_cpu

#pragma GCC pop_options
#endif
