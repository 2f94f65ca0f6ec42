// Torch bindings of the GGUF matmul kernels (ops in the `octavo_cpu` namespace):
//   gguf_matmul(x, weight, qtype, in_features, isa) -> y    y = x W^T, W in its GGUF blocks
//   gguf_dequantize(weight, qtype, in_features) -> W        float32 [rows, in_features]
//   quant_isas() -> [str]                                   instruction sets this CPU runs
// qtype is quant_common.h's QType (0 Q4_0, 1 Q4_1, 2 Q8_0, 3 Q4_K, 4 Q6_K). This file checks
// the inputs, quantizes the activations (rows in parallel), splits the output features over
// torch's threads (at::parallel_for) and calls the best instruction set the CPU has
// (quant_<isa>.cpp). Compiled for the generic x86-64: nothing here needs AVX.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "quant_common.h"

namespace octavo_cpu {
namespace {

enum class QIsa { kAvx2, kAvx512Vnni };

const char* qisa_name(QIsa isa) { return isa == QIsa::kAvx2 ? "avx2" : "avx512vnni"; }

std::vector<QIsa> detect_quant_isas() {
  std::vector<QIsa> isas;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (avx2) isas.push_back(QIsa::kAvx2);
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")) {
    isas.push_back(QIsa::kAvx512Vnni);
  }
#endif
  return isas;
}

const std::vector<QIsa>& quant_supported() {
  static const std::vector<QIsa> isas = detect_quant_isas();
  return isas;
}

QIsa choose_quant_isa(const std::string& requested) {
  const auto& isas = quant_supported();
  TORCH_CHECK(!isas.empty(), "octavo_cpu: this CPU has no AVX2; GGUF matmuls need it");
  if (requested.empty()) return isas.back();
  for (QIsa isa : isas) {
    if (requested == qisa_name(isa)) return isa;
  }
  std::string have;
  for (QIsa isa : isas) have += std::string(have.empty() ? "" : ", ") + qisa_name(isa);
  TORCH_CHECK(false, "octavo_cpu: instruction set '", requested, "' is not available for GGUF ",
              "matmuls on this CPU (available: ", have, ")");
}

struct Format {
  const char* name;
  int64_t block_elems;
  int64_t block_bytes;
};

Format format_of(int64_t qtype) {
  switch (qtype) {
    case int(QType::kQ4_0): return {"Q4_0", 32, 18};
    case int(QType::kQ4_1): return {"Q4_1", 32, 20};
    case int(QType::kQ8_0): return {"Q8_0", 32, 34};
    case int(QType::kQ4_K): return {"Q4_K", 256, 144};
    case int(QType::kQ6_K): return {"Q6_K", 256, 210};
    default:
      TORCH_CHECK(false, "octavo_cpu: unknown GGUF qtype code ", qtype,
                  " (0 Q4_0, 1 Q4_1, 2 Q8_0, 3 Q4_K, 4 Q6_K)");
  }
}

// The weight's shape against the format; returns the format.
Format check_weight(const at::Tensor& weight, int64_t qtype, int64_t in_features) {
  const Format f = format_of(qtype);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.dim() == 2,
              "octavo_cpu: GGUF weights must be a CPU uint8 tensor [out_features, bytes_per_row]",
              ", got ", weight.scalar_type(), " ", weight.sizes(), " on ", weight.device());
  TORCH_CHECK(in_features > 0 && in_features % f.block_elems == 0, "octavo_cpu: in_features ",
              in_features, " is not a positive multiple of ", f.name, "'s block of ",
              f.block_elems, " values");
  const int64_t row_bytes = in_features / f.block_elems * f.block_bytes;
  TORCH_CHECK(weight.size(1) == row_bytes, "octavo_cpu: a ", f.name, " row of ", in_features,
              " values takes ", row_bytes, " bytes, the weight has ", weight.size(1));
  TORCH_CHECK(weight.stride(1) == 1 && (weight.size(0) <= 1 || weight.stride(0) >= row_bytes),
              "octavo_cpu: each row of GGUF blocks must be contiguous");
  return f;
}

