"""``GrammarProcess``: the engine core's grammars in a process of their own.

A constrained step's sampling waits for a chain of grammar work: every constrained request's
matcher advanced with the token it just sampled, then the next step's masks filled. On the
engine core's grammar thread that chain shares the GIL with the engine thread's Python
(recording the step, sending outputs, scheduling the next one): each of its GIL hand-offs
waits for the other thread, and the engine thread waits while the grammar thread holds it
(docs/benchmarks.md, "Structured outputs"). Here the same ``StructuredOutputManager`` runs in
a child process with a GIL of its own, and ``GrammarProcess`` gives the engine core the
manager's interface:

- the child is a fresh interpreter (not a multiprocessing spawn, which would run the
  caller's script again: offline scripts without a ``__main__`` guard would fail); its
  set-up (``_Setup``: the tokenizer as data, ``GrammarTokenizer``, loaded here) goes down its
  stdin, a pipe only it reads; it imports neither ``transformers`` nor torch;
- messages: msgpack (msgspec) over a duplex pipe, the set-up too; nothing is pickled;
- masks: the child writes them into ``SharedMasks`` (``octavo.messages.shared_masks``), a
  shared-memory file of two buffers of ``max_rows`` rows used in turn, and the engine core
  hands the runner a view of the rows (read before the buffer is filled again two steps
  later); the file has no name and reaches the child as an open descriptor, so nothing is
  left behind however either ends. Worker processes of the multiprocess executor map it too
  (``shared_masks``) and read a step's rows in place;
- compilations run on the child's compile thread, as in process; the child reports each one
  (``_Compiled``) when it ends;
- a step: ``_Step`` (the tokens to accept, the rows to fill, into which buffer) answered by
  ``_StepDone`` (the errors of refused tokens and, with a reasoning parser, each gated
  request's phase, for ``needs_mask``);
- removals are batched into the next message (a removed request is in no later step).

``warm_up`` (the engine core calls it as it starts, before the model loads) loads the tokenizer
on a thread of its own and starts the child, which builds its grammar tokenizer at once: the
first constraint then waits only for its compilation. Without it the first ``submit`` starts
it. The child exits when the engine core shuts it down or closes the pipe (it reads EOF when
the engine core dies). ``OCTAVO_GRAMMAR_PROCESS`` chooses this over
the in-process manager (``octavo.envs.grammar_process``).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from octavo import envs
from octavo.messages import GrammarBitmask
from octavo.messages.shared_masks import SharedMasks
from octavo.sampling_params import StructuredOutputsParams
from octavo.structured_output.manager import (
    AcceptedStep,
    CompiledRequest,
    StructuredOutputManager,
    needs_mask,
)
from octavo.structured_output.reasoning_gate import Phase
from octavo.structured_output.tokenizer import GrammarTokenizer

logger = logging.getLogger(__name__)

# How long shutdown waits for the child to exit before it is killed.
_EXIT_TIMEOUT_S = 5.0
# How long a step may take in the child (milliseconds, normally; llguidance bounds each mask's
# work) before the engine core gives up on it: a hung child must not hang the engine.
_STEP_TIMEOUT_S = 120.0


# ---- messages: engine core -> grammar process ---------------------------------------------


class _Setup(msgspec.Struct):
    """The child's arguments, the one message on its stdin."""

    tokenizer: GrammarTokenizer
    vocab_size: int
    max_rows: int
    # ``--reasoning-parser``'s name, or None.
    reasoning_parser: str | None
    # Advance a step's matchers through llguidance's pool (``OCTAVO_GRAMMAR_ACCEPT``).
    accept_parallel: bool


class _Submit(msgspec.Struct, tag="submit"):
    """Compile a request's grammar (``StructuredOutputManager.submit``)."""

    request_id: str
    # The request's constraint, as the front end validated it.
    params: StructuredOutputsParams
    # Its prompt: tells the reasoning gate whether the output starts inside a think block.
    prompt_token_ids: list[int]


