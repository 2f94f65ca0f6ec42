// The decoder's small per-layer ops as one call each (ops in the `octavo_cpu` namespace), for
// the CPU: at batch 1 a decode step is ~30 layers of vectors of a few hundred values, where
// torch's eager form of these ops (6-15 dispatches each) costs more than the arithmetic.
//   rms_norm(x, weight, eps) -> y                    y = weight * (x / rms(x))
//   fused_add_rms_norm(x, residual, weight, eps) -> (y, s)   s = x + residual, y = rms_norm(s)
//   rotary_neox(positions, query, key, cos_sin) -> (q, k)    rotated copies (neox halves)
//   silu_and_mul(x) -> y                              y = silu(x[..., :d]) * x[..., d:]
// Same math and roundings as the torch code of octavo.model_executor.layers (rmsnorm.py,
// rotary.py, activation.py): float32 arithmetic, results rounded to the input's dtype where
// torch rounds them (bfloat16/float16). Inputs are never modified. Compiled for the generic
// x86-64 (no FMA contraction: products are rounded before they are added, as in torch's eager
// ops); rows in parallel over torch's threads only when there are many. SiLU-and-mul on
// float32 has an AVX2 path (a vector exp), chosen at run time where the CPU has AVX2 and FMA.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define OCTAVO_SILU_AVX2 1
namespace octavo_cpu {
namespace avx2 {
// silu_avx2.cpp: one float32 row, 8 values at a time; returns how many values it did.
int64_t silu_mul_row(const float* g, const float* u, float* y, int64_t d);
}  // namespace avx2
}  // namespace octavo_cpu
#endif

namespace octavo_cpu {
namespace {

// Rows per thread below which the op runs on the calling thread alone.
constexpr int64_t kRowGrain = 16;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "octavo_cpu: ", name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 ||
                  t.scalar_type() == at::kHalf,
              "octavo_cpu: ", name, " must be float32, bfloat16 or float16, got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() >= 1, "octavo_cpu: ", name, " must have at least one dim");
}

// t itself when its rows are evenly strided with a contiguous last dim (any 1-D/2-D tensor
// with stride(-1) == 1, or a contiguous one), else a contiguous copy.
at::Tensor as_rows(const at::Tensor& t) {
  if (t.stride(-1) == 1 && (t.dim() <= 2 || t.is_contiguous())) return t;
  return t.contiguous();
}

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }

// x rows of `hidden` values; rows r at x + r * x_stride. The product weight * normed is
// rounded as torch rounds it: normed first to T, then the product to T.
template <typename T>
void rms_rows(const T* x, int64_t x_stride, const T* residual, int64_t r_stride, const T* weight,
              T* y, T* summed, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* yr = y + r * hidden;
      const T* source = xr;
      if (residual != nullptr) {
        const T* rr = residual + r * r_stride;
        T* sr = summed + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) sr[i] = T(f32(xr[i]) + f32(rr[i]));
        source = sr;
      }
      float sum = 0.0f;
      for (int64_t i = 0; i < hidden; ++i) {
        const float v = f32(source[i]);
        sum += v * v;
      }
      const float inv = 1.0f / std::sqrt(sum / float(hidden) + eps);
      for (int64_t i = 0; i < hidden; ++i) {
        const T normed = T(f32(source[i]) * inv);
        yr[i] = T(f32(weight[i]) * f32(normed));
      }
    }
  });
}

template <typename T>
void rms_dispatch(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                  at::Tensor& y, at::Tensor* summed, double eps) {
  const int64_t hidden = x.size(-1), rows = x.numel() / std::max<int64_t>(hidden, 1);
  rms_rows<T>(x.data_ptr<T>(), x.dim() > 1 ? x.stride(-2) : hidden,
              residual ? residual->data_ptr<T>() : nullptr,
              residual && residual->dim() > 1 ? residual->stride(-2) : hidden,
              weight.data_ptr<T>(), y.data_ptr<T>(), summed ? summed->data_ptr<T>() : nullptr,
              rows, hidden, float(eps));
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1) &&
                  weight.scalar_type() == x.scalar_type(),
              "octavo_cpu: the norm's weight must be a contiguous [", x.size(-1), "] ",
              x.scalar_type(), " tensor, got ", weight.scalar_type(), " ", weight.sizes());
}

#define OCTAVO_FLOAT_TYPES(t, NAME, ...)                                  \
  switch (t) {                                                            \
    case at::kFloat: { using NAME = float; __VA_ARGS__; break; }          \
    case at::kBFloat16: { using NAME = c10::BFloat16; __VA_ARGS__; break; } \
    case at::kHalf: { using NAME = c10::Half; __VA_ARGS__; break; }       \
    default: TORCH_CHECK(false, "octavo_cpu: unsupported dtype ", t);     \
  }

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  check_norm(x_in, weight);
  const at::Tensor x = as_rows(x_in);
  at::Tensor y = at::empty(x.sizes(), x.options());
  OCTAVO_FLOAT_TYPES(x.scalar_type(), T, rms_dispatch<T>(x, nullptr, weight, y, nullptr, eps));
  return y;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x_in,
                                                      const at::Tensor& residual_in,
                                                      const at::Tensor& weight, double eps) {
  check_norm(x_in, weight);
  check_rows(residual_in, "residual");
  TORCH_CHECK(residual_in.sizes() == x_in.sizes() &&
                  residual_in.scalar_type() == x_in.scalar_type(),
              "octavo_cpu: residual must have x's shape and dtype, got ", residual_in.sizes(),
              " ", residual_in.scalar_type());
  const at::Tensor x = as_rows(x_in), residual = as_rows(residual_in);
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor summed = at::empty(x.sizes(), x.options());
  OCTAVO_FLOAT_TYPES(x.scalar_type(), T,
                     rms_dispatch<T>(x, &residual, weight, y, &summed, eps));
  return {y, summed};
}

