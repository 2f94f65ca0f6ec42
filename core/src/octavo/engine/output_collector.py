"""``RequestOutputCollector``: where one request's outputs wait for whoever streams them.

The output loop puts every step's output for a request here; the request's consumer (an HTTP
handler, an ``async for`` over ``AsyncLLM.generate``) takes what is there. When the consumer
falls behind the engine, outputs pile up; rather than a queue that hands them over one by one,
the collector keeps **one** pending output:

- ``DELTA`` outputs merge (texts and token ids concatenated, logprobs appended, the newer
  finish state kept), so a consumer that was busy for k steps gets one output covering all k,
  and pays its per-output cost (an SSE event, a socket write, a task wake-up) once. Under
  load this is what keeps the server's work per token flat as the number of streams grows.
- ``CUMULATIVE`` and ``FINAL_ONLY`` outputs are whole snapshots: the newer one replaces the
  older.
- An exception (engine dead, request refused, shutdown) replaces whatever is pending and stays:
  the stream ends with it.

All on one asyncio event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio

from octavo.outputs import CompletionOutput, RequestOutput

Item = RequestOutput | BaseException


class RequestOutputCollector:
    """One request's pending output (at most one), merged or replaced as described above."""

    __slots__ = ("_merge_deltas", "_pending", "_ready")

    def __init__(self, merge_deltas: bool) -> None:
        """:param merge_deltas: the request's outputs are deltas (``RequestOutputKind.DELTA``)."""
        self._merge_deltas = merge_deltas
        self._pending: Item | None = None
        # Set while something is pending (awaited by get()).
        self._ready = asyncio.Event()

    def put(self, item: Item) -> None:
        """Hand over an output or an exception (never blocks)."""
        pending = self._pending
        if pending is None or isinstance(item, BaseException):
            self._pending = item
        elif isinstance(pending, BaseException):
            return  # the stream ends with the error already pending
        elif self._merge_deltas:
            self._pending = merge_delta_outputs(pending, item)
        else:
            self._pending = item
        self._ready.set()

    # Kept under the asyncio.Queue name its callers used.
    put_nowait = put

    def get_nowait(self) -> Item | None:
        """What is pending (None: nothing), now."""
        item = self._pending
        if item is not None:
            self._pending = None
            self._ready.clear()
        return item

    async def get(self) -> Item:
        """What is pending, waiting for it if need be."""
        while self._pending is None:
            await self._ready.wait()
        item = self._pending
        self._pending = None
        self._ready.clear()
        return item


def merge_delta_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One delta equal to ``older`` followed by ``newer`` (same request; ``older`` is changed
    in place and returned: its lists are its own, made for it by the output processor)."""
    if len(older.outputs) == 1 and len(newer.outputs) == 1 and (
            older.outputs[0].index == newer.outputs[0].index):
        _append(older.outputs[0], newer.outputs[0])  # n = 1: the common case, no lookups
    else:
        by_index = {c.index: c for c in older.outputs}
        for completion in newer.outputs:
            earlier = by_index.get(completion.index)
            if earlier is None:
                by_index[completion.index] = completion
            else:
                _append(earlier, completion)
        if len(by_index) != len(older.outputs):
            older.outputs = [by_index[i] for i in sorted(by_index)]
    if older.prompt_logprobs is None:
        older.prompt_logprobs = newer.prompt_logprobs  # sent once, with the first delta
    older.finished = newer.finished
    older.metrics = newer.metrics
    return older


def _append(earlier: CompletionOutput, later: CompletionOutput) -> None:
    earlier.text += later.text
    earlier.token_ids.extend(later.token_ids)
    if later.logprobs is not None:
        if earlier.logprobs is None:
            earlier.logprobs = list(later.logprobs)
        else:
            earlier.logprobs.extend(later.logprobs)
    earlier.cumulative_logprob = later.cumulative_logprob
    earlier.finish_reason = later.finish_reason
    earlier.stop_reason = later.stop_reason
