// Paged attention over the flat batch, written once against the small vector API of
// vec_<isa>.h (Vec, kWidth, vload/vstore/vfma/..., hsum4, hsum8, vexp) and compiled once per
// instruction set: attention_<isa>.cpp includes this inside namespace octavo_cpu::<isa>, after
// its `#pragma GCC target`. Nothing here may use the STL or torch (see common.h).
//
// One work item = one tile (a run of query tokens of one sequence x the query heads of one KV
// head) against a range of its keys. Keys are visited in chunks of kChunk positions:
//   scores S = Q K^T              [rows, chunk]   (float32 accumulation)
//   online softmax (running max m, running sum l, output rescaled by exp(m_old - m_new))
//   O += P V                      [rows, head_dim]
// Row r of a tile is token r / group, query head kv_head * group + r % group (head tiles:
// the same within each KV head's rows, common.h); token t sees key
// positions < context_len + t + 1 (causal) and, with a sliding window W, > context_len + t - W.
// No chunk reaches past the tile's last visible key nor starts before its first (so no cache
// slot at or past seq_len, and no block before the window, is ever loaded). Keys a row may not
// see are computed but masked to -inf before the softmax, so their probability is exactly 0.
// With a soft cap c, scores are c * tanh(scale * q.k / c) before the mask.
// While one chunk computes, the next chunk's key and value rows are prefetched a few cache
// lines per inner-loop step (Prefetcher). A tile split into parts (long contexts, few tiles)
// leaves (O, m, l) per part in part_scratch; a second pass combines them.

// Register tiles (16 vector registers with AVX2, 32 with AVX-512). Four rows, so that one
// load (and bf16/fp16 conversion) of a key or value feeds the four query heads of a typical
// grouped-query decode, and no more loads than FMAs.
constexpr int kRowBlockQK = 4;                     // rows of one QK register tile
constexpr int kKeyBlock = kWidth == 16 ? 4 : 2;    // keys of one QK register tile
constexpr int kRowBlockPV = 4;                     // rows of one PV register tile
constexpr int kVecBlockPV = kWidth == 16 ? 4 : 2;  // head_dim vectors of one PV register tile
// Rows from which a chunk's keys and values are copied (converted to float32) into one
// contiguous buffer, rather than read from the scattered cache rows by every row block.
constexpr int kConvertRows = 8;

template <typename A, typename B>
struct IsSame {
  static constexpr bool value = false;
};
template <typename A>
struct IsSame<A, A> {
  static constexpr bool value = true;
};

OCTAVO_INLINE int imin(int a, int b) { return a < b ? a : b; }
OCTAVO_INLINE int imax(int a, int b) { return a > b ? a : b; }
OCTAVO_INLINE int64_t align16(int64_t n) { return (n + 15) / 16 * 16; }

// Per-thread buffers, carved exactly as thread_scratch_floats() sizes them.
struct Workspace {
  float* q;         // [max_rows, head_dim] float32 (bfloat16 for the bf16-dot path)
  float* s;         // [max_rows, kChunk] scores, then probabilities
  float* o;         // [max_rows, head_dim] running output
  float* m;         // [max_rows] running max (scaled scores)
  float* l;         // [max_rows] running sum of exp
  int* visible;     // [max_rows] keys [first, visible) of the current chunk a row may see
  int* first;       // [max_rows] first key of the current chunk each row may see
  float* kconv;     // [kChunk, head_dim] the chunk's keys as contiguous float32 rows
  float* vconv;     // [kChunk, head_dim] its values, likewise
  const void** kptr;  // [kChunk] address of each key row of the chunk
  const void** vptr;  // [kChunk] address of each value row
  const void** next_kptr;  // the same for the next chunk (being prefetched)
  const void** next_vptr;
  const void** head_kptr;  // one KV head's key rows of the chunk (head tiles)
  const void** head_vptr;
};

