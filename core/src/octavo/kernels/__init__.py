"""Device kernels behind the attention interface (``octavo.attention``).

Each sub-package is one kernel family and imports its compiler only when it is imported itself:
``import octavo.kernels`` needs neither a GPU nor Triton.

- ``octavo.kernels.triton``: portable Triton paged-attention kernels (KV-cache write, prefill /
  extend attention, flash-decoding) and the ``"triton"`` attention backend built from them.
  Checked against ``octavo.attention.reference``; runs on CPU tensors under
  ``TRITON_INTERPRET=1`` for tests.
"""
