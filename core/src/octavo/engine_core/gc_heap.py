"""Keeping the garbage collector's full collections off the engine loop.

At 256 running requests a step allocates about a thousand container objects (step messages,
outputs); every few hundred steps that makes Python run a full collection, which walks every
object the process holds: with torch, transformers and the model loaded, hundreds of thousands,
~0.2 s during which no step runs (0.8-1 ms per step on average at 256 requests on the CPU
machine; docs/benchmarks.md, "Host work per step"). ``freeze_startup_objects`` moves what
exists after start-up out of the collector's sight (``gc.freeze``), so full collections walk only
what was allocated since. vLLM's engine core does the same.

It also raises the collector's thresholds (``OCTAVO_GC_THRESHOLD``, default 50,000 / 20 /
100 against Python's 700 / 10 / 10). A served request allocates thousands of container
objects (its prompt list, the pydantic request, parameters, the response's per-chunk
objects); with hundreds in flight, a youngest-generation collection every 700 allocations
finds most of them alive and walks them again (a 512-token prompt list is 512 visits each
time), and promotes them into the next generation's more costly collections: 1.4-1.7 ms of
an API process's ~10 ms of CPU per streamed 128-token request on the CPU machine, 0.2-0.3 ms
with these thresholds (``benchmarks/cpu/gc_per_request.py``, docs/benchmarks.md). The price
is rarer, longer pauses (tens of ms with hundreds of requests in flight, as the full
collections the defaults also run) and cyclic garbage that lives longer before it is freed.

Only for a process the engine owns (the engine core's process, the API server, ``octavo
bench``): frozen objects are never freed by cycle collection, so in a caller's process (the
offline ``LLM`` in a notebook or a test session that builds many engines) reference cycles that
exist at that moment, an earlier engine's included, would stay in memory.
"""

from __future__ import annotations

import atexit
import gc

from octavo import envs


def freeze_startup_objects() -> None:
    """Collect once, then freeze every object left, and set the thresholds (see the module
    docstring); the objects are unfrozen at exit, so the interpreter's last collection still
    sees them (extension modules such as triton's nanobind bindings report objects never
    freed as leaks)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    gc.set_threshold(*envs.gc_threshold())