inline Workspace carve(float* base, int max_rows, int head_dim) {
  Workspace ws;
  float* p = base;
  ws.q = p; p += align16(int64_t(max_rows) * head_dim);
  ws.s = p; p += align16(int64_t(max_rows) * kChunk);
  ws.o = p; p += align16(int64_t(max_rows) * head_dim);
  ws.m = p; p += align16(max_rows);
  ws.l = p; p += align16(max_rows);
  ws.visible = reinterpret_cast<int*>(p); p += align16(max_rows);
  ws.first = reinterpret_cast<int*>(p); p += align16(max_rows);
  ws.kconv = p; p += align16(int64_t(kChunk) * head_dim);
  ws.vconv = p; p += align16(int64_t(kChunk) * head_dim);
  ws.kptr = reinterpret_cast<const void**>(p); p += align16(2 * kChunk);
  ws.vptr = reinterpret_cast<const void**>(p); p += align16(2 * kChunk);
  ws.next_kptr = reinterpret_cast<const void**>(p); p += align16(2 * kChunk);
  ws.next_vptr = reinterpret_cast<const void**>(p); p += align16(2 * kChunk);
  ws.head_kptr = reinterpret_cast<const void**>(p); p += align16(2 * kChunk);
  ws.head_vptr = reinterpret_cast<const void**>(p);
  return ws;
}

// Software prefetch of the next chunk's key (or value) rows, a few cache lines at every step
// of the current chunk's loops, so that memory works while the core computes. (A head's rows
// are num_kv_heads * head_dim apart, often a page: the hardware prefetchers do not follow, and
// asking for a whole chunk at once only stalls the core until the requests fit in flight.)
struct Prefetcher {
  const void* const* rows = nullptr;
  int num_rows = 0;
  int lines_per_row = 0;
  int row = 0;
  int line = 0;
  int quota = 0;  // lines per step

  // Spread what is left over `steps` steps.
  OCTAVO_INLINE void pace(int steps) {
    const int left = (num_rows - row) * lines_per_row - line;
    const int spread = steps > 0 ? steps : 1;
    quota = left <= 0 ? 0 : (left + spread - 1) / spread;
  }
  OCTAVO_INLINE void step() {
    for (int i = 0; i < quota && row < num_rows; ++i) {
      _mm_prefetch(static_cast<const char*>(rows[row]) + 64 * line, _MM_HINT_T0);
      if (++line == lines_per_row) {
        line = 0;
        ++row;
      }
    }
  }
  OCTAVO_INLINE void finish() {
    quota = num_rows * lines_per_row;
    step();
  }
};

// ---- scores ------------------------------------------------------------------------------

// s[r * kChunk + k] = horizontal sum of acc[r][k].
template <int RB, int KB>
OCTAVO_INLINE void store_scores(const Vec (&acc)[RB][KB], float* s) {
  if constexpr (KB == 4) {
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], s + r * kChunk);
  } else if constexpr (RB * KB == 8) {
    float sums[8];
    hsum8(&acc[0][0], sums);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) s[(i / KB) * kChunk + i % KB] = sums[i];
  } else {
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
      for (int k = 0; k < KB; ++k) s[r * kChunk + k] = hsum(acc[r][k]);
  }
}

// s[r * kChunk + k] = dot(q[r], keys[k]) for RB rows and KB keys, float32 accumulation.
// PF: step the prefetcher (the first row block of a chunk; the others run without it).
template <int RB, int KB, typename KT, bool PF>
OCTAVO_INLINE void qk_micro(const float* q, int head_dim, const KT* const* keys, float* s,
                            Prefetcher& pf) {
  Vec acc[RB][KB];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int k = 0; k < KB; ++k) acc[r][k] = vzero();
  for (int d = 0; d < head_dim; d += kWidth) {
    if constexpr (PF) pf.step();
    Vec qv[RB];
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) qv[r] = vload(q + r * head_dim + d);
#pragma GCC unroll 4
    for (int k = 0; k < KB; ++k) {
      const Vec kv = vload(keys[k] + d);
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) acc[r][k] = vfma(qv[r], kv, acc[r][k]);
    }
  }
  store_scores<RB, KB>(acc, s);
}

template <int RB, typename KT, bool PF>
inline void qk_rows(const float* q, int head_dim, const KT* const* keys, int n, float* s,
                    Prefetcher& pf) {
  int k = 0;
  for (; k + kKeyBlock <= n; k += kKeyBlock)
    qk_micro<RB, kKeyBlock, KT, PF>(q, head_dim, keys + k, s + k, pf);
  for (; k < n; ++k) qk_micro<RB, 1, KT, PF>(q, head_dim, keys + k, s + k, pf);
}

// Steps of the first row block of a QK pass over n keys (the prefetcher's pace).
OCTAVO_INLINE int qk_steps(int n, int head_dim, int step_keys) {
  return (n / step_keys + n % step_keys) * (head_dim / kWidth);
}

