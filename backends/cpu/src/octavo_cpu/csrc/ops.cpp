// Torch bindings of the CPU paged-attention kernels (ops in the `octavo_cpu` namespace):
//   write_kv_cache(key, value, kv_cache, slot_mapping)    store new K/V, slot < 0 = skip
//   paged_attention(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, isa,
//                   part_size, sliding_window, soft_cap) -> out
//                                                         causal attention over the paged cache
//                                                         (window 0 / cap 0: none)
//   supported_isas() -> [str]                             instruction sets this CPU can run
// This file checks the inputs, cuts the step into tiles and work items, and calls the kernels of
// the best instruction set the CPU has (attention_<isa>.cpp). It is compiled for the generic
// x86-64 (or whatever the machine is): no vector instructions the CPU might lack.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"

namespace octavo_cpu {
namespace {

// Query rows (tokens x query heads of one KV head) a prefill tile aims at: enough rows to reuse
// each key and value loaded from the cache, few enough for the tile's buffers to stay in L2.
constexpr int kRowsPerTile = 32;
// Splitting a tile's keys is worth it only for parts of at least this many keys.
constexpr int kMinPartSize = 256;
// Below this many (query row, key) pairs in a step (~20 us of work on one core) the step runs
// on the calling thread: a parallel region's hand-off and barrier cost about what the second
// thread would save (a batch-1 decode over a few hundred positions), and far more when
// another process holds the other core.
constexpr int64_t kMinParallelWork = 2048;

// Head tiles (common.h) for sequences with few new tokens; OCTAVO_CPU_ATTENTION_HEAD_TILES=0
// turns them off (one tile per KV head, as for prefill), for comparisons. Read once.
bool head_tiles_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("OCTAVO_CPU_ATTENTION_HEAD_TILES");
    return v == nullptr || std::string(v) != "0";
  }();
  return enabled;
}

enum class Isa { kNone, kAvx2, kAvx512, kAvx512Bf16 };

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512bf16";
    default: return "none";
  }
}

// Instruction sets this CPU (and OS: libgcc checks the saved vector state) supports, best last.
std::vector<Isa> cpu_isas() {
  std::vector<Isa> isas;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  if (avx2) isas.push_back(Isa::kAvx2);
  if (avx512) isas.push_back(Isa::kAvx512);
  if (avx512 && __builtin_cpu_supports("avx512bf16")) isas.push_back(Isa::kAvx512Bf16);
#endif
  return isas;
}

const std::vector<Isa>& supported() {
  static const std::vector<Isa> isas = cpu_isas();
  return isas;
}

Isa choose_isa(const std::string& requested, DType dtype) {
  const auto& isas = supported();
  TORCH_CHECK(!isas.empty(), "octavo_cpu: this CPU has no AVX2; use the torch implementation");
  if (requested.empty()) {
    Isa best = isas.back();
    // vdpbf16ps only helps bfloat16; the plain AVX-512 code is the same for the other dtypes.
    if (best == Isa::kAvx512Bf16 && dtype != DType::kBFloat16) best = Isa::kAvx512;
    return best;
  }
  for (Isa isa : isas) {
    if (requested == isa_name(isa)) return isa;
  }
  std::string have;
  for (Isa isa : isas) have += std::string(have.empty() ? "" : ", ") + isa_name(isa);
  TORCH_CHECK(false, "octavo_cpu: instruction set '", requested, "' is not available on this CPU (",
              "available: ", have, ")");
}

DType to_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default:
      TORCH_CHECK(false, "octavo_cpu: dtype ", type,
                  " is not supported (float32, bfloat16 and float16 are)");
  }
}

void check_int_tensor(const at::Tensor& t, const char* name, at::ScalarType type, int dim) {
  TORCH_CHECK(t.device().is_cpu(), "octavo_cpu: ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.scalar_type() == type, "octavo_cpu: ", name, " must be ", type, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == dim, "octavo_cpu: ", name, " must have ", dim, " dims, got ", t.sizes());
  TORCH_CHECK(t.stride(dim - 1) == 1, "octavo_cpu: ", name, "'s last dim must be contiguous");
}

void check_kv_cache(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "octavo_cpu: kv_cache must be a CPU tensor [2, num_blocks, block_size, "
              "num_kv_heads, head_dim], got ", kv_cache.sizes(), " on ", kv_cache.device());
  TORCH_CHECK(kv_cache.is_contiguous(), "octavo_cpu: kv_cache must be contiguous");
}

