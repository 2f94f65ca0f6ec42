// Int4 (GPTQ layout) weight-only GEMV for 1 to 8 rows on tensor cores: out = x @ W^T.
//
// Compiled at run time with NVRTC (octavo_cuda/int4_mma.py), specialised by the macros
//   VEC     words loaded per thread and row half (1, 2 or 4: 4, 8 or 16-byte loads);
//           a block takes 16 * VEC outputs
//   WARPS   warps per block, splitting the block's groups (K) between them
//   GROUP   the quantization group size (a multiple of 32)
//   BF16    1: bfloat16 activations and output, 0: float16
//   PANELS  1: qweight in 32-output panels (below), 0: GPTQ's rows
//   EARLY_TRIGGER  1: the next kernel may launch (PDL) once this one has waited for the one
//           before, 0: once this block's sums are done (before the warps' partials meet)
//   NORM    1: the RMS norm before the GEMV in the kernel (below; one row of K = NORM_K
//           values, which the launch passes with it: the shared-memory row's size)
//
// Operands as octavo.kernels.int4 holds them: qweight int32 [K / 8, N] (input 8r + j of output
// n in nibble j of word (r, n)) or, PANELS, the same words in 32-output panels
// [N / 32, K / 8, 32] (word (r, n) at (n / 32) * (K / 8) * 32 + 32 r + n % 32: a block's words
// of a group are one contiguous run), scales and zeros float16 [G, N], x [M, K] (row stride
// stride_xm), out [M, N] contiguous. W[n, k] = (q[k, n] - zeros[g, n]) * scales[g, n].
//
// How the words become mma.sync m16n8k16 operands without shuffles or shared memory. The
// weight tile is A (16 outputs x 16 inputs), x is B (16 inputs x 8 columns: column c is row c
// of x; columns past M repeat row 0 and are not stored), C is 16 x 8 in float32. A sum over k
// does not depend on the order of k, so the 16 inputs of an mma can be any 16 inputs, as long
// as A and B agree. Lane (g = lane / 4, t = lane % 4) holds A at rows g and g + 8, mma
// columns 2t, 2t + 1, 2t + 8, 2t + 9, and B at the same columns. A chunk of 32 inputs is four
// word rows; lane t takes word row t of the chunk, one word per output: its eight nibbles are
// the lane's four columns of two mmas (k-tile j = 0, 1):
//   columns 2t, 2t + 1     <- nibbles 2j, 2j + 4      ((w >> 8j) & 0x000F000F: one LOP3)
//   columns 2t + 8, 2t + 9 <- nibbles 2j + 1, 2j + 5  ((w >> (8j + 4)) & 0x000F000F)
// ORed with 0x43004300 (bfloat16) or 0x64006400 (float16) each pair is two exact floats
// 128 + q (1024 + q), so a word is four A registers after 3 shifts and 4 LOP3s. B takes x
// at the same inputs: one 16-byte load of x[8r .. 8r + 7] and four PRMTs per chunk.
// The offset and the zero point are applied once per group and output:
//   sum_k x (q - z) = sum_k x (128 + q) - (128 + z) sum_k x
// with sum_k x from one more mma per k-tile (A all ones), shared by the block's outputs.
// With VEC words per load, mma tile i of a lane holds outputs n0 + VEC g + i (row g) and
// n0 + 8 VEC + VEC g + i (row g + 8).
//
// Each warp takes a contiguous run of groups and keeps the next group's words, scales and
// zeros (and x) in flight while it sums the current one; the first group's are loaded before
// the PDL wait (no kernel of the step writes weights). (Scales and zeros loaded where they
// are used cost the warp a memory round trip per group, after its sums.) Warps' partial
// sums meet in shared memory.

#ifndef VEC
#define VEC 1
#endif
#ifndef WARPS
#define WARPS 4
#endif
#ifndef GROUP
#define GROUP 128
#endif
#ifndef BF16
#define BF16 1
#endif
#ifndef PANELS
#define PANELS 0
#endif
#ifndef EARLY_TRIGGER
#define EARLY_TRIGGER 1
#endif
#ifndef NORM
#define NORM 0
#endif
#if NORM && !defined(NORM_K)
#error "NORM needs NORM_K, the row's length (octavo_cuda.int4_mma passes it)"
#endif