// pace_heads: KV heads of the tile still to run over this chunk, this one included (the
// prefetch of the next chunk is spread over all of them).
template <typename KT>
inline void qk_chunk(const float* q, int rows, int head_dim, const KT* const* keys, int n,
                     float* s, Prefetcher& pf, int pace_heads) {
  pf.pace(qk_steps(n, head_dim, kKeyBlock) * pace_heads);
  int r = 0;
  for (; r + kRowBlockQK <= rows; r += kRowBlockQK) {
    if (r == 0) {
      qk_rows<kRowBlockQK, KT, true>(q, head_dim, keys, n, s, pf);
    } else {
      qk_rows<kRowBlockQK, KT, false>(q + int64_t(r) * head_dim, head_dim, keys, n,
                                      s + r * kChunk, pf);
    }
  }
  // The 2 or 3 rows left (a decode step's query heads of one KV head when the group is 2
  // or 3) share each key load too; only a last single row runs alone.
  const int left = rows - r;
  if (left >= 2) {
    const float* qr = q + int64_t(r) * head_dim;
    float* sr = s + r * kChunk;
    if (left == 3) {
      if (r == 0) qk_rows<3, KT, true>(qr, head_dim, keys, n, sr, pf);
      else qk_rows<3, KT, false>(qr, head_dim, keys, n, sr, pf);
    } else {
      if (r == 0) qk_rows<2, KT, true>(qr, head_dim, keys, n, sr, pf);
      else qk_rows<2, KT, false>(qr, head_dim, keys, n, sr, pf);
    }
    r = rows;
  }
  for (; r < rows; ++r) {
    if (r == 0) {
      qk_rows<1, KT, true>(q, head_dim, keys, n, s, pf);
    } else {
      qk_rows<1, KT, false>(q + int64_t(r) * head_dim, head_dim, keys, n, s + r * kChunk, pf);
    }
  }
}

#ifdef OCTAVO_BF16_DOT
// The same scores from bfloat16 queries and keys with AVX512_BF16's vdpbf16ps: pairs of
// bfloat16 products (exact in float32) summed into float32 lanes, 32 elements per instruction.
OCTAVO_INLINE __m512bh load_bh(const bf16_t* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}
OCTAVO_INLINE __m512bh load_bh_half(const bf16_t* p) {  // 16 elements, upper half zero
  return (__m512bh)_mm512_maskz_loadu_epi16(0x0000FFFFu, p);
}

template <int RB, int KB, bool PF>
OCTAVO_INLINE void qk_micro_bf16(const bf16_t* q, int head_dim, const bf16_t* const* keys,
                                 float* s, Prefetcher& pf) {
  Vec acc[RB][KB];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int k = 0; k < KB; ++k) acc[r][k] = vzero();
  int d = 0;
  for (; d + 32 <= head_dim; d += 32) {
    if constexpr (PF) {
      pf.step();
      pf.step();
    }
    __m512bh qv[RB];
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) qv[r] = load_bh(q + r * head_dim + d);
#pragma GCC unroll 4
    for (int k = 0; k < KB; ++k) {
      const __m512bh kv = load_bh(keys[k] + d);
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) acc[r][k].v = _mm512_dpbf16_ps(acc[r][k].v, qv[r], kv);
    }
  }
  if (d < head_dim) {  // head_dim % 32 == 16
    __m512bh qv[RB];
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) qv[r] = load_bh_half(q + r * head_dim + d);
#pragma GCC unroll 4
    for (int k = 0; k < KB; ++k) {
      const __m512bh kv = load_bh_half(keys[k] + d);
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) acc[r][k].v = _mm512_dpbf16_ps(acc[r][k].v, qv[r], kv);
    }
  }
  store_scores<RB, KB>(acc, s);
}

template <int RB, bool PF>
inline void qk_rows_bf16(const bf16_t* q, int head_dim, const bf16_t* const* keys, int n,
                         float* s, Prefetcher& pf) {
  int k = 0;
  for (; k + kKeyBlock <= n; k += kKeyBlock)
    qk_micro_bf16<RB, kKeyBlock, PF>(q, head_dim, keys + k, s + k, pf);
  for (; k < n; ++k) qk_micro_bf16<RB, 1, PF>(q, head_dim, keys + k, s + k, pf);
}

