"""What the portable Triton attention kernels (``octavo.kernels.triton``) support.

Importable without Triton or torch: backend plugins built on these kernels (cuda, rocm) list
these values in their ``BackendCapabilities`` at discovery time, when importing the kernels
would be too costly. ``octavo.kernels.triton.attention`` reads its head sizes from here.
"""

#: Head dimensions the kernels accept (non powers of two are padded inside the kernels).
TRITON_HEAD_DIMS = (64, 80, 96, 128, 256)
#: Model/KV-cache dtypes the kernels handle (float32 dots precision: TritonLaunchConfig).
TRITON_DTYPES = ("bfloat16", "float16", "float32")
