"""What the conformance suite checks for one backend, derived from its declared capabilities.

Only a few ``BackendCapabilities`` fields are read, each through ``getattr`` with a permissive
default, so a backend built against an older core (fewer fields) is still planned. Importing
this module is cheap (no torch).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# Dtypes the kit knows how to compare, most precise first.
from octavo.backends.backend import KNOWN_DTYPES, Backend

# Head sizes and block sizes tried first when a backend supports them.
PREFERRED_HEAD_DIMS = (64, 128)
PREFERRED_BLOCK_SIZE = 16
# Block size used when a backend accepts any: small, so short sequences span several blocks.
ANY_SMALL_BLOCK_SIZE = 4
# Engines of the suite never need more concurrent sequences than this.
MAX_NUM_SEQS = 16
# Top logprobs asked per generated token.
NUM_LOGPROBS = 5
# Context length of the suite's engines: its longest prompt plus completion is 61 tokens.
MAX_MODEL_LEN = 128


@dataclass(frozen=True, slots=True)
class ConformancePlan:
    """The configurations one backend is checked in."""

    # Name of the backend under test (what --device takes).
    backend: str
    # torch device type its tensors live on ("cpu", "cuda", ...).
    device_type: str
    # Dtypes the attention kernels are checked in: every declared one the kit knows.
    kernel_dtypes: tuple[str, ...]
    # Head sizes the attention kernels are checked with.
    kernel_head_dims: tuple[int, ...]
    # KV block sizes the attention kernels are checked with.
    kernel_block_sizes: tuple[int, ...]
    # Dtype of every end-to-end run: float32 when declared, else the best 16-bit one.
    model_dtype: str
    # Head size of the tiny models.
    model_head_dim: int
    # Block size of the end-to-end runs.
    block_size: int
    # Smallest supported block size: tight KV pools that force preemption use it.
    small_block_size: int
    # max_num_seqs and max_model_len of every engine the suite builds.
    max_num_seqs: int
    max_model_len: int
    # Whether the backend computes prompt logprobs (compared with HF when it does).
    prompt_logprobs: bool
    # Top logprobs asked per generated token.
    num_logprobs: int
    # Tensor-parallel sizes the engines are checked at (two ranks where the backend can run
    # them here: always on the host, with two visible GPUs on "cuda"; empty otherwise).
    tensor_parallel_sizes: tuple[int, ...] = ()

    @property
    def exact(self) -> bool:
        """float32 runs must give Hugging Face's greedy token ids exactly; 16-bit runs are
        compared within the dtype's tolerance instead."""
        return self.model_dtype == "float32"


def _pick(declared: Iterable[int] | None, preferred: Iterable[int], count: int) -> tuple[int, ...]:
    """Up to ``count`` values: the preferred ones that are declared, then the smallest declared."""
    if declared is None:
        return tuple(preferred)[:count]
    declared = sorted(set(declared))
    chosen = [v for v in preferred if v in declared]
    chosen += [v for v in declared if v not in chosen]
    return tuple(sorted(chosen[:count]))


def plan_for(backend: Backend) -> ConformancePlan:
    """The plan for ``backend``; raises ``ValueError`` when it declares no dtype the kit knows."""
    caps = backend.capabilities
    declared_dtypes = tuple(getattr(caps, "dtypes", None) or ("float32",))
    dtypes = tuple(d for d in KNOWN_DTYPES if d in declared_dtypes)
    if not dtypes:
        raise ValueError(
            f"backend {backend.name!r} declares dtypes {declared_dtypes}; the conformance suite "
            f"checks {KNOWN_DTYPES} and needs at least one of them"
        )
    head_dims = _pick(getattr(caps, "head_dims", None), PREFERRED_HEAD_DIMS, 2)
    model_head_dim = 64 if 64 in head_dims else head_dims[0]
    declared_blocks = getattr(caps, "block_sizes", None)
    if declared_blocks is None:
        small, block_size = ANY_SMALL_BLOCK_SIZE, PREFERRED_BLOCK_SIZE
    else:
        small = min(declared_blocks)
        block_size = PREFERRED_BLOCK_SIZE if PREFERRED_BLOCK_SIZE in declared_blocks else small
    max_num_seqs = getattr(caps, "max_num_seqs", None)
    max_model_len = getattr(caps, "max_model_len", None)
    max_logprobs = getattr(caps, "max_logprobs", None)
    return ConformancePlan(
        backend=backend.name,
        device_type=backend.device_type,
        kernel_dtypes=dtypes,
        kernel_head_dims=head_dims,
        kernel_block_sizes=tuple(sorted({small, block_size})),
        model_dtype=dtypes[0],
        model_head_dim=model_head_dim,
        block_size=block_size,
        small_block_size=small,
        max_num_seqs=min(MAX_NUM_SEQS, max_num_seqs or MAX_NUM_SEQS),
        max_model_len=min(MAX_MODEL_LEN, max_model_len or MAX_MODEL_LEN),
        prompt_logprobs=bool(getattr(caps, "prompt_logprobs", True)),
        num_logprobs=NUM_LOGPROBS if max_logprobs is None else min(NUM_LOGPROBS, max_logprobs),
        tensor_parallel_sizes=(2,) if _devices_here(backend.device_type) >= 2 else (),
    )


def _devices_here(device_type: str) -> int:
    """How many ranks of this device type can run on this machine (processes on the host)."""
    if device_type == "cpu":
        return 2
    if device_type == "cuda":
        import torch

        return torch.cuda.device_count()
    return 1  # a device type the kit cannot count: checked at one rank only