class _Remove(msgspec.Struct, tag="remove"):
    """Forget these requests (finished, aborted or failed since the last message)."""

    request_ids: list[str]


class _Step(msgspec.Struct, tag="step"):
    """One step's grammar work, answered by ``_StepDone``."""

    # The tokens a step sampled, to advance the matchers with: ``accept_tokens[i]`` by
    # ``accept_ids[i]``, as the runner gives them (requests without a grammar are skipped
    # here rather than filtered on the engine thread; both may be empty).
    accept_ids: Sequence[str]
    accept_tokens: Sequence[Sequence[int]]
    # Then the requests whose rows to fill, in row order (None: accept only).
    rows: list[str] | None
    # Which of the two shared mask buffers the rows go into.
    buffer: int


class _Shutdown(msgspec.Struct, tag="shutdown"):
    """Stop: the child's manager shuts down and the process exits."""


_ToChild = _Submit | _Remove | _Step | _Shutdown


# ---- messages: grammar process -> engine core ---------------------------------------------


class _Compiled(msgspec.Struct, tag="compiled"):
    """A compilation ended (sent as soon as the child's compile thread finishes it)."""

    request_id: str
    # The grammar engine's message when it did not compile; None when it did.
    error: str | None
    # With a reasoning parser, the request's first phase (a ``Phase`` value); else None.
    phase: str | None


class _StepDone(msgspec.Struct, tag="done"):
    """A ``_Step`` is done: the masks are in their buffer."""

    # The requests whose sampled token the grammar refused, with the matcher's message.
    errors: dict[str, str]
    # With a reasoning parser, each accepting request's phase after the step (``Phase``
    # values); empty without one.
    phases: dict[str, str]
    # Seconds the child spent on the step (accepting, then filling the masks).
    work_s: float = 0.0


class _Failed(msgspec.Struct, tag="failed"):
    """The child hit an unexpected error and is exiting."""

    # The exception, as ``Type: message``.
    error: str


_FromChild = _Compiled | _StepDone | _Failed


class _PendingStep:
    """A step sent to the grammar process; ``result()`` waits for its answer (once)."""

    def __init__(self, owner: GrammarProcess, rows: list[str] | None, buffer: int) -> None:
        self._owner = owner
        self._rows = rows
        self._buffer = buffer
        self._result: AcceptedStep | None = None

    def result(self) -> AcceptedStep:
        if self._result is None:
            self._result = self._owner._finish_step(self._rows, self._buffer)
        return self._result