#define PANEL 32
#define CHUNKS (GROUP / 32)
#define ROWS (16 * VEC)
// 32-bit words that hold a lane's VEC float16 scales (or zeros) of one mma row
#define HALVES ((VEC + 1) / 2)
#define MAX_M 8

#if BF16
#define MAGIC 0x43004300u
#define OFFSET 128.0f
#define MMA "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
#define ONES 0x3F803F80u
#else
#define MAGIC 0x64006400u
#define OFFSET 1024.0f
#define MMA "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
#define ONES 0x3C003C00u
#endif

typedef unsigned int u32;
typedef unsigned short u16;

struct Words {
  u32 a[CHUNKS][VEC];  // row-g words of each chunk
  u32 b[CHUNKS][VEC];  // row-(g + 8) words
  u32 sa[HALVES], sb[HALVES];  // the group's float16 scales of the row-g and row-(g + 8) outputs
  u32 za[HALVES], zb[HALVES];  // and zeros
};

struct XRows {
  u32 v[CHUNKS][4];  // x[8r .. 8r + 7] of the lane's word row of each chunk
};

// Weights stream past L1 (no_allocate). Not .nc: ptxas moves the PDL wait (ACQBULK) above
// non-coherent loads, and the first group's words are meant to load before it.
__device__ __forceinline__ void load_vec(u32 (&dst)[VEC], const int* p) {
#if VEC == 4
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(dst[0]), "=r"(dst[1]), "=r"(dst[2]), "=r"(dst[3]) : "l"(p));
#elif VEC == 2
  asm volatile("ld.global.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
               : "=r"(dst[0]), "=r"(dst[1]) : "l"(p));
#else
  asm volatile("ld.global.L1::no_allocate.u32 %0, [%1];" : "=r"(dst[0]) : "l"(p));
#endif
}

// VEC consecutive float16 values, two to a word (VEC 1: the low half)
__device__ __forceinline__ void load_halves(u32 (&dst)[HALVES], const u16* p) {
#if VEC == 4
  asm volatile("ld.global.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
               : "=r"(dst[0]), "=r"(dst[1]) : "l"(p));
#elif VEC == 2
  asm volatile("ld.global.L1::no_allocate.u32 %0, [%1];" : "=r"(dst[0]) : "l"(p));
#else
  u16 h;
  asm volatile("ld.global.L1::no_allocate.u16 %0, [%1];" : "=h"(h) : "l"(p));
  dst[0] = h;
#endif
}

__device__ __forceinline__ u16 half_of(const u32 (&w)[HALVES], int i) {
  return (u16)(w[i / 2] >> (16 * (i % 2)));
}

// The group's words: pa, pb point at the lane's words of row t of the group's first chunk
// (int32 offsets: the launch checks that qweight has fewer than 2^31 words); ps, pz at the
// group's scale and zero of the lane's first row-g output (row g + 8: 8 * VEC further).
__device__ __forceinline__ void load_words(Words& w, const int* pa, const int* pb, int chunk,
                                           const u16* ps, const u16* pz) {
#pragma unroll
  for (int u = 0; u < CHUNKS; ++u) {
    load_vec(w.a[u], pa + u * chunk);
    load_vec(w.b[u], pb + u * chunk);
  }
  load_halves(w.sa, ps);
  load_halves(w.sb, ps + 8 * VEC);
  load_halves(w.za, pz);
  load_halves(w.zb, pz + 8 * VEC);
}

// x[8r .. 8r + 7] of the lane's word row r of each chunk of a group (p: the first chunk's)
__device__ __forceinline__ void load_x(XRows& xr, const u16* p) {
#pragma unroll
  for (int u = 0; u < CHUNKS; ++u) {
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(xr.v[u][0]), "=r"(xr.v[u][1]), "=r"(xr.v[u][2]), "=r"(xr.v[u][3])
                 : "l"(p + 32 * u));
  }
}

