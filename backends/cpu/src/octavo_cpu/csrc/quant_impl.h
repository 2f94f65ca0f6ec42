// The GGUF matmul kernels (quant_common.h has the formats and the math), written once and
// compiled once per instruction set: quant_<isa>.cpp includes this inside namespace
// octavo_cpu::<isa>, after its `#pragma GCC target`, with qdot(u, s) defined: the int32 sums of
// each 4 consecutive products u8 x s8 of two 256-bit vectors. No STL, no torch (common.h).
//
// A register tile is R rows of the output x C output features (columns). For every chunk of
// 32 values along in_features, the C weight chunks are unpacked once into registers and meet
// the R rows' int8 activations: each (row, column) pair keeps 8 float32 partial sums, summed
// across lanes once at the end. Decode (one row) uses 1 x 4 tiles: the activation chunk is
// loaded once for 4 weight rows, and each weight byte is read once. More rows use 4 x 2
// tiles, so each unpacked weight chunk serves 4 rows.

#define OCTAVO_INLINE inline __attribute__((always_inline))

OCTAVO_INLINE float load_fp16(const uint8_t* p) {
  uint16_t bits;
  __builtin_memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

OCTAVO_INLINE __m256i load256(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

OCTAVO_INLINE __m256i low_nibbles(__m256i v) {
  return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

OCTAVO_INLINE __m256i high_nibbles(__m256i v) {
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
}

// 16 bytes of nibbles -> 32 values: the low nibbles are values 0-15, the high ones 16-31.
OCTAVO_INLINE __m256i unpack_nibbles16(const uint8_t* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return low_nibbles(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw));
}

OCTAVO_INLINE float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

OCTAVO_INLINE int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

OCTAVO_INLINE float hmax_ps(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// float32 -> bfloat16, round to nearest even (NaN stays NaN), as torch converts.
OCTAVO_INLINE uint16_t to_bf16(float f) {
  uint32_t bits;
  __builtin_memcpy(&bits, &f, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((bits >> 16) | 0x40);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

// ---- weight formats ----------------------------------------------------------------------

// How a chunk's weights meet the activations: unsigned q with an offset m (d q + m), or signed
// q (|q| times the activations with q's sign), optionally with a scale per 16 values.
enum class Kind { kUnsigned, kSigned, kSigned16 };

// One chunk of 32 weights of one output feature, unpacked into registers.
struct WChunk {
  __m256i w;    // kUnsigned: q (0..63); signed kinds: |q|
  __m256i sgn;  // signed kinds: q, whose sign goes onto the activations
  __m256i scl;  // kSigned16: int16 multipliers, 8 x the scale of values 0-15, 8 x of 16-31
  float d;      // the chunk's scale
  float m;      // kUnsigned: the chunk's offset
};

struct Q4_0 {
  static constexpr int kBlockElems = 32, kBlockBytes = 18, kChunks = 1;
  // Decode path gemv4 (below): where the nibbles start in a block, whether it has an offset m.
  static constexpr bool kGemv4 = true, kGemv4Signed = false, kHasMin = false;
  static constexpr int kNibbles = 2;
  static constexpr Kind kKind = Kind::kUnsigned;
  struct Block {
    const uint8_t* p;
    float d;
  };
  static OCTAVO_INLINE void block(const uint8_t* p, Block& b) {
    b.p = p;
    b.d = load_fp16(p);
  }
  static OCTAVO_INLINE void chunk(const Block& b, int, WChunk& c) {
    c.w = unpack_nibbles16(b.p + 2);
    c.d = b.d;
    c.m = -8.0f * b.d;
  }
};

struct Q4_1 {
  static constexpr int kBlockElems = 32, kBlockBytes = 20, kChunks = 1;
  static constexpr bool kGemv4 = true, kGemv4Signed = false, kHasMin = true;
  static constexpr int kNibbles = 4;
  static constexpr Kind kKind = Kind::kUnsigned;
  struct Block {
    const uint8_t* p;
    float d, m;
  };
  static OCTAVO_INLINE void block(const uint8_t* p, Block& b) {
    b.p = p;
    b.d = load_fp16(p);
    b.m = load_fp16(p + 2);
  }
  static OCTAVO_INLINE void chunk(const Block& b, int, WChunk& c) {
    c.w = unpack_nibbles16(b.p + 4);
    c.d = b.d;
    c.m = b.m;
  }
};

struct Q8_0 {
  static constexpr bool kGemv4 = false, kGemv4Signed = true;
  static constexpr int kBlockElems = 32, kBlockBytes = 34, kChunks = 1;
  static constexpr Kind kKind = Kind::kSigned;
  struct Block {
    const uint8_t* p;
    float d;
  };
  static OCTAVO_INLINE void block(const uint8_t* p, Block& b) {
    b.p = p;
    b.d = load_fp16(p);
  }
  static OCTAVO_INLINE void chunk(const Block& b, int, WChunk& c) {
    c.sgn = load256(b.p + 2);
    c.w = _mm256_abs_epi8(c.sgn);
    c.d = b.d;
  }
};

struct Q4_K {
  static constexpr bool kGemv4 = false, kGemv4Signed = false;
  static constexpr int kBlockElems = 256, kBlockBytes = 144, kChunks = 8;
  static constexpr Kind kKind = Kind::kUnsigned;
  struct Block {
    const uint8_t* qs;
    float d[8];
    float m[8];
  };
  static OCTAVO_INLINE void block(const uint8_t* p, Block& b) {
    const float d = load_fp16(p), dmin = load_fp16(p + 2);
    const uint8_t* s = p + 4;  // 12 bytes: 6-bit scales and mins of the 8 chunks
    for (int j = 0; j < 4; ++j) {
      b.d[j] = d * float(s[j] & 63);
      b.m[j] = -dmin * float(s[j + 4] & 63);
      b.d[j + 4] = d * float((s[j + 8] & 0x0F) | ((s[j] >> 6) << 4));
      b.m[j + 4] = -dmin * float((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
    b.qs = p + 16;
  }
  static OCTAVO_INLINE void chunk(const Block& b, int j, WChunk& c) {
    const __m256i v = load256(b.qs + 32 * (j >> 1));
    c.w = (j & 1) ? high_nibbles(v) : low_nibbles(v);
    c.d = b.d[j];
    c.m = b.m[j];
  }
};

struct Q6_K {
  static constexpr bool kGemv4 = false, kGemv4Signed = false;
  static constexpr int kBlockElems = 256, kBlockBytes = 210, kChunks = 8;
  static constexpr Kind kKind = Kind::kSigned16;
  struct Block {
    const uint8_t* p;
    float d;
  };
  static OCTAVO_INLINE void block(const uint8_t* p, Block& b) {
    b.p = p;
    b.d = load_fp16(p + 208);
  }
  // Chunk j: half h = j / 4 (128 values), quarter q = j % 4 of it. Low 4 bits: ql bytes
  // 64h + 32 (q & 1) + l, low nibbles for q < 2, high for q >= 2; high 2 bits: bits 2q..2q+1
  // of qh byte 32h + l; scales 8h + 2q (values 0-15) and 8h + 2q + 1 (16-31).
  static OCTAVO_INLINE void chunk(const Block& b, int j, WChunk& c) {
    const int h = j >> 2, q = j & 3;
    const __m256i ql = load256(b.p + 64 * h + 32 * (q & 1));
    const __m256i low = q < 2 ? low_nibbles(ql) : high_nibbles(ql);
    const __m256i qh = load256(b.p + 128 + 32 * h);
    const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * q)),
                                          _mm256_set1_epi8(0x03));
    const __m256i value = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));  // 0..63
    c.sgn = _mm256_sub_epi8(value, _mm256_set1_epi8(32));
    c.w = _mm256_abs_epi8(c.sgn);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b.p + 192) + 8 * h + 2 * q;
    c.scl = _mm256_set_m128i(_mm_set1_epi16(scales[1]), _mm_set1_epi16(scales[0]));
    c.d = b.d;
  }
};

// Scale of values 0-15 and of 16-31 of a Q6_K chunk (the panel keeps them as two scales).
OCTAVO_INLINE void q6_half_scales(const WChunk& c, float* lo, float* hi) {
  // The extract zero-extends: the int16 cast restores a negative scale's sign.
  *lo = c.d * float(int16_t(_mm256_extract_epi16(c.scl, 0)));
  *hi = c.d * float(int16_t(_mm256_extract_epi16(c.scl, 8)));
}

template <Kind K>
OCTAVO_INLINE __m256i chunk_dot(const WChunk& c, __m256i x) {
  if (K == Kind::kUnsigned) return qdot(c.w, x);
  const __m256i xs = _mm256_sign_epi8(x, c.sgn);
  if (K == Kind::kSigned) return qdot(c.w, xs);
  // |q| <= 32 and |x| <= 127: the 16-bit pair sums cannot saturate.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(c.w, xs), c.scl);
}

// ---- the register tile -------------------------------------------------------------------

template <class F, int R, int C>
__attribute__((noinline)) void tile(const QuantGemmArgs& a, int64_t m0, int64_t n0) {
  const int64_t num_chunks = a.in_features / kQChunk;
  const int64_t num_blocks = a.in_features / F::kBlockElems;
  const uint8_t* wrow[C];
  for (int c = 0; c < C; ++c) wrow[c] = a.weight + (n0 + c) * a.weight_stride;
  const int8_t* xq[R];
  const float* xd[R];
  const float* xs[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = a.x.q + (m0 + r) * a.in_features;
    xd[r] = a.x.d + (m0 + r) * num_chunks;
    xs[r] = a.x.s + (m0 + r) * num_chunks;
  }
  __m256 acc[R][C];
  float offset[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      acc[r][c] = _mm256_setzero_ps();
      offset[r][c] = 0.0f;
    }
  }
  for (int64_t b = 0; b < num_blocks; ++b) {
    typename F::Block blk[C];
    for (int c = 0; c < C; ++c) F::block(wrow[c] + b * F::kBlockBytes, blk[c]);
#pragma GCC unroll 8
    for (int j = 0; j < F::kChunks; ++j) {
      const int64_t k = b * F::kChunks + j;  // chunk index along in_features
      WChunk w[C];
      for (int c = 0; c < C; ++c) F::chunk(blk[c], j, w[c]);
      for (int r = 0; r < R; ++r) {
        const __m256i x = load256(xq[r] + k * kQChunk);
        const float dx = xd[r][k];
        for (int c = 0; c < C; ++c) {
          const __m256 dot = _mm256_cvtepi32_ps(chunk_dot<F::kKind>(w[c], x));
          acc[r][c] = _mm256_fmadd_ps(dot, _mm256_set1_ps(w[c].d * dx), acc[r][c]);
          if (F::kKind == Kind::kUnsigned) offset[r][c] += w[c].m * xs[r][k];
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      const float y = hsum_ps(acc[r][c]) + offset[r][c];
      const int64_t at = (m0 + r) * a.out_stride + n0 + c;
      if (a.out_bf16) {
        static_cast<uint16_t*>(a.out)[at] = to_bf16(y);
      } else {
        static_cast<float*>(a.out)[at] = y;
      }
    }
  }
}

// Rows [m_begin, m_end) against columns [n0, n0 + C).
template <class F, int C>
void tile_rows(const QuantGemmArgs& a, int64_t m_begin, int64_t m_end, int64_t n0) {
  int64_t m = m_begin;
  for (; m + 4 <= m_end; m += 4) tile<F, 4, C>(a, m, n0);
  switch (m_end - m) {
    case 3: tile<F, 3, C>(a, m, n0); break;
    case 2: tile<F, 2, C>(a, m, n0); break;
    case 1: tile<F, 1, C>(a, m, n0); break;
    default: break;
  }
}

// ---- the panel path (many rows) ------------------------------------------------------------
//
// For many rows, 8 output columns at a time are first unpacked into a panel, interleaved so
// that one vector holds 4 consecutive values of each of the 8 columns: vector (k, j), j < 8,
// is [column 0 values 32k+4j..32k+4j+3, column 1 the same, ..., column 7]. A row then meets
// the 8 columns in one pass: its 4 activations 32k+4j.. broadcast to every lane, one
// u8 x s8 dot per vector, and the lanes of the result are the 8 columns, so the per-chunk
// scaling is one vector operation for 8 columns (the direct tiles spend one per column) and
// no sum across lanes is ever needed. The panel (K bytes x 8 plus scales) stays in L1 while
// every row of the thread's block streams past it.

// The 8 x 8 transpose of 32-bit elements: out[j] dword c = in[c] dword j.
OCTAVO_INLINE void transpose8x32(const __m256i* in, __m256i* out) {
  const __m256i t0 = _mm256_unpacklo_epi32(in[0], in[1]);
  const __m256i t1 = _mm256_unpackhi_epi32(in[0], in[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(in[2], in[3]);
  const __m256i t3 = _mm256_unpackhi_epi32(in[2], in[3]);
  const __m256i t4 = _mm256_unpacklo_epi32(in[4], in[5]);
  const __m256i t5 = _mm256_unpackhi_epi32(in[4], in[5]);
  const __m256i t6 = _mm256_unpacklo_epi32(in[6], in[7]);
  const __m256i t7 = _mm256_unpackhi_epi32(in[6], in[7]);
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t2);
  const __m256i u1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i u2 = _mm256_unpacklo_epi64(t1, t3);
  const __m256i u3 = _mm256_unpackhi_epi64(t1, t3);
  const __m256i u4 = _mm256_unpacklo_epi64(t4, t6);
  const __m256i u5 = _mm256_unpackhi_epi64(t4, t6);
  const __m256i u6 = _mm256_unpacklo_epi64(t5, t7);
  const __m256i u7 = _mm256_unpackhi_epi64(t5, t7);
  out[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
  out[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
  out[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
  out[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
  out[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
  out[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
  out[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
  out[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

// Floats of one panel chunk: the columns' scales (Q6_K: of values 0-15, then of 16-31) and
// offsets, 8 lanes each.
constexpr int kPanelScales = 3;

// How a panel's chunks meet the activations. With VNNI a Q8_0 panel stores q + 128 (0..255,
// unsigned) and the offset -128 d: one vpdpbusd per vector as for the 4-bit formats, where
// the signed form spends an abs and a sign on every vector for every row (the activations'
// per-chunk sums are at hand for the offset). Without VNNI, maddubs would saturate its int16
// pair sums on values up to 255, so the signed form stays.
template <class F>
constexpr Kind panel_kind() {
#ifdef OCTAVO_QUANT_VNNI
  if (F::kKind == Kind::kSigned) return Kind::kUnsigned;
#endif
  return F::kKind;
}

// Unpack columns [n0, n0 + 8) (those past out_features repeat the last real one) into
// q: [chunks][8] vectors and f: [chunks][kPanelScales][8] floats.
template <class F>
void build_panel(const QuantGemmArgs& a, int64_t n0, __m256i* q, float* f) {
  const int64_t num_blocks = a.in_features / F::kBlockElems;
  const uint8_t* wrow[8];
  for (int c = 0; c < 8; ++c) {
    const int64_t n = n0 + c < a.out_features ? n0 + c : a.out_features - 1;
    wrow[c] = a.weight + n * a.weight_stride;
  }
  for (int64_t b = 0; b < num_blocks; ++b) {
    typename F::Block blk[8];
    for (int c = 0; c < 8; ++c) F::block(wrow[c] + b * F::kBlockBytes, blk[c]);
    for (int j = 0; j < F::kChunks; ++j) {
      const int64_t k = b * F::kChunks + j;
      __m256i values[8];
      float* scales = f + k * kPanelScales * 8;
      for (int c = 0; c < 8; ++c) {
        WChunk w;
        F::chunk(blk[c], j, w);
        if (F::kKind == Kind::kUnsigned) {
          values[c] = w.w;
          scales[c] = w.d;
          scales[16 + c] = w.m;
        } else if (panel_kind<F>() == Kind::kUnsigned) {  // signed q as q + 128, see above
          values[c] = _mm256_xor_si256(w.sgn, _mm256_set1_epi8(char(0x80)));
          scales[c] = w.d;
          scales[16 + c] = -128.0f * w.d;
        } else {
          values[c] = w.sgn;  // signed q; |q| and the sign are taken when it is used
          if (F::kKind == Kind::kSigned16) {
            q6_half_scales(w, &scales[c], &scales[8 + c]);
          } else {
            scales[c] = w.d;
          }
        }
      }
      transpose8x32(values, q + k * 8);
    }
  }
}

OCTAVO_INLINE __m256i broadcast4(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// One chunk of a row against a panel chunk: int32 lane c = dot(column c, x[0..32)).
OCTAVO_INLINE __m256i panel_dot_unsigned(const __m256i* w, const int8_t* x) {
#ifdef OCTAVO_QUANT_VNNI
  __m256i sum = _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) sum = _mm256_dpbusd_epi32(sum, w[j], broadcast4(x + 4 * j));
  return sum;
#else
  // q <= 15 and |x| <= 127: 16 products per int16 lane stay below 32767.
  __m256i sum = _mm256_maddubs_epi16(w[0], broadcast4(x));
  for (int j = 1; j < 8; ++j) {
    sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[j], broadcast4(x + 4 * j)));
  }
  return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
#endif
}

// Vectors [j0, j1) of a signed panel chunk: |q| times x with q's sign.
OCTAVO_INLINE __m256i panel_dot_signed(const __m256i* w, const int8_t* x, int j0, int j1) {
  __m256i sum = _mm256_setzero_si256();
  for (int j = j0; j < j1; ++j) {
    const __m256i q = w[j];
    sum = _mm256_add_epi32(
        sum, qdot(_mm256_abs_epi8(q), _mm256_sign_epi8(broadcast4(x + 4 * j), q)));
  }
  return sum;
}

// Rows [m0, m0 + R) against a panel; stores min(8, out_features - n0) columns.
template <class F, int R>
void panel_tile(const QuantGemmArgs& a, const __m256i* q, const float* f, int64_t m0,
                int64_t n0) {
  const int64_t num_chunks = a.in_features / kQChunk;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int8_t* xq[R];
  const float* xd[R];
  const float* xs[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = a.x.q + (m0 + r) * a.in_features;
    xd[r] = a.x.d + (m0 + r) * num_chunks;
    xs[r] = a.x.s + (m0 + r) * num_chunks;
  }
  for (int64_t k = 0; k < num_chunks; ++k) {
    const __m256i* w = q + k * 8;
    const float* scales = f + k * kPanelScales * 8;
    const __m256 d0 = _mm256_loadu_ps(scales);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq[r] + k * kQChunk;
      const __m256 dx = _mm256_set1_ps(xd[r][k]);
      if (panel_kind<F>() == Kind::kUnsigned) {
        const __m256i sum = panel_dot_unsigned(w, x);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d0, dx), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(scales + 16), _mm256_set1_ps(xs[r][k]), acc[r]);
      } else if (panel_kind<F>() == Kind::kSigned) {
        const __m256i sum = panel_dot_signed(w, x, 0, 8);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d0, dx), acc[r]);
      } else {
        const __m256i lo = panel_dot_signed(w, x, 0, 4);
        const __m256i hi = panel_dot_signed(w, x, 4, 8);
        const __m256 d1 = _mm256_loadu_ps(scales + 8);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(d0, dx), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(d1, dx), acc[r]);
      }
    }
  }
  const int64_t cols = a.out_features - n0 < 8 ? a.out_features - n0 : 8;
  for (int r = 0; r < R; ++r) {
    alignas(32) float y[8];
    _mm256_store_ps(y, acc[r]);
    const int64_t at = (m0 + r) * a.out_stride + n0;
    if (a.out_bf16) {
      uint16_t* out = static_cast<uint16_t*>(a.out) + at;
      for (int64_t c = 0; c < cols; ++c) out[c] = to_bf16(y[c]);
    } else {
      float* out = static_cast<float*>(a.out) + at;
      if (cols == 8) {
        _mm256_storeu_ps(out, acc[r]);
      } else {
        for (int64_t c = 0; c < cols; ++c) out[c] = y[c];
      }
    }
  }
}

template <class F>
void gemm_panels(const QuantGemmArgs& a, int64_t n_begin, int64_t n_end) {
  const int64_t num_chunks = a.in_features / kQChunk;
  // Per-thread panel buffers, kept between calls (grow only).
  thread_local __m256i* q = nullptr;
  thread_local float* f = nullptr;
  thread_local int64_t capacity = 0;
  if (capacity < num_chunks) {
    free(q);
    free(f);
    q = static_cast<__m256i*>(aligned_alloc(32, num_chunks * 8 * sizeof(__m256i)));
    f = static_cast<float*>(aligned_alloc(32, num_chunks * kPanelScales * 8 * sizeof(float)));
    capacity = num_chunks;
  }
  for (int64_t n0 = n_begin; n0 < n_end; n0 += 8) {
    build_panel<F>(a, n0, q, f);
    int64_t m = 0;
    for (; m + 4 <= a.num_rows; m += 4) panel_tile<F, 4>(a, q, f, m, n0);
    switch (a.num_rows - m) {
      case 3: panel_tile<F, 3>(a, q, f, m, n0); break;
      case 2: panel_tile<F, 2>(a, q, f, m, n0); break;
      case 1: panel_tile<F, 1>(a, q, f, m, n0); break;
      default: break;
    }
  }
}


// ---- the decode path of Q4_0 / Q4_1: one row against 4 columns ----------------------------
//
// Same sums as tile<F, 1, 4>, with fewer instructions per block (the direct tile spends one
// int->float conversion, broadcast and FMA per column and block, and keeps the offsets in
// scalars): two columns share one vector (column A's 16 nibble bytes in the low 128 bits,
// B's in the high), meeting the activations' values 0-15 and 16-31 broadcast to both halves;
// one horizontal add packs the 4 columns' int32 sums into one vector, [A A C C | B B D D],
// scaled by one vector of the 4 columns' d x dx and accumulated by one FMA; the offsets
// m x sx of the 4 columns are one 128-bit FMA. Rows are contiguous in memory, so the 4
// columns are one stream: the tile two ahead is prefetched a little at every block.

template <class F>
OCTAVO_INLINE __m256i pair_dot(const uint8_t* a, const uint8_t* b, __m256i xlo, __m256i xhi) {
  const __m256i v = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(b + F::kNibbles),
                                        reinterpret_cast<const __m128i*>(a + F::kNibbles));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(v, mask);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  // q <= 15, |x| <= 127: each int16 lane sums 4 products, at most 7620.
  const __m256i sum = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo),
                                       _mm256_maddubs_epi16(hi, xhi));
  return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));  // [A: 4 x int32 | B: 4 x int32]
}

