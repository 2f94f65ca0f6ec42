// Shared declarations of the CPU kernels for GGUF-quantized linear layers: plain C++, no torch
// headers (common.h says why the per-ISA files must not see any).
//
// y[m, n] = sum_k x[m, k] * W[n, k], where W stays in its GGUF blocks: row n of W is
// in_features / block_elems consecutive blocks of block_bytes bytes. The activations x are
// first quantized per row and per 32 values to int8 ("chunks"), q8 = round(x / dx) with
// dx = max|x| / 127 per chunk, so that each chunk of a weight row meets its chunk of x in one
// integer dot product (vpmaddubsw + vpmaddwd on AVX2, vpdpbusd with AVX-512 VNNI). Every format
// is read, chunk by chunk, as  w = d * q + m  with per-chunk float d and m:
//   Q4_0   18 B / 32:  f16 d, 16 B of nibbles (low: values 0-15, high: 16-31); w = d (q - 8)
//   Q4_1   20 B / 32:  f16 d, f16 m, 16 B of nibbles;                          w = d q + m
//   Q8_0   34 B / 32:  f16 d, 32 x int8;                                      w = d q
//   Q4_K  144 B / 256: f16 d, f16 dmin, 12 B of 6-bit scales and mins (8 each), 128 B of
//                      nibbles (bytes 32i..32i+31: low nibbles = chunk 2i, high = chunk 2i+1);
//                      w = d sc_j q - dmin mn_j for chunk j
//   Q6_K  210 B / 256: 128 B low nibbles ql, 64 B high 2 bits qh, 16 x int8 scales (one per
//                      16 values), f16 d; w = d sc (q - 32)
// so y = sum over chunks of d * dx * dot(q, q8) + m * dx * sum(q8): the second term uses the
// chunk sums of q8 (kept beside dx as sx = dx * sum(q8)). Signed formats (Q8_0, Q6_K) use
// |q| and q8 with q's sign instead.
#pragma once

#include <cstddef>
#include <cstdint>

namespace octavo_cpu {

enum class QType : int { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kQ4_K = 3, kQ6_K = 4 };

// Activations and weights meet in chunks of this many values (one 256-bit vector of int8).
constexpr int kQChunk = 32;

// Activations quantized per chunk (quantize_activations fills them).
struct QuantizedRows {
  const int8_t* q;  // [num_rows, in_features]
  const float* d;   // [num_rows, in_features / kQChunk]  dx: the chunk's scale
  const float* s;   // [num_rows, in_features / kQChunk]  sx = dx * sum of the chunk's q
};

// One matmul: weights, quantized activations, and where the output goes.
struct QuantGemmArgs {
  QType qtype;
  const uint8_t* weight;  // row n starts at weight + n * weight_stride (bytes)
  int64_t weight_stride;
  int64_t num_rows;       // M: tokens
  int64_t out_features;   // N
  int64_t in_features;    // K (a multiple of the format's block)
  QuantizedRows x;
  void* out;              // [M, N] at out_stride elements per row
  int64_t out_stride;
  bool out_bf16;          // bfloat16 output (else float32)
};

// The float input to quantize: float32 or bfloat16 rows.
struct FloatRows {
  const void* data;
  int64_t stride;  // elements between rows
  bool bf16;
};

// From this many rows on, weights are unpacked into panels of 8 columns first (quant_impl.h).
constexpr int64_t kPanelMinRows = 4;

#define OCTAVO_DECLARE_QUANT_ISA(isa)                                                         \
  namespace isa {                                                                             \
  /* Quantize rows [row_begin, row_end) of x ([*, in_features]) into q, d, s. */              \
  void quantize_activations(const FloatRows& x, int64_t row_begin, int64_t row_end,           \
                            int64_t in_features, int8_t* q, float* d, float* s);              \
  /* Output columns [col_begin, col_end) of every row. */                                     \
  void quant_gemm(const QuantGemmArgs& args, int64_t col_begin, int64_t col_end);             \
  }

OCTAVO_DECLARE_QUANT_ISA(avx2)
OCTAVO_DECLARE_QUANT_ISA(avx512vnni)

#undef OCTAVO_DECLARE_QUANT_ISA

}  // namespace octavo_cpu