#if NORM
// x[8r .. 8r + 7] of each chunk from the normed row in shared memory (p: the first chunk's)
__device__ __forceinline__ void load_x_shared(XRows& xr, const u16* p) {
#pragma unroll
  for (int u = 0; u < CHUNKS; ++u) {
    const uint4 v = *reinterpret_cast<const uint4*>(p + 32 * u);
    xr.v[u][0] = v.x;
    xr.v[u][1] = v.y;
    xr.v[u][2] = v.z;
    xr.v[u][3] = v.w;
  }
}
#endif

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 selector) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

// (w & mask) | magic in one LOP3: both constants come in registers (as immediates ptxas
// splits it into two LOP3s, one immediate each)
__device__ __forceinline__ u32 nibble_pair(u32 w, u32 mask, u32 magic) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(w), "r"(mask), "r"(magic));
  return d;
}

__device__ __forceinline__ void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                    u32 b1) {
  asm(MMA " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float half_to_float(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ u16 float_to_out(float f) {
  u16 h;
#if BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
  return h;
}

#if NORM
__device__ __forceinline__ float in_to_float(u16 h) {
#if BF16
  return __uint_as_float((u32)h << 16);
#else
  return half_to_float(h);
#endif
}

// f(value) for both halves of each word of a 16-byte vector, the results packed alike
template <class F>
__device__ __forceinline__ uint4 map_halves(uint4 v, F f) {
  u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const u16 lo = f(j, 0, (u16)(w[j] & 0xFFFF)), hi = f(j, 1, (u16)(w[j] >> 16));
    w[j] = (u32)lo | ((u32)hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The GEMV's input, made by every block in shared memory (xs): rms_norm(x + residual) *
// norm_w, each step rounded to the activations' dtype as octavo's fused_add_rms_norm rounds
// it (s = x + residual; normed = s * rsqrt(mean(s^2) + eps); out = norm_w * normed). Block 0
// also writes s to new_residual. One row of NORM_K values; 16-byte aligned vectors of 8 values,
// thread i holding vectors i, i + threads, ... (NORM_ITEMS of them, in registers: all of a
// thread's loads of x and the residual are in flight at once, one memory round trip after the
// PDL wait; the norm weight's, nw, come before the wait).
#define NORM_ITEMS ((NORM_K + WARPS * 256 - 1) / (WARPS * 256))

__device__ __forceinline__ int norm_index(int item) {
  return (threadIdx.x + item * WARPS * 32) * 8;
}

__device__ __forceinline__ void load_norm_weight(uint4 (&nw)[NORM_ITEMS], const u16* norm_w) {
#pragma unroll
  for (int j = 0; j < NORM_ITEMS; ++j)
    if (norm_index(j) < NORM_K) nw[j] = *reinterpret_cast<const uint4*>(norm_w + norm_index(j));
}

// 16 bytes the kernel before wrote, read after the PDL wait as load_x reads x (not through
// the read-only path the compiler would pick for a const __restrict__ pointer)
__device__ __forceinline__ uint4 load_written(const u16* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void norm_prologue(u16* xs, const u16* x, const u16* residual,
                                              const uint4 (&nw)[NORM_ITEMS], u16* new_residual,
                                              float eps, float* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint4 s[NORM_ITEMS], r[NORM_ITEMS];
#pragma unroll
  for (int j = 0; j < NORM_ITEMS; ++j) {
    if (norm_index(j) < NORM_K) {
      s[j] = load_written(x + norm_index(j));
      r[j] = load_written(residual + norm_index(j));
    }
  }
  float squares = 0.f;
#pragma unroll
  for (int j = 0; j < NORM_ITEMS; ++j) {
    if (norm_index(j) < NORM_K) {
      const u32 rw[4] = {r[j].x, r[j].y, r[j].z, r[j].w};
      s[j] = map_halves(s[j], [&](int i, int h, u16 v) {
        const float sum = in_to_float(float_to_out(
            in_to_float(v) + in_to_float((u16)(rw[i] >> (16 * h)))));
        squares += sum * sum;
        return float_to_out(sum);
      });
      if (blockIdx.x == 0) *reinterpret_cast<uint4*>(new_residual + norm_index(j)) = s[j];
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    squares += __shfl_xor_sync(0xFFFFFFFFu, squares, offset);
  if (lane == 0) warp_sums[warp] = squares;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int v = 0; v < WARPS; ++v) total += warp_sums[v];
  const float rstd = rsqrtf(total / NORM_K + eps);
#pragma unroll
  for (int j = 0; j < NORM_ITEMS; ++j) {
    if (norm_index(j) < NORM_K) {
      const u32 ww[4] = {nw[j].x, nw[j].y, nw[j].z, nw[j].w};
      *reinterpret_cast<uint4*>(xs + norm_index(j)) = map_halves(s[j], [&](int i, int h, u16 v) {
        const float normed = in_to_float(float_to_out(in_to_float(v) * rstd));
        return float_to_out(in_to_float((u16)(ww[i] >> (16 * h))) * normed);
      });
    }
  }
  __syncthreads();
}
#endif

// One group: acc[i] += scale * (sum x (OFFSET + q) - (OFFSET + z) * sum x) for each mma tile i.
__device__ __forceinline__ void sum_group(float (&acc)[VEC][4], const Words& w, const XRows& xr,
                                          u32 mask, u32 magic) {
  float qx[VEC][4];
  float xs[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < VEC; ++i) qx[i][0] = qx[i][1] = qx[i][2] = qx[i][3] = 0.f;
#pragma unroll
  for (int u = 0; u < CHUNKS; ++u) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      // B: x at nibbles (2j, 2j + 4) and (2j + 1, 2j + 5) of the lane's word row
      const u32 b0 = prmt(xr.v[u][j], xr.v[u][j + 2], 0x5410);
      const u32 b1 = prmt(xr.v[u][j], xr.v[u][j + 2], 0x7632);
      mma(xs, ONES, ONES, ONES, ONES, b0, b1);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const u32 wa = w.a[u][i], wb = w.b[u][i];
        mma(qx[i], nibble_pair(wa >> (8 * j), mask, magic),
            nibble_pair(wb >> (8 * j), mask, magic),
            nibble_pair(wa >> (8 * j + 4), mask, magic),
            nibble_pair(wb >> (8 * j + 4), mask, magic), b0, b1);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float sa = half_to_float(half_of(w.sa, i));
    const float sb = half_to_float(half_of(w.sb, i));
    const float za = half_to_float(half_of(w.za, i)) + OFFSET;
    const float zb = half_to_float(half_of(w.zb, i)) + OFFSET;
    // c0, c1: row g, columns 2t, 2t + 1; c2, c3: row g + 8
    acc[i][0] += sa * (qx[i][0] - za * xs[0]);
    acc[i][1] += sa * (qx[i][1] - za * xs[1]);
    acc[i][2] += sb * (qx[i][2] - zb * xs[2]);
    acc[i][3] += sb * (qx[i][3] - zb * xs[3]);
  }
}

// f(m, r, sum) for each of the lane's sums: row m < M of x, output n0 + r of the block. Lane
// (g, t) holds outputs (mma rows) g and g + 8 of each tile at columns (rows of x) 2t, 2t + 1.
template <class F>
__device__ __forceinline__ void for_each_sum(const float (&acc)[VEC][4], int g, int t, int M,
                                             F f) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int m = 2 * t + c;
      if (m < M) {
        f(m, VEC * g + i, acc[i][c]);
        f(m, 8 * VEC + VEC * g + i, acc[i][2 + c]);
      }
    }
  }
}

// VEC 4: the explicit minimum of one block lets ptxas use the registers it needs (left to
// itself it stopped at 127 and spilled at groups of 64); the others keep their allocation
#if VEC == 4
#define BOUNDS __launch_bounds__(WARPS * 32, 1)
#else
#define BOUNDS __launch_bounds__(WARPS * 32)
#endif

extern "C" __global__ void BOUNDS
int4_mma_gemv(const u16* __restrict__ x, const int* __restrict__ qweight,
              const u16* __restrict__ scales, const u16* __restrict__ zeros,
              u16* __restrict__ out, int M, int N, int K, int stride_xm,
              // NORM only (else unused): x is added to residual and normed (norm_prologue)
              const u16* __restrict__ residual, const u16* __restrict__ norm_w,
              u16* __restrict__ new_residual, float eps) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * ROWS;
  const int na = n0 + VEC * g, nb = n0 + 8 * VEC + VEC * g;
  const int groups = K / GROUP;
  const int per_warp = (groups + WARPS - 1) / WARPS;
  const int first = warp * per_warp;
  const int last = min(groups, first + per_warp);
  // B column g is x row g (rows past M repeat row 0; their sums are not stored)
  const u16* x_row = x + (long)(g < M ? g : 0) * stride_xm;

  // 0x000F000F and the magic number in registers the compiler cannot fold (K >= 0)
  const u32 mask = 0x000F000Fu | ((u32)K >> 31);
  const u32 magic = MAGIC | ((u32)K >> 31);

  float acc[VEC][4];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  // Word row t of chunk u of group G: row G * GROUP / 8 + 4u + t
#if PANELS
  const int row_words = PANEL;
#else
  const int row_words = N;
#endif
  const int chunk = 4 * row_words, group_words = (GROUP / 8) * row_words;
  // (a warp without groups, when WARPS does not divide them, reads group 0 and sums nothing:
  // an unconditional first load stays ahead of the PDL wait in ptxas's schedule)
  const int start = first < last ? first : 0;
  const int row = start * (GROUP / 8) + t;
#if PANELS
  const int panel_words = (K / 8) * PANEL;
  const int* pa = qweight + (na / PANEL) * panel_words + row * PANEL + na % PANEL;
  const int* pb = qweight + (nb / PANEL) * panel_words + row * PANEL + nb % PANEL;
#else
  const int* pa = qweight + row * N + na;
  const int* pb = pa + (nb - na);
#endif
#if NORM
  __shared__ __align__(16) u16 xs[NORM_K];
  __shared__ float warp_sums[WARPS];
  const u16* px = xs + (start * (GROUP / 8) + t) * 8;
#else
  const u16* px = x_row + (start * (GROUP / 8) + t) * 8;
#endif
  // the lane's row-g scales and zeros of group `start` (float16 [G, N])
  const u16* ps = scales + (long)start * N + na;
  const u16* pz = zeros + (long)start * N + na;

  Words w0, w1;
  XRows x0, x1;
  load_words(w0, pa, pb, chunk, ps, pz);
#if NORM
  uint4 nw[NORM_ITEMS];
  load_norm_weight(nw, norm_w);
#endif
  // The kernel before may still be writing x (programmatic dependent launch); weights are
  // not written by any kernel of a step, so they are read before this wait.
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#if EARLY_TRIGGER
  asm volatile("griddepcontrol.launch_dependents;");
#endif
#endif
#if NORM
#define LOAD_X load_x_shared
  norm_prologue(xs, x, residual, nw, new_residual, eps, warp_sums);
#else
#define LOAD_X load_x
#endif
  LOAD_X(x0, px);
  for (int group = first; group < last; group += 2) {
    if (group + 1 < last) {
      load_words(w1, pa + group_words, pb + group_words, chunk, ps + N, pz + N);
      LOAD_X(x1, px + GROUP);
    }
    sum_group(acc, w0, x0, mask, magic);
    if (group + 1 >= last) break;
    pa += 2 * group_words;
    pb += 2 * group_words;
    ps += 2 * N;
    pz += 2 * N;
    px += 2 * GROUP;
    if (group + 2 < last) {
      load_words(w0, pa, pb, chunk, ps, pz);
      LOAD_X(x0, px);
    }
    sum_group(acc, w1, x1, mask, magic);
  }
#if __CUDA_ARCH__ >= 900 && !EARLY_TRIGGER
  asm volatile("griddepcontrol.launch_dependents;");
#endif

#if WARPS > 1
  __shared__ float partial[WARPS][MAX_M][ROWS];
  for_each_sum(acc, g, t, M, [&](int m, int r, float sum) { partial[warp][m][r] = sum; });
  __syncthreads();
  for (int idx = threadIdx.x; idx < M * ROWS; idx += WARPS * 32) {
    const int m = idx / ROWS, r = idx % ROWS;
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < WARPS; ++v) sum += partial[v][m][r];
    out[(long)m * N + n0 + r] = float_to_out(sum);
  }
#else
  for_each_sum(acc, g, t, M, [&](int m, int r, float sum) {
    out[(long)m * N + n0 + r] = float_to_out(sum);
  });
#endif
}