class GrammarProcess:
    """See the module docstring: ``StructuredOutputManager``'s interface, its work in a child
    process. Not thread-safe: the engine core calls it from one thread."""

    def __init__(
        self,
        tokenizer_loader: Callable[[], GrammarTokenizer],
        vocab_size: int,
        max_rows: int,
        reasoning_parser: str | None = None,
        accept_parallel: bool = True,
    ) -> None:
        """``tokenizer_loader`` is called once, here, on the thread that starts the child
        (``load_grammar_tokenizer``); ``max_rows`` bounds the rows of one step's masks (the
        scheduler's ``max_num_seqs``); ``reasoning_parser`` names one (``--reasoning-parser``);
        ``accept_parallel``: the child advances a step's matchers through llguidance's pool
        (``OCTAVO_GRAMMAR_ACCEPT``)."""
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        envs.grammar_cpus()  # a malformed OCTAVO_GRAMMAR_CPUS fails here, not in the child
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._max_rows = max_rows
        self._tokenizer_loader = tokenizer_loader
        self._reasoning_parser = reasoning_parser
        self._accept_parallel = accept_parallel
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(_FromChild)
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        # The masks the child fills; made here (its pages come as rows are written), so
        # that an executor can hand them to its workers before the child starts.
        self.shared_masks: SharedMasks = SharedMasks.create(max_rows, vocab_size)
        # Submitted, not reported compiled yet; reported, not taken yet (with the phase).
        self._compiling: set[str] = set()
        self._ready: list[tuple[CompiledRequest, Phase | None]] = []
        # Constrained requests (those taken ready) and their phase with a reasoning parser.
        self._phases: dict[str, Phase | None] = {}
        self._removed: list[str] = []
        self._done: _StepDone | None = None
        self._step_in_flight = False
        self._next_buffer = 0
        self._closed = False
        # The thread that loads the tokenizer and starts the child (warm_up or the first use),
        # and why that failed (then every constraint fails with it; nothing else does).
        self._starter: threading.Thread | None = None
        self._start_error: str | None = None
        self._spin_s = envs.grammar_spin_s()

    # ---- lifecycle (the manager's interface) ------------------------------------------------

    def submit(self, request_id: str, params: StructuredOutputsParams,
               prompt_token_ids: Sequence[int] = ()) -> None:
        """Start compiling ``request_id``'s grammar in the grammar process; ``take_ready``
        returns it when done (failed, when the grammar process could not start)."""
        self._started()
        if self._start_error is not None:
            self._ready.append((CompiledRequest(request_id, self._start_error), None))
            return
        self._compiling.add(request_id)
        self._send(_Submit(request_id, params, list(prompt_token_ids)))

    @property
    def num_compiling(self) -> int:
        return len(self._compiling) + len(self._ready)

    @property
    def num_active(self) -> int:
        """Requests holding a matcher or a compilation (0 once every request is done)."""
        return len(self._phases) + self.num_compiling

    def wait(self, timeout_s: float, for_all: bool = False) -> None:
        """Block until a compilation finishes (every one, with ``for_all``) or ``timeout_s``
        passes."""
        deadline = time.monotonic() + timeout_s
        while self._compiling and (for_all or not self._ready):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._read(remaining):
                return

    def take_ready(self) -> list[CompiledRequest]:
        """Requests whose compilation finished since the last call."""
        while self._conn is not None and self._read(0):
            pass
        ready, self._ready = self._ready, []
        for compiled, phase in ready:  # the grammar process logged those that failed
            if compiled.error is None:
                self._phases[compiled.request_id] = phase
        return [compiled for compiled, _ in ready]

    def remove(self, request_id: str) -> None:
        """Forget ``request_id`` (finished, aborted, failed), here at once and in the grammar
        process with the next message."""
        known = request_id in self._phases or request_id in self._compiling
        self._phases.pop(request_id, None)
        self._compiling.discard(request_id)
        if any(compiled.request_id == request_id for compiled, _ in self._ready):
            self._ready = [entry for entry in self._ready if entry[0].request_id != request_id]
            known = True
        if known:
            self._removed.append(request_id)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._phases

    @property
    def constrained_ids(self) -> Any:
        """The constrained requests (a live, read-only view, as the manager's)."""
        return self._phases.keys()

    @property
    def gates_reasoning(self) -> bool:
        return self._reasoning_parser is not None

    def needs_mask(self, request_id: str, token_in_flight: bool) -> bool:
        """As ``StructuredOutputManager.needs_mask``, from the phases the grammar process
        reported with its last step."""
        if request_id not in self._phases:
            return False
        return needs_mask(self._phases[request_id], token_in_flight)

    def shutdown(self) -> None:
        """Stop the grammar process (terminated if it does not exit within a few seconds)
        and release the shared masks. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._starter is not None:
            self._starter.join()
        self._compiling.clear()
        self._ready.clear()
        self._phases.clear()
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send_bytes(self._encoder.encode(_Shutdown()))
        if self._process is not None:
            try:
                self._process.wait(_EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("the grammar process did not exit; killing it")
                self._process.kill()
                self._process.wait()
        if self._conn is not None:
            self._conn.close()
        self.shared_masks.close()

    # ---- per step -------------------------------------------------------------------------

    def accept(self, request_id: str, token_ids: list[int]) -> str | None:
        """Advance ``request_id``'s matcher with the tokens it sampled; the matcher's error
        when one was not allowed, else None."""
        if request_id not in self._phases:
            return None
        return self.accept_step({request_id: token_ids}).get(request_id)

    def accept_step(self, sampled: Mapping[str, Sequence[int]]) -> dict[str, str]:
        """``accept`` for every request of a step (see the manager's)."""
        accept = self._accepted(sampled)
        if not accept:
            return {}
        self._send_step(list(accept), list(accept.values()), None)
        return _PendingStep(self, None, -1).result().errors

    def bitmask(self, request_ids: list[str]) -> GrammarBitmask:
        """The token bitmask of ``request_ids`` (see the manager's); its ``data`` is a view of
        the shared masks, valid until the step after the next one."""
        rows = list(request_ids)
        buffer = self._send_step([], [], rows)
        return _PendingStep(self, rows, buffer).result().bitmask

    def accept_and_bitmask_async(self, req_ids: Sequence[str],
                                 token_ids: Sequence[Sequence[int]],
                                 request_ids: list[str]) -> _PendingStep:
        """``accept_sampled(req_ids, token_ids)`` then ``bitmask(request_ids)`` in the
        grammar process while the caller goes on; ``result()`` of what it returns waits for
        them. One step at a time: its result must be taken before the next call of any
        per-step method. ``req_ids`` may hold requests without a grammar (the child skips
        them: sent as they are, not filtered here, where this is on the engine thread's path
        to the next step); everything is encoded before this returns."""
        rows = list(request_ids)
        return _PendingStep(self, rows, self._send_step(req_ids, token_ids, rows))

    def _accepted(self, sampled: Mapping[str, Sequence[int]]) -> dict[str, Sequence[int]]:
        # Encoded before the call returns: the caller's lists are not kept.
        phases = self._phases
        return {request_id: token_ids for request_id, token_ids in sampled.items()
                if token_ids and request_id in phases}

    def _send_step(self, accept_ids: Sequence[str], accept_tokens: Sequence[Sequence[int]],
                   rows: list[str] | None) -> int:
        if self._step_in_flight:
            raise RuntimeError("a grammar step is still in flight: take its result first")
        if rows is not None and len(rows) > self._max_rows:
            raise ValueError(f"{len(rows)} mask rows in one step, more than the "
                             f"{self._max_rows} the grammar process holds")
        self._started()
        if self._conn is None:
            raise RuntimeError(f"the grammar process is not running: {self._start_error}")
        buffer = self._next_buffer
        if rows is not None:
            self._next_buffer ^= 1
        self._send(_Step(accept_ids, accept_tokens, rows, buffer))
        self._step_in_flight = True
        return buffer

    def _finish_step(self, rows: list[str] | None, buffer: int) -> AcceptedStep:
        now = time.monotonic()
        deadline = now + _STEP_TIMEOUT_S
        spin_until = now + self._spin_s
        # The answer is due within a step's grammar work: poll without sleeping first (a
        # wake-up from poll() cost ~150 µs on the H200's host), then sleep until it comes.
        while self._done is None and time.monotonic() < spin_until:
            self._read(0)
        while self._done is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._read(remaining):
                raise RuntimeError(f"the grammar process did not answer a step within "
                                   f"{_STEP_TIMEOUT_S:.0f} s (pid "
                                   f"{None if self._process is None else self._process.pid})")
        done, self._done = self._done, None
        self._step_in_flight = False
        phases = self._phases
        for request_id, phase in done.phases.items():
            if request_id in phases:
                phases[request_id] = Phase(phase)
        if rows is None:
            return AcceptedStep(done.errors, GrammarBitmask(req_ids=[], num_words=self.num_words,
                                                            data=memoryview(b"")), done.work_s)
        return AcceptedStep(done.errors, self.shared_masks.bitmask(buffer, rows), done.work_s)

    # ---- the pipe -------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Load the tokenizer and start the grammar process on a thread of its own, without
        waiting (see the module docstring). Idempotent."""
        if self._starter is None and not self._closed:
            self._starter = threading.Thread(target=self._start, name="octavo-grammar-start",
                                             daemon=True)
            self._starter.start()

    def _started(self) -> None:
        """Wait for the start ``warm_up`` began (began here without it)."""
        if self._closed:
            raise RuntimeError("the grammar process was shut down")
        self.warm_up()
        assert self._starter is not None
        self._starter.join()

    def _start(self) -> None:
        """The starter thread: the tokenizer, the shared masks, the child. Nothing else
        touches this object's state until it ends (``_started`` joins it)."""
        try:
            grammar_tokenizer = self._tokenizer_loader()
            self._spawn(grammar_tokenizer)
        except Exception as exc:  # noqa: BLE001 - each constraint fails with it
            logger.error("structured outputs: the grammar process could not start: %s", exc)
            self._start_error = f"the grammar process could not start: {exc}"

    def _spawn(self, grammar_tokenizer: GrammarTokenizer) -> None:
        fd = self.shared_masks.fileno()
        parent_conn, child_conn = multiprocessing.Pipe(duplex=True)
        try:
            # A fresh interpreter, not a multiprocessing child: spawn would run the caller's
            # script again in it (every offline script would need a __main__ guard), fork
            # would copy the engine's threads and device state.
            command = [sys.executable, "-c",
                       "from octavo.structured_output.process import child_main; child_main()",
                       str(child_conn.fileno()), str(fd)]
            process = subprocess.Popen(command, stdin=subprocess.PIPE,
                                       pass_fds=[child_conn.fileno(), fd])
        except BaseException:
            parent_conn.close()
            raise
        finally:
            child_conn.close()
        assert process.stdin is not None
        setup = _Setup(grammar_tokenizer, self.vocab_size, self._max_rows,
                       self._reasoning_parser, self._accept_parallel)
        with process.stdin:
            process.stdin.write(self._encoder.encode(setup))
        self._process, self._conn = process, parent_conn
        logger.info("structured outputs: grammars in their own process (pid %d)", process.pid)

    def _send(self, message: _Submit | _Step) -> None:
        assert self._conn is not None
        try:
            if self._removed:
                removed, self._removed = self._removed, []
                self._conn.send_bytes(self._encoder.encode(_Remove(removed)))
            self._conn.send_bytes(self._encoder.encode(message))
        except OSError:
            raise self._gone() from None

    def _gone(self) -> RuntimeError:
        code = None
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self._process.wait(1.0)
        return RuntimeError(f"the grammar process exited (exit code {code}); see its log "
                            "lines above")

    def _read(self, timeout_s: float | None) -> bool:
        """Read one message from the grammar process (waiting up to ``timeout_s``; None:
        until one comes); False when none came."""
        assert self._conn is not None
        try:
            if not self._conn.poll(timeout_s):
                return False
            raw = self._conn.recv_bytes()
        except (EOFError, OSError):
            raise self._gone() from None
        message = self._decoder.decode(raw)
        if isinstance(message, _Compiled):
            if message.request_id in self._compiling:
                self._compiling.discard(message.request_id)
                phase = None if message.phase is None else Phase(message.phase)
                self._ready.append((CompiledRequest(message.request_id, message.error), phase))
        elif isinstance(message, _StepDone):
            self._done = message
        elif isinstance(message, _Failed):
            raise RuntimeError(f"the grammar process failed: {message.error}")  # noqa: TRY004
        return True


# ---- the grammar process ----------------------------------------------------------------------


def child_main() -> None:
    """The grammar process's entry point: its set-up from stdin (``_Setup``, written by the
    engine core that started it), the pipe's and the masks' descriptors from argv."""
    setup = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=_Setup)
    conn = multiprocessing.connection.Connection(int(sys.argv[1]))
    run_grammar_process(conn, int(sys.argv[2]), setup)


