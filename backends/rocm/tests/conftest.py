"""The ROCm backend's tests share the kernel tests' set-up.

Importing ``tests.kernels.conftest`` sets ``TRITON_INTERPRET=1`` when no GPU is visible, before
any module here imports Triton (``triton.jit`` reads it when a kernel is defined), so the
portable kernels run on CPU tensors. On a ROCm machine a GPU is visible (torch calls HIP devices
"cuda") and the kernels are compiled for it instead.
"""

from __future__ import annotations

import tests.kernels.conftest  # noqa: F401  (sets TRITON_INTERPRET before Triton is imported)