OCTAVO_INLINE uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  __builtin_memcpy(&v, p, 2);
  return v;
}

template <class F>
__attribute__((noinline)) void gemv4(const QuantGemmArgs& a, int64_t n0) {
  const int64_t num_blocks = a.in_features / 32;
  const int64_t stride = a.weight_stride;
  const uint8_t* w0 = a.weight + n0 * stride;
  const uint8_t* w1 = w0 + stride;
  const uint8_t* w2 = w1 + stride;
  const uint8_t* w3 = w2 + stride;
  const uint8_t* ahead = w0 + 8 * stride;  // the tile after next
  const int8_t* xq = a.x.q;
  const float* xd = a.x.d;
  const float* xs = a.x.s;
  const __m256i pair_order = _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3);
  __m256 acc = _mm256_setzero_ps();
  __m128 offset = _mm_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t at = b * F::kBlockBytes;
    _mm_prefetch(reinterpret_cast<const char*>(ahead + 4 * at), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ahead + 4 * at + 64), _MM_HINT_T0);
    const __m256i xlo = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + 32 * b)));
    const __m256i xhi = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + 32 * b + 16)));
    const __m256i ab = pair_dot<F>(w0 + at, w1 + at, xlo, xhi);
    const __m256i cd = pair_dot<F>(w2 + at, w3 + at, xlo, xhi);
    // [A01 A23 C01 C23 | B01 B23 D01 D23]: partial sums of each column, 2 per half.
    const __m256 dots = _mm256_cvtepi32_ps(_mm256_hadd_epi32(ab, cd));
    const __m128 d = _mm_cvtph_ps(_mm_setr_epi16(
        short(load_u16(w0 + at)), short(load_u16(w1 + at)), short(load_u16(w2 + at)),
        short(load_u16(w3 + at)), 0, 0, 0, 0));  // [dA dB dC dD]
    const __m256 scale = _mm256_mul_ps(
        _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d), pair_order),
        _mm256_set1_ps(xd[b]));
    acc = _mm256_fmadd_ps(dots, scale, acc);
    if (F::kHasMin) {
      const __m128 m = _mm_cvtph_ps(_mm_setr_epi16(
          short(load_u16(w0 + at + 2)), short(load_u16(w1 + at + 2)),
          short(load_u16(w2 + at + 2)), short(load_u16(w3 + at + 2)), 0, 0, 0, 0));
      offset = _mm_fmadd_ps(m, _mm_set1_ps(xs[b]), offset);
    } else {
      offset = _mm_fmadd_ps(d, _mm_set1_ps(-8.0f * xs[b]), offset);  // m = -8 d
    }
  }
  alignas(32) float lanes[8];
  alignas(16) float offs[4];
  _mm256_store_ps(lanes, acc);
  _mm_store_ps(offs, offset);
  const float y[4] = {lanes[0] + lanes[1] + offs[0], lanes[4] + lanes[5] + offs[1],
                      lanes[2] + lanes[3] + offs[2], lanes[6] + lanes[7] + offs[3]};
  for (int c = 0; c < 4; ++c) {
    if (a.out_bf16) {
      static_cast<uint16_t*>(a.out)[n0 + c] = to_bf16(y[c]);
    } else {
      static_cast<float*>(a.out)[n0 + c] = y[c];
    }
  }
}

