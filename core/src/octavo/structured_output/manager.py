"""``StructuredOutputManager``: the engine core's grammars, one matcher per constrained request.

Lifecycle of a constrained request in the engine core (``octavo.engine_core.core``):

1. ``submit``: its grammar is compiled on a background thread (llguidance releases the GIL
   while it builds a grammar), so one slow schema never stalls the steps of other requests.
   Compiled grammars are cached by their text: a request whose constraint was seen before gets
   a copy of the cached matcher, which costs microseconds.
2. ``take_ready``: once compiled, the request is handed to the scheduler.
3. Every step it samples in, ``bitmask`` gives its row of the token bitmask (bit ``t`` of the
   row set = token ``t`` may come next), filled for all constrained rows of the step in one
   call on llguidance's thread pool.
4. ``accept_step`` advances the matchers of all rows of a step with the tokens they sampled
   (``accept`` for one request). ``accept_and_bitmask_async`` does 4 then 3 on a background
   thread while the caller goes on (the engine core schedules the next step meanwhile).
5. ``remove`` when it finishes, is aborted or fails: nothing is kept.

With a reasoning parser, a request's grammar shapes its answer only: its tokens pass through a
``ReasoningGate`` first, its grammar consumes nothing while it thinks, and its row needs no
mask then (``needs_mask``; see ``octavo.structured_output.reasoning_gate``).

The tokenizer the grammars are compiled against (``GrammarTokenizer``) is built once on the
background thread (about a second for a 150k-token vocabulary), with the reasoning gate: at the
first ``submit``, or earlier with ``warm_up``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from octavo import envs
from octavo.messages import GrammarBitmask
from octavo.messages.shared_masks import SharedMasks
from octavo.sampling_params import StructuredOutputsParams
from octavo.structured_output.grammar import grammar_text, parser_limits
from octavo.structured_output.reasoning_gate import GateState, Phase, ReasoningGate
from octavo.structured_output.tokenizer import GrammarTokenizer

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (each holds its lexer tables: tens of kB to a few MB).
_CACHE_SIZE = 256


@dataclass(slots=True)
class AcceptedStep:
    """What ``accept_and_bitmask_async`` gives: ``accept_step``'s errors and the masks."""

    errors: dict[str, str]
    bitmask: GrammarBitmask
    # Seconds the grammar work itself took (accepting, then filling the masks), timed where
    # it ran: the caller's wait beyond it is hand-off latency.
    work_s: float = 0.0


class PendingAccept(Protocol):
    """A step's grammar work under way (``accept_and_bitmask_async``): ``result()`` waits
    for it and raises what it raised."""

    def result(self) -> AcceptedStep: ...


def needs_mask(phase: Phase | None, token_in_flight: bool) -> bool:
    """Whether a constrained request's next token needs a mask: it is not thinking (``phase``
    None: no reasoning parser), or its token still in flight may end the thinking."""
    return token_in_flight or phase is None or phase is not Phase.THINKING


def _consume(matcher: Any, token_ids: Sequence[int]) -> str | None:
    for token_id in token_ids:
        if matcher.is_stopped():
            # The grammar ended on the previous token (an EOS the model may not have sampled
            # yet cannot come after it): the request stops through its stop rules.
            break
        # consume_token is False exactly when the matcher is (now) in an error state.
        if not matcher.consume_token(token_id):
            return matcher.get_error() or f"token {token_id} is not allowed by the grammar"
    return None


@dataclass(slots=True)
class _Constrained:
    """A request's matcher and, with a reasoning parser, where it is in its output."""

    matcher: Any
    gate_state: GateState | None


@dataclass(slots=True)
class CompiledRequest:
    """A request whose grammar finished compiling: ``error`` is None when it compiled."""

    request_id: str
    error: str | None