def _pin_to_grammar_cpus() -> None:
    """Run this process's threads (those its imports started, as a BLAS library's), and the
    threads it starts after them (llguidance's pool, the compile thread), on
    ``OCTAVO_GRAMMAR_CPUS`` when set; a list this machine cannot honour is logged and
    ignored."""
    cpus = envs.grammar_cpus()
    if cpus is None:
        return
    try:
        for thread in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(thread), cpus)
    except (OSError, AttributeError) as exc:  # CPUs not in this cgroup, or not Linux
        logger.warning("structured outputs: OCTAVO_GRAMMAR_CPUS=%s not applied: %s",
                       os.environ.get("OCTAVO_GRAMMAR_CPUS"), exc)
        return
    logger.info("structured outputs: the grammar process runs on CPUs %s",
                ",".join(map(str, sorted(cpus))))


def run_grammar_process(conn: multiprocessing.connection.Connection, masks_fd: int,
                        setup: _Setup) -> None:
    """The child's loop: one ``StructuredOutputManager``, its tokenizer built at once,
    driven by the engine core's messages; compilations reported as they end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core decides when this ends
    from octavo.logger import configure_logging
    from octavo.reasoning import get_reasoning_parser

    configure_logging()
    _pin_to_grammar_cpus()

    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(_ToChild)
    masks = SharedMasks(masks_fd, setup.max_rows, (setup.vocab_size + 31) // 32).array
    parser = (None if setup.reasoning_parser is None
              else get_reasoning_parser(setup.reasoning_parser))
    manager = StructuredOutputManager(lambda: setup.tokenizer, setup.vocab_size,
                                      reasoning_parser=parser)
    manager.warm_up()
    accept_parallel = setup.accept_parallel
    # The compile thread writes a byte here when a compilation ends: the loop wakes for it.
    wake_read, wake_write = os.pipe()

    def send(message: _FromChild) -> None:
        conn.send_bytes(encoder.encode(message))

    def phase_of(request_id: str) -> str | None:
        phase = manager.phase(request_id)
        return None if phase is None else phase.value

    # After a step's answer the next step is due within a step's time: the loop polls without
    # sleeping until then (OCTAVO_GRAMMAR_SPIN_US), so it does not pay a wake-up for it.
    spin_s = envs.grammar_spin_s()
    spin_until = 0.0
    try:
        while True:
            ready = []
            while time.monotonic() < spin_until:
                if conn.poll(0):
                    ready = [conn]
                    break
            # The compile thread's wake-ups are read here too (not while spinning: a
            # compilation's end waits for at most the spin window).
            ready = multiprocessing.connection.wait([conn, wake_read], 0 if ready else None)
            if wake_read in ready:
                os.read(wake_read, 4096)
                for compiled in manager.take_ready():
                    send(_Compiled(compiled.request_id, compiled.error,
                                   phase_of(compiled.request_id)))
            if conn not in ready:
                continue
            try:
                message = decoder.decode(conn.recv_bytes())
            except (EOFError, OSError):  # the engine core is gone
                break
            if isinstance(message, _Step):
                start = time.perf_counter()
                errors = (manager.accept_sampled(message.accept_ids, message.accept_tokens,
                                                 parallel=accept_parallel)
                          if message.accept_ids else {})
                if message.rows is not None:
                    manager.bitmask_into(message.rows, masks[message.buffer, :len(message.rows)])
                phases: dict[str, str] = {}
                if parser is not None:
                    phases = {request_id: phase for request_id in message.accept_ids
                              if (phase := phase_of(request_id)) is not None}
                send(_StepDone(errors, phases, time.perf_counter() - start))
                spin_until = time.monotonic() + spin_s
            elif isinstance(message, _Submit):
                manager.submit(message.request_id, message.params, message.prompt_token_ids,
                               on_done=lambda: os.write(wake_write, b"\0"))
            elif isinstance(message, _Remove):
                for request_id in message.request_ids:
                    manager.remove(request_id)
            else:
                break
    except Exception as exc:  # reported to the engine core, which raises it
        logger.exception("the grammar process failed")
        with contextlib.suppress(OSError):
            send(_Failed(f"{type(exc).__name__}: {exc}"))
    finally:
        manager.shutdown()
        conn.close()