// The decode path of Q8_0 (the LM head of most GGUF files): 4 columns' int32 dot products
// packed by two horizontal adds into one vector [A B C D | A B C D], scaled by one vector of
// d x dx and accumulated by one FMA per block (the direct tile spends one of each per column).
__attribute__((noinline)) inline void gemv4_q8_0(const QuantGemmArgs& a, int64_t n0) {
  const int64_t num_blocks = a.in_features / 32;
  const int64_t stride = a.weight_stride;
  const uint8_t* w0 = a.weight + n0 * stride;
  const uint8_t* w1 = w0 + stride;
  const uint8_t* w2 = w1 + stride;
  const uint8_t* w3 = w2 + stride;
  const uint8_t* ahead = w0 + 8 * stride;
  const int8_t* xq = a.x.q;
  const float* xd = a.x.d;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t at = b * 34;
    _mm_prefetch(reinterpret_cast<const char*>(ahead + 4 * at), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ahead + 4 * at + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ahead + 4 * at + 128), _MM_HINT_T0);
    const __m256i x = load256(xq + 32 * b);
    __m256i v[4];
    const uint8_t* rows[4] = {w0 + at, w1 + at, w2 + at, w3 + at};
    for (int c = 0; c < 4; ++c) {
      const __m256i q = load256(rows[c] + 2);
      v[c] = qdot(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q));
    }
    // [A B C D | A B C D]: each column's sum over its low 16 values, then its high 16.
    const __m256i sums = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]),
                                           _mm256_hadd_epi32(v[2], v[3]));
    const __m128 d = _mm_cvtph_ps(_mm_setr_epi16(
        short(load_u16(rows[0])), short(load_u16(rows[1])), short(load_u16(rows[2])),
        short(load_u16(rows[3])), 0, 0, 0, 0));
    const __m128 dd = _mm_mul_ps(d, _mm_set1_ps(xd[b]));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set_m128(dd, dd), acc);
  }
  const __m128 y = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  alignas(16) float out[4];
  _mm_store_ps(out, y);
  for (int c = 0; c < 4; ++c) {
    if (a.out_bf16) {
      static_cast<uint16_t*>(a.out)[n0 + c] = to_bf16(out[c]);
    } else {
      static_cast<float*>(a.out)[n0 + c] = out[c];
    }
  }
}