// Per-thread buffers kept between calls (grow only): no allocation per layer and step.
float* thread_buffer(std::vector<float>& buffer, int64_t floats) {
  if (int64_t(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

// ---- KV-cache write --------------------------------------------------------------------------

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                    const at::Tensor& slot_mapping) {
  check_kv_cache(kv_cache);
  check_int_tensor(slot_mapping, "slot_mapping", at::kLong, 1);
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t num_kv_heads = kv_cache.size(3), head_dim = kv_cache.size(4);
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->size(0) == num_tokens &&
                    t->size(1) == num_kv_heads && t->size(2) == head_dim,
                "octavo_cpu: key/value must be CPU tensors [", num_tokens, ", ", num_kv_heads,
                ", ", head_dim, "], got ", t->sizes());
    TORCH_CHECK(t->scalar_type() == kv_cache.scalar_type(), "octavo_cpu: key/value dtype ",
                t->scalar_type(), " differs from the cache's ", kv_cache.scalar_type());
    TORCH_CHECK(t->stride(2) == 1, "octavo_cpu: key/value's last dim must be contiguous");
  }
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] < num_slots, "octavo_cpu: slot ", slots[t], " of token ", t,
                " is past the cache's ", num_slots, " slots");
  }
  const int64_t elem = kv_cache.element_size();
  const int64_t row_bytes = head_dim * elem;
  const int64_t slot_elems = num_kv_heads * head_dim;
  char* cache_k = static_cast<char*>(kv_cache.data_ptr());
  char* cache_v = cache_k + num_slots * slot_elems * elem;
  const char* src_k = static_cast<const char*>(key.data_ptr());
  const char* src_v = static_cast<const char*>(value.data_ptr());
  const int64_t k_token = key.stride(0) * elem, k_head = key.stride(1) * elem;
  const int64_t v_token = value.stride(0) * elem, v_head = value.stride(1) * elem;
  const int num_threads = at::get_num_threads();
  const bool parallel = num_threads > 1 && num_tokens * slot_elems > 65536;  // else not worth it
#pragma omp parallel for num_threads(num_threads) if (parallel)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // padding
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t dst = (slot * slot_elems + h * head_dim) * elem;
      std::memcpy(cache_k + dst, src_k + t * k_token + h * k_head, row_bytes);
      std::memcpy(cache_v + dst, src_v + t * v_token + h * v_head, row_bytes);
    }
  }
}

