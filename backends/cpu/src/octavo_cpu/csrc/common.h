// Shared declarations of the CPU paged-attention kernels: plain C++, no torch headers, so that
// the per-ISA translation units (attention_<isa>.cpp) never compile an inline torch or STL
// function with wider vector instructions than the machine may have (the linker keeps one copy
// of such a function, and it could be the AVX-512 one).
//
// KV-cache layout (octavo.attention.base): [2, num_blocks, block_size, num_kv_heads, head_dim],
// contiguous; token t of a sequence lives at block block_table[t / block_size], offset
// t % block_size. Only cache positions < seq_len are ever read, and with a sliding window W
// only positions >= (first new token's position) - W + 1: blocks before a sequence's window may
// belong to another request by now.
#pragma once

#include <cstddef>
#include <cstdint>

namespace octavo_cpu {

// 16-bit storage types, told apart by type (no arithmetic on them outside the vector loads).
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Key positions processed at once: scores of one chunk sit in a [rows, kChunk] float buffer,
// and the online softmax rescales the running output once per chunk.
constexpr int kChunk = 64;
// Head dims must be a multiple of this (one AVX-512 vector of float32); others use torch.
constexpr int kHeadDimMultiple = 16;

// One step's tensors and sizes, as raw pointers (the bindings in ops.cpp fill it).
struct AttentionArgs {
  DType dtype;
  // [num_tokens, num_heads, head_dim], last dim contiguous; strides in elements.
  const void* query;
  int64_t query_stride_token;
  int64_t query_stride_head;
  // The whole cache, contiguous; values start kv_half elements after keys.
  const void* kv_cache;
  int64_t kv_half;
  int block_size;
  int num_kv_heads;
  int head_dim;
  int num_heads;
  // [num_tokens, num_heads, head_dim] contiguous, same dtype as query.
  void* out;
  // [num_seqs + 1], [num_seqs], [num_seqs, block_table_stride] int32.
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  const int32_t* block_tables;
  int64_t block_table_stride;
  float scale;
  // Keys a token sees, itself included (0: every earlier position).
  int sliding_window;
  // Scores become soft_cap * tanh(scale * q.k / soft_cap) (0: no cap).
  float soft_cap;
};

// A run of consecutive query tokens of one sequence against one KV head: the rows of a tile
// are (token, query head of the group) pairs, token-major. Its keys may be split into parts.
// kv_head < 0: a head tile, against every KV head of the sequence at once (a decode step's few
// rows): its rows are those of each KV head in turn, head-major, and each chunk of the cache is
// read as whole token rows (all KV heads of a position are contiguous), not one head's slice
// of every row.
struct Tile {
  int seq;
  int kv_head;
  int query_begin;  // offset of the first token within the sequence's new tokens
  int query_end;    // exclusive
  int kv_begin;     // keys before kv_begin are invisible to the tile's first token (window)
  int kv_end;       // keys [kv_begin, kv_end) are visible to some token of the tile
  int num_parts;
  int64_t part_scratch;  // float offset of the parts' partial results (num_parts > 1)
};

// Keys [kv_begin, kv_end) of one tile: the unit of parallel work.
struct WorkItem {
  int tile;
  int part;
  int kv_begin;
  int kv_end;
};

// Scratch each thread needs, in floats, for tiles of up to max_rows rows.
inline int64_t thread_scratch_floats(int max_rows, int head_dim) {
  auto align = [](int64_t n) { return (n + 15) / 16 * 16; };  // 64-byte multiples
  return align(int64_t(max_rows) * head_dim)    // queries (float32, or bf16 for bf16 dots)
         + align(int64_t(max_rows) * kChunk)    // scores, then probabilities
         + align(int64_t(max_rows) * head_dim)  // running output
         + 4 * align(max_rows)  // running max, running sum, visible keys, first visible key
         + 2 * align(int64_t(kChunk) * head_dim)  // a chunk's keys and values, float32 rows
         + 6 * align(2 * kChunk);  // key and value row pointers: this chunk, the next, and
                                   // one KV head's rows of this chunk (head tiles)
}

// Floats one part of a split tile leaves for the combine pass: output rows, max, sum.
inline int64_t part_scratch_floats(int rows, int head_dim) {
  return int64_t(rows) * (head_dim + 2);
}

// One entry point per instruction set; each runs every work item and then combines the split
// tiles, on num_threads OpenMP threads. scratch: num_threads * thread_scratch_floats(...).
#define OCTAVO_DECLARE_ISA(isa)                                                               \
  namespace isa {                                                                             \
  void paged_attention(const AttentionArgs& args, const Tile* tiles, int num_tiles,           \
                       const WorkItem* items, int num_items, int max_rows, float* scratch,    \
                       float* part_scratch, int num_threads);                                 \
  }

OCTAVO_DECLARE_ISA(avx2)
OCTAVO_DECLARE_ISA(avx512)
OCTAVO_DECLARE_ISA(avx512bf16)

#undef OCTAVO_DECLARE_ISA

}  // namespace octavo_cpu