// Per-thread buffers kept between calls (grow only): no allocation per layer and step.
template <typename T>
T* grow(std::vector<T>& buffer, int64_t count) {
  if (int64_t(buffer.size()) < count) buffer.resize(count);
  return buffer.data();
}

at::Tensor gguf_matmul(const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                       int64_t in_features, std::string isa) {
  check_weight(weight, qtype, in_features);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "octavo_cpu: x must be a CPU float32 or bfloat16 tensor [tokens, in_features], ",
              "got ", x.scalar_type(), " ", x.sizes(), " on ", x.device());
  TORCH_CHECK(x.size(1) == in_features, "octavo_cpu: x has ", x.size(1),
              " features, the weight ", in_features);
  TORCH_CHECK(x.stride(1) == 1, "octavo_cpu: x's last dim must be contiguous");
  const QIsa chosen = choose_quant_isa(isa);
  const int64_t num_rows = x.size(0), out_features = weight.size(0);
  at::Tensor out = at::empty({num_rows, out_features}, x.options());
  if (num_rows == 0 || out_features == 0) return out;

  const int64_t num_chunks = in_features / kQChunk;
  thread_local std::vector<int8_t> q_buffer;
  thread_local std::vector<float> d_buffer, s_buffer;
  int8_t* q = grow(q_buffer, num_rows * in_features);
  float* d = grow(d_buffer, num_rows * num_chunks);
  float* s = grow(s_buffer, num_rows * num_chunks);
  const FloatRows rows{x.data_ptr(), x.stride(0), x.scalar_type() == at::kBFloat16};
  // At least ~16k values per thread, else the threads cost more than they save.
  const int64_t row_grain = std::max<int64_t>(1, 16384 / in_features);
  at::parallel_for(0, num_rows, row_grain, [&](int64_t begin, int64_t end) {
    if (chosen == QIsa::kAvx512Vnni) {
      avx512vnni::quantize_activations(rows, begin, end, in_features, q, d, s);
    } else {
      avx2::quantize_activations(rows, begin, end, in_features, q, d, s);
    }
  });

  QuantGemmArgs args;
  args.qtype = QType(qtype);
  args.weight = weight.data_ptr<uint8_t>();
  args.weight_stride = out_features > 1 ? weight.stride(0) : weight.size(1);
  args.num_rows = num_rows;
  args.out_features = out_features;
  args.in_features = in_features;
  args.x = QuantizedRows{q, d, s};
  args.out = out.data_ptr();
  args.out_stride = out_features;
  args.out_bf16 = x.scalar_type() == at::kBFloat16;
  // Threads take ranges of whole column groups (the tiles' widths divide 8), each at least
  // ~64k multiply-adds.
  constexpr int64_t kGroup = 8;
  const int64_t num_groups = (out_features + kGroup - 1) / kGroup;
  const int64_t group_grain =
      std::max<int64_t>(1, 65536 / std::max<int64_t>(1, num_rows * in_features * kGroup));
  at::parallel_for(0, num_groups, group_grain, [&](int64_t begin, int64_t end) {
    const int64_t col_begin = begin * kGroup;
    const int64_t col_end = std::min(out_features, end * kGroup);
    if (chosen == QIsa::kAvx512Vnni) {
      avx512vnni::quant_gemm(args, col_begin, col_end);
    } else {
      avx2::quant_gemm(args, col_begin, col_end);
    }
  });
  return out;
}

// ---- dequantization (generic C++: the embedding's row lookups and tests) ------------------

inline float fp16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

