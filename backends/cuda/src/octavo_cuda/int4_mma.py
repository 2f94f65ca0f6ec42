"""Int4 (GPTQ/AWQ) GEMV for 1 to 8 rows on tensor cores: ``kernels/int4_mma_gemv.cu``.

The Triton ``int4_gemv`` does the arithmetic on the CUDA cores, about 3.3 SASS instructions a
weight, which is near an H100 SM's issue rate at its share of the memory bandwidth (~5 a
weight). This kernel unpacks two nibbles into a bfloat16 (or float16) pair with one LOP3
and lets ``mma.sync`` do the multiply-adds: 1.55-2.4 instructions a weight (its group loop,
compiled for sm_90), so it can stay memory-bound. It reads the weights as
``octavo.kernels.int4`` holds them: GPTQ's ``[K / 8, N]`` words, or the same words in
32-output panels ``[N / 32, K / 8, 32]``, float16 scales and zeros ``[G, N]``. The backend
asks for panels at load (``octavo_cuda.quant``): a block's words of a group are then one
contiguous run, not 128 bytes from each of 16 rows ``4N`` bytes apart. The other int4 kernels
read both layouts. The source's header says how the words become mma operands.

What it takes (``supports``): 1 to 8 rows of bfloat16 or float16 ``x``, natural-order groups
(no ``g_idx``) of 32, 64 or 128 inputs, ``N`` a multiple of 16, contiguous scales and zeros
on 8-byte boundaries, a GPU of compute capability 8.0 or more. Anything else stays on the
Triton kernel. Models reach it through the backend's ``octavo_quant_kernels``
(``octavo_cuda.quant``; ``OCTAVO_CUDA_INT4_MMA=0`` turns it off). At one row it can also
take the RMS norm before it (``int4_mma_gemv_add_rms_norm``, ``norm_supported``). Its GPU
tests are ``backends/cuda/tests/test_cuda_int4_mma.py``; CI compiles it and checks its SASS.

Reference: ``octavo.kernels.int4.int4_linear_reference``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources

import torch
from octavo.kernels.int4 import is_panels, word_shape
from octavo.kernels.skinny import m_bucket
from octavo.kernels.triton.skinny_gemm import SkinnyConfig, SkinnyTuner, tune_key

from octavo_cuda.nvrtc import load_kernel

MAX_ROWS = 8
# Most inputs of the fused norm's row, which every block holds in shared memory (16 KB) and
# its threads in registers; the kernel's NORM launches are compiled for their row's length
MAX_NORM_K = 8192
# A warp holds two groups' words in registers (``GROUP / 32`` chunks each): larger groups
# (or one group over all inputs) would spill
GROUP_SIZES = (32, 64, 128)
# Launch configs from a device table's "int4_mma_gemv" section, else the default
# (``TUNER.lookup``), never timed at start-up: those picks (one call at a time, L2 flushed)
# cost batch-1 8B int4 0.27 ms a token against the swept table on the H100; the default is
# what won every case of that sweep.
TUNER = SkinnyTuner("int4_mma_gemv")


@dataclass(frozen=True)
class MmaGemvConfig:
    """``vec`` words per load (outputs per block: 16 * vec), ``warps`` per block (they split
    the block's groups); under PDL the next kernel may launch once a block has waited for the
    kernel before (``early_trigger``) or once its sums are done."""

    vec: int = 1
    warps: int = 8
    early_trigger: bool = True

    def as_skinny(self) -> SkinnyConfig:
        """The same launch as the tuner and the tables spell configs: ``block_n`` outputs per
        block, ``num_warps``, ``early_trigger``."""
        return SkinnyConfig(block_n=16 * self.vec, block_k=32, num_warps=self.warps,
                            early_trigger=self.early_trigger)

    @classmethod
    def from_skinny(cls, config: SkinnyConfig) -> MmaGemvConfig:
        return cls(vec=config.block_n // 16, warps=config.num_warps,
                   early_trigger=config.early_trigger)


# The launch configs bench_int4_mma.py sweeps: those that fit the register file without spilling
# (the compile test checks it): with 16 warps a thread has 128 registers, too few for 16-byte
# loads (vec 4).
CANDIDATES = [MmaGemvConfig(v, w) for v in (1, 2, 4) for w in (4, 8, 16) if (v, w) != (4, 16)]


@functools.cache
def _source() -> str:
    return resources.files("octavo_cuda").joinpath("kernels/int4_mma_gemv.cu").read_text()


def operands_supported(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       zeros: torch.Tensor, group_size: int,
                       g_idx: torch.Tensor | None) -> bool:
    """Whether the kernel takes these operands (rows, dtypes, grouping, sizes), wherever they
    are."""
    n = word_shape(qweight)[1]
    return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS  # first: prefill calls stop here
            and x.dtype in (torch.bfloat16, torch.float16) and g_idx is None
            and group_size in GROUP_SIZES and x.shape[1] % group_size == 0 and n % 16 == 0
            and scales.dtype == torch.float16 and zeros.dtype == torch.float16
            and _whole_rows(scales) and _whole_rows(zeros) and qweight.numel() < 2**31)


def _whole_rows(t: torch.Tensor) -> bool:
    """Scales and zeros are read as ``[G, N]`` contiguous, up to four float16 in one load."""
    return t.is_contiguous() and t.data_ptr() % 8 == 0


def supports(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
             zeros: torch.Tensor, group_size: int, g_idx: torch.Tensor | None) -> bool:
    """Whether ``int4_mma_gemv`` runs this call (else the caller's other kernel does): the
    operands, on an NVIDIA GPU of compute capability 8.0 or more (``mma.sync`` bf16)."""
    return (operands_supported(x, qweight, scales, zeros, group_size, g_idx) and x.is_cuda
            and _major(x.device.index) >= 8)


@functools.cache
def _major(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]


@functools.cache
def _sms(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_config(n: int, k: int, sms: int) -> MmaGemvConfig:
    """8-byte loads (32 outputs a block) and at most ~16 warps per SM in all (4 to 16 a block):
    what won every Llama-3-8B projection at 1 to 8 rows on the H100 (132 SMs; docs/benchmarks.md,
    "The tensor-core int4 GEMV on the H100"); 4-byte loads where N is not a multiple of 32."""
    vec = 2 if n % 32 == 0 else 1
    blocks = n // (16 * vec)
    warps = 16
    while warps > 4 and blocks * warps > 16 * sms:
        warps //= 2
    return MmaGemvConfig(vec=vec, warps=warps)


def chosen_config(n: int, k: int, m: int, dtype: torch.dtype, group_size: int,
                  device: torch.device) -> MmaGemvConfig:
    """The launch config of an ``[m, k] x [k, n]`` call: the device table's, else
    ``default_config`` (``TUNER``)."""
    return MmaGemvConfig.from_skinny(TUNER.lookup(
        tune_key(n=n, k=k, m=m_bucket(m), dtype=dtype, group=group_size), device,
        default_config(n, k, _sms(device.index)).as_skinny()))


def int4_mma_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                  zeros: torch.Tensor, group_size: int,
                  config: MmaGemvConfig | None = None) -> torch.Tensor:
    """``x @ W^T`` (``[M, N]`` in ``x``'s dtype) for a call ``supports`` accepts (``config``
    None: ``chosen_config``)."""
    if config is None:
        config = chosen_config(word_shape(qweight)[1], x.shape[1], x.shape[0], x.dtype,
                               group_size, x.device)
    return _launch(x, qweight, scales, zeros, group_size, config)


def norm_supported(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    """Whether ``int4_mma_gemv_add_rms_norm`` takes these norm operands (beyond what
    ``supports`` asks of ``x``): one row of at most ``MAX_NORM_K`` values, ``x``, the residual
    and the norm weight of one dtype, each contiguous on a 16-byte boundary."""
    k = x.shape[-1]
    return (x.dim() == 2 and x.shape[0] == 1 and k <= MAX_NORM_K
            and residual.shape == x.shape and norm_weight.shape == (k,)
            and residual.dtype == norm_weight.dtype == x.dtype
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0
                    for t in (x, residual, norm_weight)))


def int4_mma_gemv_add_rms_norm(x: torch.Tensor, residual: torch.Tensor,
                               norm_weight: torch.Tensor, eps: float, qweight: torch.Tensor,
                               scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                               config: MmaGemvConfig | None = None,
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * norm_weight @ W^T, x + residual)`` in one kernel: what
    ``fused_add_rms_norm`` and then ``int4_mma_gemv`` compute, rounded alike (the sum of
    squares is summed in another order: the outputs may differ in the last bit). For calls
    ``supports`` and ``norm_supported`` accept; ``config`` as ``int4_mma_gemv``'s."""
    if config is None:
        config = chosen_config(word_shape(qweight)[1], x.shape[1], 1, x.dtype, group_size,
                               x.device)
    new_residual = torch.empty_like(x)
    out = _launch(x, qweight, scales, zeros, group_size, config,
                  (residual, norm_weight, new_residual, float(eps)))
    return out, new_residual


def _launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            group_size: int, config: MmaGemvConfig,
            norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None,
            ) -> torch.Tensor:
    m, k = x.shape
    n = word_shape(qweight)[1]
    if n % (16 * config.vec):
        raise ValueError(f"int4_mma_gemv: N={n} is not a multiple of {16 * config.vec}")
    if norm is None and not (x.stride(1) == 1 and x.stride(0) % 8 == 0
                             and x.data_ptr() % 16 == 0):
        # rows of x are read in 16-byte vectors: a fresh, aligned copy
        x = torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    kernel = load_kernel(_source(), "int4_mma_gemv",
                         {"VEC": config.vec, "WARPS": config.warps, "GROUP": group_size,
                          "BF16": int(x.dtype == torch.bfloat16),
                          "PANELS": int(is_panels(qweight)),
                          "EARLY_TRIGGER": int(config.early_trigger),
                          **({"NORM": 1, "NORM_K": k} if norm is not None
                             else {})},
                         x.device)
    pdl = _major(x.device.index) >= 9
    # without the norm its operands are not read: any pointers do
    residual, norm_weight, new_residual, eps = norm if norm is not None else (out, out, out, 0.0)
    kernel.launch((n // (16 * config.vec), 1, 1), (32 * config.warps, 1, 1),
                  [x, qweight, scales, zeros, out, m, n, k, x.stride(0), residual, norm_weight,
                   new_residual, eps], pdl=pdl)
    return out
