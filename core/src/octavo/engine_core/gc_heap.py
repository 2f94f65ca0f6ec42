"""Keeping the garbage collector's full collections off the engine loop.

At 256 running requests a step allocates about a thousand container objects (step messages,
outputs); every few hundred steps that makes Python run a full collection, which walks every
object the process holds: with torch, transformers and the model loaded, hundreds of thousands,
~0.2 s during which no step runs (0.8-1 ms per step on average at 256 requests on the CPU
machine; docs/benchmarks.md, "Host work per step"). ``freeze_startup_objects`` moves what
exists after start-up out of the collector's sight (``gc.freeze``), so full collections walk only
what was allocated since. vLLM's engine core does the same.

Only for a process the engine owns (the engine core's process, the API server, ``octavo
bench``): frozen objects are never freed by cycle collection, so in a caller's process (the
offline ``LLM`` in a notebook or a test session that builds many engines) reference cycles that
exist at that moment, an earlier engine's included, would stay in memory.
"""

from __future__ import annotations

import atexit
import gc


def freeze_startup_objects() -> None:
    """Collect once, then freeze every object left (see the module docstring); they are
    unfrozen at exit, so the interpreter's last collection still sees them (extension modules
    such as triton's nanobind bindings report objects never freed as leaks)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