template <class F>
void gemm_format(const QuantGemmArgs& a, int64_t n_begin, int64_t n_end) {
  if (a.num_rows == 1) {
    int64_t n = n_begin;
    if constexpr (F::kGemv4) {
      for (; n + 4 <= n_end; n += 4) gemv4<F>(a, n);
    }
    if constexpr (F::kGemv4Signed) {
      for (; n + 4 <= n_end; n += 4) gemv4_q8_0(a, n);
    }
    for (; n + 4 <= n_end; n += 4) tile<F, 1, 4>(a, 0, n);
    for (; n < n_end; ++n) tile<F, 1, 1>(a, 0, n);
    return;
  }
  if (a.num_rows >= kPanelMinRows) {
    gemm_panels<F>(a, n_begin, n_end);
    return;
  }
  // A few rows: direct tiles, each unpacked weight chunk serving every row.
  int64_t n = n_begin;
  for (; n + 2 <= n_end; n += 2) tile_rows<F, 2>(a, 0, a.num_rows, n);
  for (; n < n_end; ++n) tile_rows<F, 1>(a, 0, a.num_rows, n);
}

void quant_gemm(const QuantGemmArgs& a, int64_t col_begin, int64_t col_end) {
  switch (a.qtype) {
    case QType::kQ4_0: gemm_format<Q4_0>(a, col_begin, col_end); break;
    case QType::kQ4_1: gemm_format<Q4_1>(a, col_begin, col_end); break;
    case QType::kQ8_0: gemm_format<Q8_0>(a, col_begin, col_end); break;
    case QType::kQ4_K: gemm_format<Q4_K>(a, col_begin, col_end); break;
    case QType::kQ6_K: gemm_format<Q6_K>(a, col_begin, col_end); break;
  }
}