// One tensor of heads [tokens, heads, head_dim] (any strides but the last) rotated into a
// contiguous copy. cos/sin are rounded to T first (rotary.py casts them to x's dtype), every
// product and the sum rounded to T, as torch's eager ops do.
template <typename T>
void rotate(const at::Tensor& x, const int64_t* pos, const float* cos_sin, int64_t cs_stride,
            at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const T* in = x.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cs = cos_sin + pos[t] * cs_stride;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = in + t * st + h * sh;
        T* orow = o + (t * heads + h) * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float c = f32(T(cs[i])), s = f32(T(cs[half + i]));
          const float x1 = f32(xr[i]), x2 = f32(xr[half + i]);
          const float a = f32(T(x1 * c)), b = f32(T(x2 * s));
          const float e = f32(T(x2 * c)), g = f32(T(x1 * s));
          orow[i] = T(a - b);
          orow[half + i] = T(e + g);
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary_neox(const at::Tensor& positions,
                                               const at::Tensor& query_in,
                                               const at::Tensor& key_in,
                                               const at::Tensor& cos_sin) {
  check_rows(query_in, "query");
  check_rows(key_in, "key");
  // Any strides but a contiguous last dim (views into the merged QKV output stay views).
  const at::Tensor query = query_in.stride(-1) == 1 ? query_in : query_in.contiguous();
  const at::Tensor key = key_in.stride(-1) == 1 ? key_in : key_in.contiguous();
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && key.size(0) == query.size(0) &&
                  key.size(2) == query.size(2) && key.scalar_type() == query.scalar_type(),
              "octavo_cpu: query and key must be [tokens, heads, head_dim] of one dtype and "
              "head_dim, got ", query.sizes(), " and ", key.sizes());
  TORCH_CHECK(positions.device().is_cpu() && positions.scalar_type() == at::kLong &&
                  positions.dim() == 1 && positions.size(0) == query.size(0) &&
                  positions.is_contiguous(),
              "octavo_cpu: positions must be a contiguous int64 [tokens] CPU tensor");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.dim() == 2 &&
                  cos_sin.size(1) == query.size(2) && cos_sin.stride(1) == 1 &&
                  query.size(2) % 2 == 0,
              "octavo_cpu: cos_sin must be float32 [max_positions, head_dim] (even head_dim)");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_positions = cos_sin.size(0);
  for (int64_t t = 0; t < positions.size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_positions, "octavo_cpu: position ", pos[t],
                " is outside the rotary table of ", max_positions, " positions");
  }
  at::Tensor q = at::empty(query.sizes(), query.options());
  at::Tensor k = at::empty(key.sizes(), key.options());
  const float* cs = cos_sin.data_ptr<float>();
  OCTAVO_FLOAT_TYPES(query.scalar_type(), T,
                     rotate<T>(query, pos, cs, cos_sin.stride(0), q);
                     rotate<T>(key, pos, cs, cos_sin.stride(0), k));
  return {q, k};
}

#ifdef OCTAVO_SILU_AVX2
bool silu_avx2() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
}
#endif

// silu(g) = g / (1 + exp(-g)) in float32, rounded to T, times up rounded to T.
template <typename T>
void silu_mul_rows(const T* x, int64_t x_stride, T* y, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * x_stride;
      const T* u = g + d;
      T* yr = y + r * d;
      int64_t start = 0;
#ifdef OCTAVO_SILU_AVX2
      if constexpr (std::is_same_v<T, float>) {
        if (silu_avx2()) start = avx2::silu_mul_row(g, u, yr, d);
      }
#endif
      for (int64_t i = start; i < d; ++i) {
        const float v = f32(g[i]);
        const T silu = T(v / (1.0f + std::exp(-v)));
        yr[i] = T(f32(silu) * f32(u[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x_in) {
  check_rows(x_in, "x");
  const at::Tensor x = as_rows(x_in);
  TORCH_CHECK(x.size(-1) % 2 == 0, "octavo_cpu: silu_and_mul needs an even last dim, got ",
              x.size(-1));
  const int64_t d = x.size(-1) / 2, rows = x.numel() / std::max<int64_t>(x.size(-1), 1);
  auto sizes = x.sizes().vec();
  sizes.back() = d;
  at::Tensor y = at::empty(sizes, x.options());
  const int64_t stride = x.dim() > 1 ? x.stride(-2) : x.size(-1);
  OCTAVO_FLOAT_TYPES(x.scalar_type(), T,
                     silu_mul_rows<T>(x.data_ptr<T>(), stride, y.data_ptr<T>(), rows, d));
  return y;
}

}  // namespace
}  // namespace octavo_cpu

TORCH_LIBRARY_FRAGMENT(octavo_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &octavo_cpu::rms_norm);
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> "
        "(Tensor, Tensor)", &octavo_cpu::fused_add_rms_norm);
  m.def("rotary_neox(Tensor positions, Tensor query, Tensor key, Tensor cos_sin) -> "
        "(Tensor, Tensor)", &octavo_cpu::rotary_neox);
  m.def("silu_and_mul(Tensor x) -> Tensor", &octavo_cpu::silu_and_mul);
}