// ---- paged attention -------------------------------------------------------------------------

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           const at::Tensor& block_tables, double scale, std::string isa,
                           int64_t part_size, int64_t sliding_window, double soft_cap) {
  TORCH_CHECK(query.device().is_cpu() && query.dim() == 3,
              "octavo_cpu: query must be a CPU tensor [num_tokens, num_heads, head_dim], got ",
              query.sizes(), " on ", query.device());
  TORCH_CHECK(query.stride(2) == 1, "octavo_cpu: query's last dim must be contiguous");
  check_kv_cache(kv_cache);
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type(), "octavo_cpu: query dtype ",
              query.scalar_type(), " differs from the cache's ", kv_cache.scalar_type());
  check_int_tensor(query_start_loc, "query_start_loc", at::kInt, 1);
  check_int_tensor(seq_lens, "seq_lens", at::kInt, 1);
  if (query_start_loc.size(0) > 1) {  // an empty step may come with an empty, 1-d table
    check_int_tensor(block_tables, "block_tables", at::kInt, 2);
  }
  TORCH_CHECK(part_size >= 0, "octavo_cpu: part_size must be >= 0 (0 = automatic)");
  TORCH_CHECK(sliding_window >= 0 && sliding_window <= INT32_MAX,
              "octavo_cpu: sliding_window must be >= 0 (0 = none), got ", sliding_window);
  TORCH_CHECK(soft_cap >= 0.0, "octavo_cpu: soft_cap must be >= 0 (0 = none), got ", soft_cap);

  AttentionArgs a;
  a.dtype = to_dtype(query.scalar_type());
  const int64_t num_tokens = query.size(0);
  a.num_heads = int(query.size(1));
  a.num_kv_heads = int(kv_cache.size(3));
  a.head_dim = int(kv_cache.size(4));
  a.block_size = int(kv_cache.size(2));
  const int64_t num_blocks = kv_cache.size(1);
  TORCH_CHECK(query.size(2) == a.head_dim, "octavo_cpu: query head_dim ", query.size(2),
              " differs from the cache's ", a.head_dim);
  TORCH_CHECK(a.num_heads % a.num_kv_heads == 0, "octavo_cpu: num_heads (", a.num_heads,
              ") must be a multiple of num_kv_heads (", a.num_kv_heads, ")");
  TORCH_CHECK(a.head_dim % kHeadDimMultiple == 0, "octavo_cpu: head_dim ", a.head_dim,
              " is not a multiple of ", kHeadDimMultiple, "; use the torch implementation");
  const int num_seqs = int(query_start_loc.size(0)) - 1;
  TORCH_CHECK(num_seqs >= 0 && seq_lens.size(0) == num_seqs && block_tables.size(0) >= num_seqs,
              "octavo_cpu: query_start_loc [", query_start_loc.size(0), "], seq_lens [",
              seq_lens.size(0), "] and block_tables [", block_tables.size(0),
              ", ...] disagree on the number of sequences");
  const Isa chosen = choose_isa(isa, a.dtype);

  at::Tensor out = at::empty({num_tokens, a.num_heads, a.head_dim}, query.options());
  a.query = query.data_ptr();
  a.query_stride_token = query.stride(0);
  a.query_stride_head = query.stride(1);
  a.kv_cache = kv_cache.data_ptr();
  a.kv_half = num_blocks * a.block_size * a.num_kv_heads * a.head_dim;
  a.out = out.data_ptr();
  a.query_start_loc = query_start_loc.data_ptr<int32_t>();
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.block_tables = num_seqs > 0 ? block_tables.data_ptr<int32_t>() : nullptr;
  a.block_table_stride = num_seqs > 0 ? block_tables.stride(0) : 0;
  a.scale = float(scale);
  a.sliding_window = int(sliding_window);
  a.soft_cap = float(soft_cap);

  // Tiles: every sequence's new tokens in runs of up to tokens_per_tile, times the KV heads;
  // or, for a sequence with few new tokens, one head tile (common.h) for all the KV heads.
  const bool head_tiles = head_tiles_enabled();
  const int group = a.num_heads / a.num_kv_heads;
  const int tokens_per_tile = std::max(1, kRowsPerTile / group);
  const int64_t table_width = block_tables.dim() == 2 ? block_tables.size(1) : 0;
  std::vector<Tile> tiles;
  int64_t total_keys = 0;       // (key, KV head) pairs
  int64_t total_tile_keys = 0;  // keys of the tiles (each head tile counted once)
  int max_rows = 1;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_begin = a.query_start_loc[s], q_end = a.query_start_loc[s + 1];
    const int query_len = q_end - q_begin, seq_len = a.seq_lens[s];
    TORCH_CHECK(q_begin >= 0 && query_len >= 0 && q_end <= num_tokens,
                "octavo_cpu: query_start_loc must rise from 0 to at most num_tokens (", num_tokens,
                "); sequence ", s, " spans [", q_begin, ", ", q_end, ")");
    TORCH_CHECK(seq_len >= query_len, "octavo_cpu: sequence ", s, " has seq_len ", seq_len,
                " < its ", query_len, " new tokens");
    if (query_len == 0) continue;
    const int64_t blocks = (int64_t(seq_len) + a.block_size - 1) / a.block_size;
    TORCH_CHECK(blocks <= table_width, "octavo_cpu: sequence ", s, " needs ", blocks,
                " blocks, its block table has ", table_width);
    const int32_t* table = a.block_tables + int64_t(s) * a.block_table_stride;
    const int context_len = seq_len - query_len;
    // Blocks wholly before the window of the sequence's first new token are never read.
    const int first_key =
        a.sliding_window > 0 ? std::max(0, context_len - a.sliding_window + 1) : 0;
    for (int64_t b = first_key / a.block_size; b < blocks; ++b) {
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "octavo_cpu: sequence ", s, " block ",
                  b, " is ", table[b], ", outside the cache's ", num_blocks, " blocks");
    }
    if (head_tiles && a.num_kv_heads > 1 && int64_t(query_len) * a.num_heads <= kRowsPerTile) {
      // A few new tokens (a decode step): one tile for all the KV heads.
      const int kv_begin =
          a.sliding_window > 0 ? std::max(0, context_len - a.sliding_window + 1) : 0;
      max_rows = std::max(max_rows, query_len * a.num_heads);
      tiles.push_back(Tile{s, -1, 0, query_len, kv_begin, seq_len, 1, 0});
      total_keys += int64_t(seq_len - kv_begin) * a.num_kv_heads;
      total_tile_keys += seq_len - kv_begin;
      continue;
    }
    for (int i0 = 0; i0 < query_len; i0 += tokens_per_tile) {
      const int i1 = std::min(query_len, i0 + tokens_per_tile);
      max_rows = std::max(max_rows, (i1 - i0) * group);
      const int kv_begin =
          a.sliding_window > 0 ? std::max(0, context_len + i0 - a.sliding_window + 1) : 0;
      for (int h = 0; h < a.num_kv_heads; ++h) {
        tiles.push_back(Tile{s, h, i0, i1, kv_begin, context_len + i1, 1, 0});
        total_keys += context_len + i1 - kv_begin;
        total_tile_keys += context_len + i1 - kv_begin;
      }
    }
  }
  // Rows of tokens no sequence owns (none in a well-formed step) are zero.
  const int64_t covered_begin = num_seqs > 0 ? a.query_start_loc[0] : 0;
  const int64_t covered_end = num_seqs > 0 ? a.query_start_loc[num_seqs] : 0;
  const int64_t row_bytes = int64_t(a.num_heads) * a.head_dim * out.element_size();
  char* out_bytes = static_cast<char*>(a.out);
  std::memset(out_bytes, 0, covered_begin * row_bytes);
  std::memset(out_bytes + covered_end * row_bytes, 0, (num_tokens - covered_end) * row_bytes);
  if (tiles.empty()) return out;

  // Split the keys of long tiles when there are too few tiles to keep every thread busy.
  int num_threads = std::max(1, at::get_num_threads());
  if (part_size == 0 && total_keys * group < kMinParallelWork) num_threads = 1;
  int64_t part = 0;  // 0: no split
  if (part_size > 0) {
    part = part_size;
  } else if (num_threads > 1 && int64_t(tiles.size()) < 4 * num_threads) {
    part = std::max<int64_t>(kMinPartSize, total_tile_keys / (4 * num_threads));
  }
  part = (part + kChunk - 1) / kChunk * kChunk;
  std::vector<WorkItem> items;
  std::vector<int64_t> cost;
  int64_t part_floats = 0;
  for (int t = 0; t < int(tiles.size()); ++t) {
    Tile& tile = tiles[t];
    const int rows = (tile.query_end - tile.query_begin) * group *
                     (tile.kv_head < 0 ? a.num_kv_heads : 1);
    const int num_keys = tile.kv_end - tile.kv_begin;
    if (part > 0 && num_keys > part) {
      tile.num_parts = int((num_keys + part - 1) / part);
      tile.part_scratch = part_floats;
      part_floats += tile.num_parts * part_scratch_floats(rows, a.head_dim);
    }
    const int step = tile.num_parts > 1 ? int(part) : num_keys;
    for (int p = 0; p < tile.num_parts; ++p) {
      const int kv_begin = tile.kv_begin + p * step;
      const int kv_end = std::min(tile.kv_end, kv_begin + step);
      items.push_back(WorkItem{t, p, kv_begin, kv_end});
      cost.push_back(int64_t(rows) * (kv_end - kv_begin));
    }
  }
  // Longest first: OpenMP's dynamic schedule then balances the short ones at the end.
  std::vector<int> order(items.size());
  for (int i = 0; i < int(order.size()); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return cost[x] > cost[y]; });
  std::vector<WorkItem> sorted(items.size());
  for (int i = 0; i < int(order.size()); ++i) sorted[i] = items[order[i]];

  thread_local std::vector<float> scratch_buffer, part_buffer;
  float* scratch = thread_buffer(scratch_buffer,
                                 num_threads * thread_scratch_floats(max_rows, a.head_dim));
  float* part_scratch = thread_buffer(part_buffer, std::max<int64_t>(part_floats, 1));

  const int num_tiles = int(tiles.size()), num_items = int(sorted.size());
  switch (chosen) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    case Isa::kAvx2:
      avx2::paged_attention(a, tiles.data(), num_tiles, sorted.data(), num_items, max_rows,
                            scratch, part_scratch, num_threads);
      break;
    case Isa::kAvx512:
      avx512::paged_attention(a, tiles.data(), num_tiles, sorted.data(), num_items, max_rows,
                              scratch, part_scratch, num_threads);
      break;
    case Isa::kAvx512Bf16:
      avx512bf16::paged_attention(a, tiles.data(), num_tiles, sorted.data(), num_items, max_rows,
                                  scratch, part_scratch, num_threads);
      break;
#endif
    default:
      TORCH_CHECK(false, "octavo_cpu: no kernels for instruction set ", isa_name(chosen));
  }
  return out;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (Isa isa : supported()) names.emplace_back(isa_name(isa));
  return names;
}

}  // namespace
}  // namespace octavo_cpu

TORCH_LIBRARY(octavo_cpu, m) {
  m.def("supported_isas() -> str[]", &octavo_cpu::supported_isas);
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()",
        &octavo_cpu::write_kv_cache);
  m.def("paged_attention(Tensor query, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_tables, float scale, str isa, int part_size, int sliding_window, "
        "float soft_cap) -> Tensor",
        &octavo_cpu::paged_attention);
}