class StructuredOutputManager:
    """See the module docstring. Not thread-safe: the engine core calls it from one thread."""

    def __init__(
        self,
        tokenizer_factory: Callable[[], GrammarTokenizer],
        vocab_size: int,
        num_threads: int | None = None,
        reasoning_parser: type[Any] | None = None,
        shared_masks: SharedMasks | None = None,
    ) -> None:
        """``tokenizer_factory`` returns the model's tokenizer as grammars use it (called
        once, on the compile thread); ``vocab_size`` is the model's (the logits' width, which
        may exceed the tokenizer's); ``reasoning_parser`` (a ``ReasoningParser`` class) makes
        constraints start after the reasoning; ``shared_masks`` (owned from here on): where
        steps' masks are filled, its two buffers in turn, so that worker processes mapping
        them read the rows in place (a step of more rows than they hold gets new memory);
        None: new memory every step. A bitmask is valid until the step after the next one."""
        self.shared_masks = shared_masks
        self._next_buffer = 0
        self._tokenizer_factory = tokenizer_factory
        self._reasoning_parser = reasoning_parser
        self._gate: ReasoningGate | None = None
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._num_threads = num_threads or envs.grammar_threads()
        self._compiler = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="octavo-grammar")
        self._compiling: dict[str, concurrent.futures.Future[_Constrained]] = {}
        self._matchers: dict[str, _Constrained] = {}
        # Guarded by _lock: the compile thread fills it, the engine thread never touches it.
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._tokenizer: Any = None
        self._executor: Any = None
        self._filler: concurrent.futures.ThreadPoolExecutor | None = None
        self._accept_parallel = envs.grammar_accept() == "parallel"

    # ---- lifecycle -----------------------------------------------------------------------

    def submit(self, request_id: str, params: StructuredOutputsParams,
               prompt_token_ids: Sequence[int] = (),
               on_done: Callable[[], None] | None = None) -> None:
        """Start compiling ``request_id``'s grammar; ``take_ready`` returns it when done. The
        prompt tells the reasoning gate whether the output starts inside a think block.
        ``on_done`` is called on the compile thread once the compilation ends (it must only
        wake the caller's thread: the manager is not thread-safe)."""
        future = self._compiler.submit(self._compile, params, list(prompt_token_ids))
        if on_done is not None:
            future.add_done_callback(lambda _: on_done())
        self._compiling[request_id] = future

    def warm_up(self) -> None:
        """Build the tokenizer grammars compile against now, on the compile thread (without
        waiting), so the first constraint waits only for its own compilation; a failure is
        left for that compilation to report."""
        self._compiler.submit(self._llg_tokenizer)

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    @property
    def num_active(self) -> int:
        """Requests holding a matcher or a compilation (0 once every request is done)."""
        return len(self._matchers) + len(self._compiling)

    def wait(self, timeout_s: float, for_all: bool = False) -> None:
        """Block until a compilation finishes (every one, with ``for_all``) or ``timeout_s``
        passes."""
        if self._compiling:
            return_when = (concurrent.futures.ALL_COMPLETED if for_all
                           else concurrent.futures.FIRST_COMPLETED)
            concurrent.futures.wait(list(self._compiling.values()), timeout=timeout_s,
                                    return_when=return_when)

    def take_ready(self) -> list[CompiledRequest]:
        """Requests whose compilation finished since the last call."""
        ready = []
        for request_id, future in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                self._matchers[request_id] = future.result()
                ready.append(CompiledRequest(request_id, None))
            except Exception as exc:  # noqa: BLE001 - reported on the request, never raised
                logger.error("request %s: its grammar did not compile: %s", request_id, exc)
                ready.append(CompiledRequest(request_id, str(exc)))
        return ready

    def remove(self, request_id: str) -> None:
        """Forget ``request_id`` (finished, aborted, failed); a compilation still running is
        left to finish and dropped."""
        self._matchers.pop(request_id, None)
        future = self._compiling.pop(request_id, None)
        if future is not None:
            future.cancel()

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._matchers

    @property
    def constrained_ids(self) -> AbstractSet[str]:
        """The constrained requests (a live, read-only view: ``req_id in`` it is
        ``is_constrained``, without a call per request in the per-step loops)."""
        return self._matchers.keys()

    @property
    def gates_reasoning(self) -> bool:
        """Whether constraints start after a reasoning parser's thinking: only then may a
        constrained request's row need no mask (``needs_mask``)."""
        return self._reasoning_parser is not None

    def needs_mask(self, request_id: str, token_in_flight: bool) -> bool:
        """Whether ``request_id``'s next sampled token needs a mask: it is constrained and
        not thinking, or (``token_in_flight``: its previous token is not recorded yet) that
        token may end the thinking. Call only while no grammar-thread work is pending."""
        entry = self._matchers.get(request_id)
        if entry is None:
            return False
        return needs_mask(None if entry.gate_state is None else entry.gate_state.phase,
                          token_in_flight)

    def shutdown(self) -> None:
        self._compiler.shutdown(wait=False, cancel_futures=True)
        if self._filler is not None:
            self._filler.shutdown(wait=True)
        self._compiling.clear()
        self._matchers.clear()
        if self.shared_masks is not None:
            self.shared_masks.close()

    # ---- per step ------------------------------------------------------------------------

    def accept(self, request_id: str, token_ids: list[int]) -> str | None:
        """Advance ``request_id``'s matcher with the tokens it sampled; the matcher's error
        when one was not allowed (the request must then end), else None."""
        entry = self._matchers.get(request_id)
        if entry is None:
            return None
        return _consume(entry.matcher, self._answer_tokens(entry, token_ids))

    def accept_step(self, sampled: Mapping[str, Sequence[int]],
                    parallel: bool = False) -> dict[str, str]:
        """``accept`` for every request of a step: the matcher's error of each request that
        sampled a token its grammar refuses (those requests must end); requests without a
        matcher are skipped. ``parallel``: through llguidance's thread pool, the GIL released
        (see ``_advance``)."""
        return self._advance(self._advances(sampled.items()), parallel=parallel)

    def accept_sampled(self, req_ids: Sequence[str], token_ids: Sequence[Sequence[int]],
                       parallel: bool = False) -> dict[str, str]:
        """``accept_step`` for a step's tokens as the runner gives them: ``token_ids[i]``
        sampled by ``req_ids[i]``, requests without a matcher among them (skipped)."""
        return self._advance(self._advances(zip(req_ids, token_ids, strict=True)),
                             parallel=parallel)

    def bitmask(self, request_ids: list[str]) -> GrammarBitmask:
        """The token bitmask of ``request_ids`` (one row each, in order). A request without a
        matcher (it finished while its step was in flight: what it samples is thrown away) or
        still thinking gets a row allowing everything; one that may start thinking gets its
        grammar's row plus the start tag."""
        bitmask, rows = self._target(list(request_ids))
        self._fill(bitmask.req_ids, self._row_matchers(request_ids), rows)
        return bitmask

    def bitmask_into(self, request_ids: list[str], out: np.ndarray) -> None:
        """``bitmask`` written into ``out`` (int32, ``[len(request_ids), num_words]``, e.g. a
        view of shared memory) instead of a new buffer."""
        self._fill(list(request_ids), self._row_matchers(request_ids), out)

    def phase(self, request_id: str) -> Phase | None:
        """Where a request is in its output with a reasoning parser (None without one, or
        for a request without a matcher)."""
        entry = self._matchers.get(request_id)
        return None if entry is None or entry.gate_state is None else entry.gate_state.phase

    def accept_and_bitmask_async(
        self, req_ids: Sequence[str], token_ids: Sequence[Sequence[int]],
        request_ids: list[str]
    ) -> PendingAccept:
        """``accept_sampled(req_ids, token_ids)`` then ``bitmask(request_ids)`` on a
        background thread (llguidance releases the GIL while it fills masks), so the caller
        can go on with other work. No matcher may be used elsewhere until the future is done;
        removing requests is fine. ``req_ids`` may hold requests without a matcher (skipped);
        both are read before this returns: the constrained rows' tokens are copied for that
        thread."""
        if self._filler is None:
            self._filler = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="octavo-grammar-masks")
        self._mask_executor()  # created here, never on two threads at once
        advances = self._advances(zip(req_ids, token_ids, strict=True))
        entries = self._row_matchers(request_ids)
        request_ids = list(request_ids)
        bitmask, rows = self._target(request_ids)  # here: buffers are taken in call order

        def run() -> AcceptedStep:
            start = time.perf_counter()
            errors = self._advance(advances, parallel=self._accept_parallel)
            self._fill(request_ids, entries, rows)
            return AcceptedStep(errors, bitmask, time.perf_counter() - start)

        return self._filler.submit(run)

    def _advances(
        self, sampled: Iterable[tuple[str, Sequence[int]]]
    ) -> list[tuple[str, _Constrained, Sequence[int]]]:
        # Copies: the grammar thread may read them after the caller reuses its lists.
        matchers = self._matchers
        return [(request_id, entry, list(token_ids))
                for request_id, token_ids in sampled
                if token_ids and (entry := matchers.get(request_id)) is not None]

    def _answer_tokens(self, entry: _Constrained, token_ids: Sequence[int]) -> Sequence[int]:
        """The tokens ``entry``'s grammar consumes: those after its reasoning ended."""
        if entry.gate_state is None or entry.gate_state.phase is Phase.ANSWERING:
            return token_ids
        assert self._gate is not None
        return self._gate.advance(entry.gate_state, token_ids)

    def _advance(self, advances: list[tuple[str, _Constrained, Sequence[int]]],
                 parallel: bool) -> dict[str, str]:
        # With ``parallel`` (OCTAVO_GRAMMAR_ACCEPT, the default; on the grammar thread only),
        # rows with one answer token go to llguidance's consume_token_par, which releases the
        # GIL for the whole call, where the loop's consume_token calls hold it against the
        # engine thread's Python. Rows still passing the reasoning gate, or with several
        # tokens, keep the loop (the gate filters their tokens). On the H100 the parallel call
        # gave the best constrained throughput (0.56-0.62x of unconstrained against 0.45-0.54x
        # with the loop), though on two busy cores it took 2-7 ms against the loop's 1.1 ms
        # (docs/benchmarks.md, fourth and sixth rounds).
        errors: dict[str, str] = {}
        # The rows for consume_token_par, and their request ids (same order).
        pairs: list[tuple[Any, int]] = []
        pair_ids: list[str] = []
        for request_id, entry, sampled_ids in advances:
            gate_state = entry.gate_state
            if (parallel and len(sampled_ids) == 1
                    and (gate_state is None or gate_state.phase is Phase.ANSWERING)):
                if not entry.matcher.is_stopped():
                    pairs.append((entry.matcher, sampled_ids[0]))
                    pair_ids.append(request_id)
                continue
            token_ids = self._answer_tokens(entry, sampled_ids)
            if token_ids:
                error = _consume(entry.matcher, token_ids)
                if error is not None:
                    errors[request_id] = error
        if pairs:
            accepted = self._mask_executor().consume_token_par(pairs)
            if not all(accepted):
                for request_id, (matcher, token_id), ok in zip(pair_ids, pairs, accepted,
                                                               strict=True):
                    if not ok:
                        errors[request_id] = (matcher.get_error() or
                                              f"token {token_id} is not allowed by the grammar")
        return errors

    def _row_matchers(self, request_ids: list[str]) -> list[tuple[_Constrained, int]]:
        matchers = self._matchers
        return [(entry, row) for row, request_id in enumerate(request_ids)
                if (entry := matchers.get(request_id)) is not None]

    def _target(self, request_ids: list[str]) -> tuple[GrammarBitmask, np.ndarray]:
        """A bitmask of ``request_ids`` to be filled, and its rows as an int32 array: the
        next of the shared buffers when they hold the rows, else new memory."""
        masks = self.shared_masks
        if masks is None or not request_ids or len(request_ids) > masks.max_rows:
            return self._new_bitmask(request_ids)
        buffer, self._next_buffer = self._next_buffer, self._next_buffer ^ 1
        return masks.bitmask(buffer, request_ids), masks.array[buffer, :len(request_ids)]

    def _new_bitmask(self, request_ids: list[str]) -> tuple[GrammarBitmask, np.ndarray]:
        """A bitmask of ``request_ids`` to be filled, and its rows as an int32 array."""
        data = bytearray(len(request_ids) * self.num_words * 4)
        rows = np.frombuffer(data, dtype=np.int32).reshape(len(request_ids), self.num_words)
        return GrammarBitmask(req_ids=request_ids, num_words=self.num_words,
                              data=memoryview(data)), rows

    def _fill(self, request_ids: list[str], entries: list[tuple[_Constrained, int]],
              rows: np.ndarray) -> None:
        """Write the rows of ``request_ids`` into ``rows`` (int32 ``[len, num_words]``; a
        bytearray's view, so the GrammarBitmask carries these very bytes: no copy here, nor in
        the runner, of about 1.5 MB per step for 256 rows of a 49k vocabulary)."""
        # llguidance.numpy, not llguidance.torch: importing the latter imports torch._dynamo
        # (seconds, on the engine thread, at the first constrained step).
        import llguidance.numpy as llg_numpy

        if self._reasoning_parser is None:
            pairs = [(entry.matcher, row) for entry, row in entries]
            may_think: list[int] = []
        else:
            # Phases are read here, after the tokens of the step before were accepted.
            pairs = [(entry.matcher, row) for entry, row in entries
                     if entry.gate_state is None or entry.gate_state.phase is not Phase.THINKING]
            may_think = [row for entry, row in entries
                         if entry.gate_state is not None
                         and entry.gate_state.phase is Phase.MAY_THINK]
        # llguidance writes whole rows: only the others are set to allow everything (one pass
        # over 1.5 MB less per step when every row has a grammar's mask).
        if len(pairs) < len(request_ids):
            free = np.ones(len(request_ids), dtype=bool)
            free[[row for _, row in pairs]] = False
            rows[free] = -1
        if pairs:
            llg_numpy.fill_next_token_bitmask_par(self._mask_executor(), pairs, rows)
        if may_think:
            assert self._gate is not None and self._gate.start_token_id is not None
            word, bit = divmod(self._gate.start_token_id, 32)
            rows.view(np.uint32)[may_think, word] |= np.uint32(1 << bit)

    # ---- compile thread ------------------------------------------------------------------

    def _compile(self, params: StructuredOutputsParams,
                 prompt_token_ids: list[int]) -> _Constrained:
        tokenizer = self._llg_tokenizer()
        gate_state = (None if self._gate is None
                      else self._gate.initial_state(prompt_token_ids))
        return _Constrained(self._compiled_matcher(tokenizer, params), gate_state)

    def _compiled_matcher(self, tokenizer: Any, params: StructuredOutputsParams) -> Any:
        import llguidance

        grammar = grammar_text(params)
        with self._lock:
            cached = self._cache.get(grammar)
            if cached is not None:
                self._cache.move_to_end(grammar)
                return cached.deep_copy()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        with self._lock:
            self._cache[grammar] = matcher
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher.deep_copy()

    def _llg_tokenizer(self) -> Any:
        """The llguidance tokenizer (and the reasoning gate), built on first use."""
        if self._tokenizer is None:
            grammar_tokenizer = self._tokenizer_factory()
            if self._reasoning_parser is not None:
                codec = grammar_tokenizer.text_codec()
                self._gate = ReasoningGate(self._reasoning_parser(codec), codec)
                logger.info("structured outputs: constraints apply after the reasoning (%s)",
                            self._reasoning_parser.name)
            self._tokenizer = grammar_tokenizer.llguidance_tokenizer(self.vocab_size)
            logger.debug("structured outputs: grammars compile against a %d-token vocabulary",
                        self.vocab_size)
        return self._tokenizer

    def _mask_executor(self) -> Any:
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(num_threads=self._num_threads)
        return self._executor