void dequantize_block(QType qtype, const uint8_t* p, float* y) {
  switch (qtype) {
    case QType::kQ4_0: {
      const float d = fp16(p);
      for (int i = 0; i < 16; ++i) {
        y[i] = d * float(int(p[2 + i] & 0x0F) - 8);
        y[i + 16] = d * float(int(p[2 + i] >> 4) - 8);
      }
      break;
    }
    case QType::kQ4_1: {
      const float d = fp16(p), m = fp16(p + 2);
      for (int i = 0; i < 16; ++i) {
        y[i] = d * float(p[4 + i] & 0x0F) + m;
        y[i + 16] = d * float(p[4 + i] >> 4) + m;
      }
      break;
    }
    case QType::kQ8_0: {
      const float d = fp16(p);
      for (int i = 0; i < 32; ++i) y[i] = d * float(int8_t(p[2 + i]));
      break;
    }
    case QType::kQ4_K: {
      const float d = fp16(p), dmin = fp16(p + 2);
      const uint8_t* s = p + 4;
      const uint8_t* qs = p + 16;
      for (int j = 0; j < 8; ++j) {
        const int sc = j < 4 ? (s[j] & 63) : ((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        const int mn = j < 4 ? (s[j + 4] & 63) : ((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
        const float scale = d * float(sc), offset = dmin * float(mn);
        const uint8_t* bytes = qs + 32 * (j / 2);
        for (int l = 0; l < 32; ++l) {
          const int v = (j & 1) ? (bytes[l] >> 4) : (bytes[l] & 0x0F);
          y[32 * j + l] = scale * float(v) - offset;
        }
      }
      break;
    }
    case QType::kQ6_K: {
      const uint8_t* ql = p;
      const uint8_t* qh = p + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
      const float d = fp16(p + 208);
      for (int h = 0; h < 2; ++h) {
        for (int l = 0; l < 32; ++l) {
          const uint8_t lo0 = ql[64 * h + l], lo1 = ql[64 * h + 32 + l], hi = qh[32 * h + l];
          const int q[4] = {(lo0 & 0x0F) | ((hi & 3) << 4), (lo1 & 0x0F) | (((hi >> 2) & 3) << 4),
                            (lo0 >> 4) | (((hi >> 4) & 3) << 4), (lo1 >> 4) | (((hi >> 6) & 3) << 4)};
          for (int k = 0; k < 4; ++k) {
            const int index = 128 * h + 32 * k + l;
            y[index] = d * float(sc[index / 16]) * float(q[k] - 32);
          }
        }
      }
      break;
    }
  }
}

at::Tensor gguf_dequantize(const at::Tensor& weight, int64_t qtype, int64_t in_features) {
  const Format f = check_weight(weight, qtype, in_features);
  const int64_t rows = weight.size(0);
  at::Tensor out = at::empty({rows, in_features}, weight.options().dtype(at::kFloat));
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const int64_t stride = rows > 1 ? weight.stride(0) : weight.size(1);
  float* y = out.data_ptr<float>();
  const int64_t blocks = in_features / f.block_elems;
  const int64_t grain = std::max<int64_t>(1, 65536 / in_features);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        dequantize_block(QType(qtype), w + r * stride + b * f.block_bytes,
                         y + r * in_features + b * f.block_elems);
      }
    }
  });
  return out;
}

std::vector<std::string> quant_isas() {
  std::vector<std::string> names;
  for (QIsa isa : quant_supported()) names.emplace_back(qisa_name(isa));
  return names;
}

}  // namespace
}  // namespace octavo_cpu

TORCH_LIBRARY_FRAGMENT(octavo_cpu, m) {
  m.def("quant_isas() -> str[]", &octavo_cpu::quant_isas);
  m.def("gguf_matmul(Tensor x, Tensor weight, int qtype, int in_features, str isa) -> Tensor",
        &octavo_cpu::gguf_matmul);
  m.def("gguf_dequantize(Tensor weight, int qtype, int in_features) -> Tensor",
        &octavo_cpu::gguf_dequantize);
}