inline void qk_chunk_bf16(const bf16_t* q, int rows, int head_dim, const bf16_t* const* keys,
                          int n, float* s, Prefetcher& pf, int pace_heads) {
  pf.pace(qk_steps(n, head_dim, kKeyBlock) * pace_heads);  // two steps per 32 elements: as many as above
  int r = 0;
  for (; r + kRowBlockQK <= rows; r += kRowBlockQK) {
    if (r == 0) {
      qk_rows_bf16<kRowBlockQK, true>(q, head_dim, keys, n, s, pf);
    } else {
      qk_rows_bf16<kRowBlockQK, false>(q + int64_t(r) * head_dim, head_dim, keys, n,
                                       s + r * kChunk, pf);
    }
  }
  for (; r < rows; ++r) {
    if (r == 0) {
      qk_rows_bf16<1, true>(q, head_dim, keys, n, s, pf);
    } else {
      qk_rows_bf16<1, false>(q + int64_t(r) * head_dim, head_dim, keys, n, s + r * kChunk, pf);
    }
  }
}
#endif  // OCTAVO_BF16_DOT

// ---- online softmax ------------------------------------------------------------------------

// cap * tanh(x / cap) (x already scaled): tanh from one exp of -2|x / cap|, which never
// overflows, and the sign of x.
OCTAVO_INLINE Vec soft_capped(Vec x, Vec cap, Vec inv_cap) {
  const Vec e = vexp(vmul(vset(-2.0f), vabs(vmul(x, inv_cap))));
  const Vec one = vset(1.0f);
  return vmul(cap, vcopysign(vdiv(vsub(one, e), vadd(one, e)), x));
}

// Turns each row's scores into exp(scale * s - m_new) (soft-capped first when soft_cap > 0;
// 0 for keys it may not see), and updates m, l and rescales the row's output. Rows that see
// no key of the chunk get P = 0.
inline void softmax_chunk(float* s, int rows, int n, const int* first, const int* visible,
                          float scale, float soft_cap, float* m, float* l, float* o,
                          int head_dim) {
  const int n_pad = (n + kWidth - 1) / kWidth * kWidth;
  const Vec vscale = vset(scale);
  const Vec vcap = vset(soft_cap);
  const Vec vinv_cap = vset(soft_cap > 0.0f ? 1.0f / soft_cap : 0.0f);
  for (int r = 0; r < rows; ++r) {
    float* sr = s + r * kChunk;
    const int vis = visible[r];
    const int lo = first[r];
    if (vis <= lo) {
      for (int j = 0; j < n_pad; j += kWidth) vstore(sr + j, vzero());
      continue;
    }
    if (soft_cap > 0.0f) {
      for (int j = 0; j < n_pad; j += kWidth)
        vstore(sr + j, soft_capped(vmul(vload(sr + j), vscale), vcap, vinv_cap));
    } else {
      for (int j = 0; j < n_pad; j += kWidth) vstore(sr + j, vmul(vload(sr + j), vscale));
    }
    for (int j = 0; j < lo; ++j) sr[j] = -__builtin_inff();  // before the window
    for (int j = vis; j < n_pad; ++j) sr[j] = -__builtin_inff();  // masked, or never computed
    Vec vmx = vset(-__builtin_inff());
    for (int j = 0; j < n_pad; j += kWidth) vmx = vmax(vmx, vload(sr + j));
    const float chunk_max = hmax(vmx);
    const float m_new = m[r] > chunk_max ? m[r] : chunk_max;
    const Vec vm = vset(m_new);
    Vec vsum = vzero();
    for (int j = 0; j < n_pad; j += kWidth) {
      const Vec p = vexp(vsub(vload(sr + j), vm));
      vstore(sr + j, p);
      vsum = vadd(vsum, p);
    }
    const float correction = expf(m[r] - m_new);  // 0 on the row's first chunk (m = -inf)
    l[r] = l[r] * correction + hsum(vsum);
    if (correction != 1.0f) {
      float* orow = o + int64_t(r) * head_dim;
      const Vec vc = vset(correction);
      for (int d = 0; d < head_dim; d += kWidth) vstore(orow + d, vmul(vload(orow + d), vc));
    }
    m[r] = m_new;
  }
}

// ---- output += P V -------------------------------------------------------------------------

