"""The ROCm backend's attention: the portable Triton kernels with AMD launch parameters.

The kernels are the core's (``octavo.kernels.triton``), unchanged; only the launch parameters
differ from the CUDA backend. They were chosen for CDNA3 (MI300X / MI300A, ``gfx942``) from
the hardware's published figures and AMD's own Triton attention settings, and have NOT been
measured on AMD hardware yet (docs/rocm.md). The figures they rest on:

- a wavefront is 64 lanes (NVIDIA's warp is 32), and Triton's ``num_warps`` counts
  wavefronts on AMD, so the same ``num_warps`` means twice the threads;
- a CU has 4 SIMDs and 64 KB of LDS (shared memory); an H100 SM has 228 KB;
- MI300X has 304 CUs (H100: 132 SMs), so a grid needs more programs to fill the device;
- the matrix cores (MFMA) take 16-bit tiles of at least 16 x 16, which the kernels' own
  minimum (tile sides >= 16, powers of two) already guarantees.

Consumer RDNA GPUs (wave32) run the same kernels correctly with these settings; they are
just not tuned for them.
"""

from __future__ import annotations

from octavo.config import CacheConfig, ModelConfig
from octavo.kernels.triton import TritonAttentionBackend, TritonLaunchConfig

ROCM_LAUNCH_CONFIG = TritonLaunchConfig(
    # Prefill tile rows (query tokens x padded query-head group). 64, as on NVIDIA, rather
    # than the 128 of AMD's large-batch flash-attention configs: with 304 CUs, 128-row tiles
    # halve the number of programs of a prompt and leave CUs idle on chunked-prefill chunks
    # and short prompts, both common in serving.
    prefill_block_m=64,
    # Keys per prefill loop step. 64 still fits LDS with a single stage (below): K and V
    # tiles of 64 x 128 16-bit values are 16 KB each, 32 KB of the CU's 64 KB. The kernel
    # halves it by itself for head dims above 128.
    prefill_block_n=64,
    # 4 wavefronts = 256 threads: one wavefront per SIMD of the CU, each owning 16 of the 64
    # tile rows (one 16 x 16 MFMA row block). Same count as on NVIDIA, twice the threads,
    # and the count AMD's Triton flash-attention configs use for 64- and 128-row tiles.
    prefill_num_warps=4,
    # One stage: no software pipelining of the K/V loads. The loop holds two dots (QK^T,
    # PV); deeper pipelines keep more K/V tiles in flight in LDS and registers, which 64 KB
    # of LDS does not afford at head dim 128 (two stages of K and V would need all 64 KB),
    # and AMD's Triton flash-attention kernels use num_stages=1 on CDNA for the same loop.
    prefill_num_stages=1,
    # Keys per decode loop step: 32 instead of 64 ("smaller decode tiles"). Decode is
    # memory-bound (16 padded query rows against each K/V tile), so what helps is more
    # programs resident per CU to hide HBM latency; halving the K/V tiles halves their
    # registers/LDS. Contiguity is not lost: a cache block (default 16 tokens) is the
    # longest contiguous run either way. With 2 wavefronts (below), the 16 x 32 score tile
    # is exactly one 16 x 16 MFMA block per wavefront.
    decode_block_n=32,
    # Keys per flash-decoding partition: 256 instead of 512, to double the programs of long
    # contexts. The decode grid is sequences x KV heads x partitions; e.g. 8 sequences x 8 KV
    # heads at 2K tokens make 256 programs with 512-key partitions, fewer than MI300X's 304
    # CUs, and 512 with 256-key ones. The cost: contexts of 257..512 tokens now take the
    # second (reduce) launch. A multiple of decode_block_n, as the kernels require.
    decode_partition_size=256,
    # Wide batches are not split into spans: that setting was measured on an H100 only
    # (docs/benchmarks.md), and with 304 CUs the crossover is unknown.
    decode_wide_batch_span=None,
    # 2 wavefronts = 128 threads, the thread count of NVIDIA's 4 warps. The 16 x 32 score
    # tile is two 16 x 16 MFMA blocks, one per wavefront; 4 wavefronts would leave half of
    # them without a block of their own, and fewer threads per program let more programs
    # share a CU. Also used by the reduce kernel (up to 32 partitions x head dim per step).
    decode_num_warps=2,
    # One stage, for the same LDS reason and AMD guidance as prefill (two dots per step).
    decode_num_stages=1,
    # One program per token copies num_kv_heads x head_dim values of K and of V (e.g.
    # 8 x 128 = 1024). 2 wavefronts = 128 lanes -> 8 16-bit values = 16 bytes per lane,
    # AMD's widest (dwordx4) global load/store; 4 wavefronts would leave 8 bytes per lane.
    cache_write_num_warps=2,
    # Exact float32 dots. "tf32" is NVIDIA's format; gfx942 has a similar XF32 mode that
    # Triton can map it to, but not every AMD target has one, and fp32 runs exist to match
    # Hugging Face closely. 16-bit models are unaffected.
    fp32_dot_precision="ieee",
)


def make_attention_backend(
    model_config: ModelConfig, cache_config: CacheConfig
) -> TritonAttentionBackend:
    """The Triton attention backend with ``ROCM_LAUNCH_CONFIG`` (one config for every model)."""
    return TritonAttentionBackend(ROCM_LAUNCH_CONFIG)