// ---- activation quantization ---------------------------------------------------------------

OCTAVO_INLINE __m256 load_floats(const FloatRows& x, const void* row, int64_t i) {
  if (x.bf16) {
    const __m128i raw =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  return _mm256_loadu_ps(static_cast<const float*>(row) + i);
}

void quantize_activations(const FloatRows& x, int64_t row_begin, int64_t row_end,
                          int64_t in_features, int8_t* q, float* d, float* s) {
  const int64_t num_chunks = in_features / kQChunk;
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const int64_t elem = x.bf16 ? 2 : 4;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const void* row = static_cast<const char*>(x.data) + r * x.stride * elem;
    for (int64_t k = 0; k < num_chunks; ++k) {
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = load_floats(x, row, k * kQChunk + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
      }
      const float dx = hmax_ps(amax) / 127.0f;
      const __m256 inv = _mm256_set1_ps(dx != 0.0f ? 1.0f / dx : 0.0f);
      __m256i n[4];
      for (int i = 0; i < 4; ++i) {
        // Round half to even, as torch.round.
        n[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      }
      const int sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(n[0], n[1]),
                                                  _mm256_add_epi32(n[2], n[3])));
      // packs work per 128-bit lane; the permutation puts the 4-byte groups back in order.
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]),
                                                _mm256_packs_epi32(n[2], n[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + r * in_features + k * kQChunk),
                          _mm256_permutevar8x32_epi32(packed, order));
      d[r * num_chunks + k] = dx;
      s[r * num_chunks + k] = dx * float(sum);
    }
  }
}