template <int RB, int NV, typename VT, bool PF>
OCTAVO_INLINE void pv_micro(const float* p, const VT* const* values, int n, int d0, float* o,
                            int head_dim, Prefetcher& pf) {
  Vec acc[RB][NV];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = vload(o + r * head_dim + d0 + v * kWidth);
  for (int j = 0; j < n; ++j) {
    if constexpr (PF) pf.step();
    Vec vv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vv[v] = vload(values[j] + d0 + v * kWidth);
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const Vec pj = vset(p[r * kChunk + j]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = vfma(pj, vv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vstore(o + r * head_dim + d0 + v * kWidth, acc[r][v]);
}

template <int RB, typename VT, bool PF>
inline void pv_rows(const float* p, const VT* const* values, int n, float* o, int head_dim,
                    Prefetcher& pf) {
  int d0 = 0;
  for (; d0 + kVecBlockPV * kWidth <= head_dim; d0 += kVecBlockPV * kWidth)
    pv_micro<RB, kVecBlockPV, VT, PF>(p, values, n, d0, o, head_dim, pf);
  for (; d0 < head_dim; d0 += kWidth)
    pv_micro<RB, 1, VT, PF>(p, values, n, d0, o, head_dim, pf);
}

template <typename VT>
inline void pv_chunk(const float* p, int rows, const int* visible, const VT* const* values,
                     float* o, int head_dim, Prefetcher& pf, int pace_heads) {
  // Steps of the first row block: its longest visible run times the head_dim blocks.
  const int full_blocks = head_dim / (kVecBlockPV * kWidth);
  const int tail_blocks = head_dim % (kVecBlockPV * kWidth) / kWidth;
  pf.pace(visible[imin(rows, kRowBlockPV) - 1] * (full_blocks + tail_blocks) * pace_heads);
  int r = 0;
  for (; r + kRowBlockPV <= rows; r += kRowBlockPV) {
    int n = 0;  // probabilities past the block's longest visible run are all 0
    for (int i = 0; i < kRowBlockPV; ++i) n = imax(n, visible[r + i]);
    if (n > 0 && r == 0) {
      pv_rows<kRowBlockPV, VT, true>(p, values, n, o, head_dim, pf);
    } else if (n > 0) {
      pv_rows<kRowBlockPV, VT, false>(p + r * kChunk, values, n, o + int64_t(r) * head_dim,
                                      head_dim, pf);
    }
  }
  const int left = rows - r;
  if (left >= 2) {  // as in qk_chunk: the last 2 or 3 rows share each value load
    int n = 0;
    for (int i = 0; i < left; ++i) n = imax(n, visible[r + i]);
    const float* pr = p + r * kChunk;
    float* orow = o + int64_t(r) * head_dim;
    if (n > 0 && left == 3) {
      if (r == 0) pv_rows<3, VT, true>(pr, values, n, orow, head_dim, pf);
      else pv_rows<3, VT, false>(pr, values, n, orow, head_dim, pf);
    } else if (n > 0) {
      if (r == 0) pv_rows<2, VT, true>(pr, values, n, orow, head_dim, pf);
      else pv_rows<2, VT, false>(pr, values, n, orow, head_dim, pf);
    }
    r = rows;
  }
  for (; r < rows; ++r) {
    if (visible[r] > 0 && r == 0) {
      pv_rows<1, VT, true>(p, values, visible[r], o, head_dim, pf);
    } else if (visible[r] > 0) {
      pv_rows<1, VT, false>(p + r * kChunk, values, visible[r], o + int64_t(r) * head_dim,
                            head_dim, pf);
    }
  }
}

// Rows [0, n) of a chunk converted to float32 rows of `dst`; ptrs then point at them.
template <typename T>
inline void convert_rows(const void** ptrs, int n, int head_dim, float* dst) {
  for (int j = 0; j < n; ++j) {
    const T* src = static_cast<const T*>(ptrs[j]);
    float* row = dst + int64_t(j) * head_dim;
    for (int d = 0; d < head_dim; d += kWidth) vstore(row + d, vload(src + d));
    ptrs[j] = row;
  }
}

// Key and value row addresses of positions [c0, c0 + n) of one sequence and KV head.
template <typename T>
OCTAVO_INLINE void row_pointers(const AttentionArgs& a, const int32_t* table, const T* keys,
                                const T* values, int64_t head_offset, int c0, int n,
                                const void** kptr, const void** vptr) {
  const int64_t token_stride = int64_t(a.num_kv_heads) * a.head_dim;
  int block = c0 / a.block_size, offset = c0 % a.block_size;
  for (int j = 0; j < n; ++j) {
    const int64_t slot = int64_t(table[block]) * a.block_size + offset;
    kptr[j] = keys + slot * token_stride + head_offset;
    vptr[j] = values + slot * token_stride + head_offset;
    if (++offset == a.block_size) {
      offset = 0;
      ++block;
    }
  }
}

// ---- one work item -------------------------------------------------------------------------

// The rows of a tile: rows_per_head rows (token-major, then query head of the group) for each
// of its heads (one, or every KV head for a head tile), head-major.
struct TileRows {
  int group;
  int tokens;
  int first_head;     // first KV head of the tile
  int heads;          // KV heads of the tile
  int rows_per_head;  // tokens * group
  int rows;           // rows_per_head * heads

  // Token (offset within the tile) and query head of row r.
  OCTAVO_INLINE int token(int r) const { return (r % rows_per_head) / group; }
  OCTAVO_INLINE int query_head(int r) const {
    return (first_head + r / rows_per_head) * group + (r % rows_per_head) % group;
  }
};

OCTAVO_INLINE TileRows tile_rows(const AttentionArgs& a, const Tile& tile) {
  TileRows t;
  t.group = a.num_heads / a.num_kv_heads;
  t.tokens = tile.query_end - tile.query_begin;
  t.first_head = tile.kv_head < 0 ? 0 : tile.kv_head;
  t.heads = tile.kv_head < 0 ? a.num_kv_heads : 1;
  t.rows_per_head = t.tokens * t.group;
  t.rows = t.rows_per_head * t.heads;
  return t;
}

// One head's rows of a chunk: the key (or value) row of KV head `head` at each position, from
// the addresses of the positions' whole token rows.
template <typename T>
OCTAVO_INLINE void head_rows(const void* const* token_rows, int n, int64_t head_offset,
                             const void** out) {
  for (int j = 0; j < n; ++j) out[j] = static_cast<const T*>(token_rows[j]) + head_offset;
}

template <typename T>
void run_item(const AttentionArgs& a, const Tile& tile, const WorkItem& item, Workspace& ws,
              float* part_out) {
  const TileRows tr = tile_rows(a, tile);
  const int group = tr.group;
  const int head_dim = a.head_dim;
  const int rows = tr.rows;
  const int rows_h = tr.rows_per_head;
  const bool head_tile = tile.kv_head < 0;
  const int first_token = a.query_start_loc[tile.seq];  // flat index of its first new token
  const int query_len = a.query_start_loc[tile.seq + 1] - first_token;
  const int context_len = a.seq_lens[tile.seq] - query_len;
  const T* query = static_cast<const T*>(a.query);

#ifdef OCTAVO_BF16_DOT
  constexpr bool kBf16Dot = IsSame<T, bf16_t>::value;
#else
  constexpr bool kBf16Dot = false;
#endif

  // Q rows of the tile.
  for (int r = 0; r < rows; ++r) {
    const T* src = query + int64_t(first_token + tile.query_begin + tr.token(r)) *
                               a.query_stride_token +
                   int64_t(tr.query_head(r)) * a.query_stride_head;
    if constexpr (kBf16Dot) {
      bf16_t* dst = reinterpret_cast<bf16_t*>(ws.q) + int64_t(r) * head_dim;
      for (int d = 0; d < head_dim; ++d) dst[d] = src[d];
    } else {
      float* dst = ws.q + int64_t(r) * head_dim;
      for (int d = 0; d < head_dim; d += kWidth) vstore(dst + d, vload(src + d));
    }
  }
  for (int r = 0; r < rows; ++r) {
    ws.m[r] = -__builtin_inff();
    ws.l[r] = 0.0f;
    float* orow = ws.o + int64_t(r) * head_dim;
    for (int d = 0; d < head_dim; d += kWidth) vstore(orow + d, vzero());
  }

  const int32_t* table = a.block_tables + int64_t(tile.seq) * a.block_table_stride;
  const T* keys = static_cast<const T*>(a.kv_cache);
  const T* values = keys + a.kv_half;
  // A head tile keeps the addresses of whole token rows (head 0) and prefetches them whole.
  const int64_t head_offset = int64_t(tr.first_head) * head_dim;
  const int64_t row_elems = head_tile ? int64_t(a.num_kv_heads) * head_dim : head_dim;
  const int lines_per_row = int((row_elems * int64_t(sizeof(T)) + 63) / 64);
  const bool convert_keys = !kBf16Dot && rows_h >= kConvertRows;
  const bool convert_values = rows_h >= kConvertRows;

  // The first chunk is asked for at once; each later one while the previous one computes.
  const int first_n = imin(kChunk, item.kv_end - item.kv_begin);
  row_pointers<T>(a, table, keys, values, head_offset, item.kv_begin, first_n, ws.kptr, ws.vptr);
  Prefetcher first_k{ws.kptr, first_n, lines_per_row}, first_v{ws.vptr, first_n, lines_per_row};
  first_k.finish();
  first_v.finish();
  for (int c0 = item.kv_begin; c0 < item.kv_end; c0 += kChunk) {
    const int n = imin(kChunk, item.kv_end - c0);
    const int next_n = imax(0, imin(kChunk, item.kv_end - c0 - kChunk));
    row_pointers<T>(a, table, keys, values, head_offset, c0 + kChunk, next_n, ws.next_kptr,
                    ws.next_vptr);
    Prefetcher next_k{ws.next_kptr, next_n, lines_per_row};
    Prefetcher next_v{ws.next_vptr, next_n, lines_per_row};
    for (int r = 0; r < rows_h; ++r) {  // the same for every head of the tile
      const int query_pos = context_len + tile.query_begin + r / group;
      ws.visible[r] = imax(0, imin(n, query_pos + 1 - c0));
      ws.first[r] = a.sliding_window > 0 ? imax(0, query_pos - a.sliding_window + 1 - c0) : 0;
    }

    for (int h = 0; h < tr.heads; ++h) {
      const int64_t r0 = int64_t(h) * rows_h;
      const void** kp = ws.kptr;
      const void** vp = ws.vptr;
      if (head_tile) {
        head_rows<T>(ws.kptr, n, int64_t(h) * head_dim, ws.head_kptr);
        head_rows<T>(ws.vptr, n, int64_t(h) * head_dim, ws.head_vptr);
        kp = ws.head_kptr;
        vp = ws.head_vptr;
      }
      float* s = ws.s + r0 * kChunk;
      float* o = ws.o + r0 * head_dim;
      const int pace_heads = tr.heads - h;

#ifdef OCTAVO_BF16_DOT
      if constexpr (kBf16Dot) {
        qk_chunk_bf16(reinterpret_cast<const bf16_t*>(ws.q) + r0 * head_dim, rows_h, head_dim,
                      reinterpret_cast<const bf16_t* const*>(kp), n, s, next_k, pace_heads);
      } else
#endif
      if (convert_keys) {
        convert_rows<T>(kp, n, head_dim, ws.kconv);
        qk_chunk<float>(ws.q + r0 * head_dim, rows_h, head_dim,
                        reinterpret_cast<const float* const*>(kp), n, s, next_k, pace_heads);
      } else {
        qk_chunk<T>(ws.q + r0 * head_dim, rows_h, head_dim, reinterpret_cast<const T* const*>(kp),
                    n, s, next_k, pace_heads);
      }

      softmax_chunk(s, rows_h, n, ws.first, ws.visible, a.scale, a.soft_cap, ws.m + r0,
                    ws.l + r0, o, head_dim);

      if (convert_values) {
        convert_rows<T>(vp, n, head_dim, ws.vconv);
        pv_chunk<float>(s, rows_h, ws.visible, reinterpret_cast<const float* const*>(vp), o,
                        head_dim, next_v, pace_heads);
      } else {
        pv_chunk<T>(s, rows_h, ws.visible, reinterpret_cast<const T* const*>(vp), o, head_dim,
                    next_v, pace_heads);
      }
    }
    next_k.finish();
    next_v.finish();
    const void** swap_k = ws.kptr;
    ws.kptr = ws.next_kptr;
    ws.next_kptr = swap_k;
    const void** swap_v = ws.vptr;
    ws.vptr = ws.next_vptr;
    ws.next_vptr = swap_v;
  }

  if (part_out != nullptr) {  // a part of a split tile: leave (O, m, l) for the combine pass
    float* part_m = part_out + int64_t(rows) * head_dim;
    float* part_l = part_m + rows;
    for (int r = 0; r < rows; ++r) {
      const float* orow = ws.o + int64_t(r) * head_dim;
      float* dst = part_out + int64_t(r) * head_dim;
      for (int d = 0; d < head_dim; d += kWidth) vstore(dst + d, vload(orow + d));
      part_m[r] = ws.m[r];
      part_l[r] = ws.l[r];
    }
    return;
  }
  T* out = static_cast<T*>(a.out);
  for (int r = 0; r < rows; ++r) {
    T* dst = out + (int64_t(first_token + tile.query_begin + tr.token(r)) * a.num_heads +
                    tr.query_head(r)) * head_dim;
    const Vec inv = vset(1.0f / ws.l[r]);
    const float* orow = ws.o + int64_t(r) * head_dim;
    for (int d = 0; d < head_dim; d += kWidth) vstore(dst + d, vmul(vload(orow + d), inv));
  }
}

// out = sum_p exp(m_p - M) O_p / sum_p exp(m_p - M) l_p, M = max_p m_p, for a split tile.
template <typename T>
void combine_parts(const AttentionArgs& a, const Tile& tile, const float* part_scratch,
                   Workspace& ws) {
  const TileRows tr = tile_rows(a, tile);
  const int head_dim = a.head_dim;
  const int rows = tr.rows;
  const int64_t part_floats = part_scratch_floats(rows, head_dim);
  const float* base = part_scratch + tile.part_scratch;
  const int first_token = a.query_start_loc[tile.seq];
  T* out = static_cast<T*>(a.out);
  float* acc = ws.o;  // one row of float32 accumulators
  for (int r = 0; r < rows; ++r) {
    float m_max = -__builtin_inff();
    for (int p = 0; p < tile.num_parts; ++p) {
      const float m_p = base[p * part_floats + int64_t(rows) * head_dim + r];
      m_max = m_p > m_max ? m_p : m_max;
    }
    for (int d = 0; d < head_dim; d += kWidth) vstore(acc + d, vzero());
    float total = 0.0f;
    for (int p = 0; p < tile.num_parts; ++p) {
      const float* part = base + p * part_floats;
      const float l_p = part[int64_t(rows) * head_dim + rows + r];
      if (l_p == 0.0f) continue;  // a part holding no key this row may see
      const float w = expf(part[int64_t(rows) * head_dim + r] - m_max);
      total += w * l_p;
      const Vec vw = vset(w);
      const float* orow = part + int64_t(r) * head_dim;
      for (int d = 0; d < head_dim; d += kWidth)
        vstore(acc + d, vfma(vw, vload(orow + d), vload(acc + d)));
    }
    T* dst = out + (int64_t(first_token + tile.query_begin + tr.token(r)) * a.num_heads +
                    tr.query_head(r)) * head_dim;
    const Vec inv = vset(1.0f / total);
    for (int d = 0; d < head_dim; d += kWidth) vstore(dst + d, vmul(vload(acc + d), inv));
  }
}

template <typename T>
void run_all(const AttentionArgs& a, const Tile* tiles, int num_tiles, const WorkItem* items,
             int num_items, int max_rows, float* scratch, float* part_scratch, int num_threads) {
  const int64_t per_thread = thread_scratch_floats(max_rows, a.head_dim);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_items > 1)
  {
    Workspace ws = carve(scratch + omp_get_thread_num() * per_thread, max_rows, a.head_dim);
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < num_items; ++i) {
      const WorkItem& item = items[i];
      const Tile& tile = tiles[item.tile];
      float* part_out = nullptr;
      if (tile.num_parts > 1) {
        const int rows = tile_rows(a, tile).rows;
        part_out = part_scratch + tile.part_scratch +
                   item.part * part_scratch_floats(rows, a.head_dim);
      }
      run_item<T>(a, tile, item, ws, part_out);
    }
    // (implicit barrier: every part is written before any tile is combined)
#pragma omp for schedule(dynamic, 1)
    for (int t = 0; t < num_tiles; ++t) {
      if (tiles[t].num_parts > 1) combine_parts<T>(a, tiles[t], part_scratch, ws);
    }
  }
}

void paged_attention(const AttentionArgs& args, const Tile* tiles, int num_tiles,
                     const WorkItem* items, int num_items, int max_rows, float* scratch,
                     float* part_scratch, int num_threads) {
  switch (args.dtype) {
    case DType::kFloat32:
      run_all<float>(args, tiles, num_tiles, items, num_items, max_rows, scratch, part_scratch,
                     num_threads);
      break;
    case DType::kBFloat16:
      run_all<bf16_t>(args, tiles, num_tiles, items, num_items, max_rows, scratch, part_scratch,
                      num_threads);
      break;
    case DType::kFloat16:
      run_all<f16_t>(args, tiles, num_tiles, items, num_items, max_rows, scratch, part_scratch,
                     num_threads);
      break;
  }
}
