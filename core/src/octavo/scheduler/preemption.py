"""Which way a preempted request gets its KV back: recomputed, or swapped to host memory.

With ``--preemption-mode recompute`` (the default) every preempted request is recomputed: its
blocks are freed and its prompt and generated tokens run again as one prompt when it resumes.
With ``--preemption-mode swap`` its blocks are copied to the host block pool (``--swap-space``)
and back when it resumes, except where recomputing is cheaper:

- a request with fewer than ``swap_threshold_tokens`` computed tokens, i.e. fewer than
  ``max(block_size, max_num_batched_tokens // 16)`` (128 with the defaults): recomputing them
  takes at most a sixteenth of one step's token budget, which runs beside the decodes of a
  memory-bound step at little cost, while a swap moves the blocks over the host link twice and
  holds host memory meanwhile;
- a request whose blocks do not fit the free host blocks.

A beam search is preempted as a whole (its beams need each other every step): swapped if all
its blocks fit the host pool and none of its beams has a step in flight, whatever its length
(recomputing means restarting the search), else restarted from its prompt.
"""

from __future__ import annotations


def swap_threshold_tokens(block_size: int, max_num_batched_tokens: int) -> int:
    """Fewest computed tokens for which a preempted request is swapped rather than recomputed
    (see the module docstring)."""
    return max(block_size, max_num_batched_tokens // 16)
