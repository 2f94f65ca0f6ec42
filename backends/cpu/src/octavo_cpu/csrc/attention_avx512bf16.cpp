// The kernels of attention_impl.h for CPUs with AVX-512 F/BW/VL/DQ and AVX512_BF16 (16
// float32 lanes; bfloat16 scores with vdpbf16ps).
// The pragma below compiles this whole file for that instruction set (the build passes no -m
// flags); ops.cpp calls into it only after checking at run time that the CPU has it. Headers
// that define inline functions are included above the pragma, so their code stays generic
// (common.h says why). Other compilers than GCC, or machines other than x86-64, compile this
// file to nothing.
#include "common.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#include <math.h>
#include <omp.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")

namespace octavo_cpu {
namespace avx512bf16 {
#define OCTAVO_BF16_DOT 1
#include "vec_avx512.h"
#include "attention_impl.h"
}  // namespace avx512bf16
}  // namespace octavo_cpu

#pragma GCC pop_options
#endif
