"""The engine core in its own process: the loop behind ``AsyncLLM``.

``run_engine_core`` is the target of a ``multiprocessing`` *spawn* process. It builds the
``EngineCore`` from the ``EngineConfig`` the front end resolved (passed as a spawn argument:
the model's config is read once, in the front end), then talks to the front end over zmq
PUSH/PULL sockets, msgpack-encoded with msgspec:

- in:  ``EngineCoreInput``  (add, abort, utility call, shutdown)
- out: ``EngineCoreEvent``  (ready once, then outputs + a stats snapshot each step, utility
  results; ``EngineCoreFailed`` just before exiting on an error)

With several front ends (``octavo serve --api-server-count N``: N API server processes) the
input socket is connected to every front end's address (and to the supervising parent's, which
sends the shutdown), and there is one output socket per front end: each request carries its
front end's ``client_index``, and every step sends each front end one ``EngineCoreOutputs``
with the outputs of its own requests and the scheduler's snapshot (``OutputRouter``). Ready
and failure messages go to every front end.

The loop: take every pending input (waiting for one while there is nothing to run), run one
step while there is work, send what it produced. It exits when told to, when a step fails
(exit code 1), or when the parent process is gone: never an orphan.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from octavo.config import EngineConfig
from octavo.engine_core.core import EngineCore
from octavo.engine_core.gc_heap import freeze_startup_objects
from octavo.engine_core.output_router import OutputRouter
from octavo.messages.engine_core import (
    EngineCoreAbort,
    EngineCoreAdd,
    EngineCoreEvent,
    EngineCoreFailed,
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreShutdown,
    EngineCoreUtility,
    EngineCoreUtilityResult,
    SchedulerStats,
)

logger = logging.getLogger(__name__)

# How often (seconds) the loop checks that its parent is still alive, busy or idle.
PARENT_CHECK_INTERVAL_S = 0.5
# How long the last messages (e.g. EngineCoreFailed) may wait to be delivered at exit.
_LINGER_MS = 2000


def run_engine_core(
    config: EngineConfig, input_addresses: list[str], output_addresses: list[str],
    parent_pid: int, ipc_dir: str | None = None,
) -> None:
    """Process entry point: build the core, announce it, serve until told to stop.

    :param config: the engine's resolved configuration (model, backend, limits).
    :param input_addresses: zmq addresses front ends (and a supervisor) PUSH
        ``EngineCoreInput`` to; the core reads them all, fairly.
    :param output_addresses: one zmq address per front end, which PULLs ``EngineCoreEvent``
        from it; front end ``i`` sends requests with ``client_index`` ``i``.
    :param parent_pid: the front end's pid; the loop exits when it is no longer our parent.
    :param ipc_dir: the folder of the ipc sockets; removed here if the parent died (it could
        not remove it itself).
    """
    # The front end owns shutdown: a Ctrl-C or SIGTERM sent to the whole process group must
    # not kill the core under requests that are still finishing. It exits when told to or
    # when its parent is gone (checked every PARENT_CHECK_INTERVAL_S).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from octavo.logger import configure_logging

    configure_logging()
    proc = EngineCoreProc(input_addresses, output_addresses, parent_pid)
    try:
        proc.start(config)
        exit_code = proc.run()
    except BaseException as exc:  # anything: tell the front end before dying
        logger.exception("engine core failed")
        proc.broadcast(EngineCoreFailed(message=f"{type(exc).__name__}: {exc}"))
        exit_code = 1
    finally:
        proc.close()
        if proc.orphaned and ipc_dir is not None:
            shutil.rmtree(ipc_dir, ignore_errors=True)
    sys.exit(exit_code)


class EngineCoreProc:
    """The sockets and the busy loop around one ``EngineCore``."""

    def __init__(self, input_addresses: list[str], output_addresses: list[str],
                 parent_pid: int) -> None:
        self.parent_pid = parent_pid
        self.context = zmq.Context()
        self.input_socket = self.context.socket(zmq.PULL)
        for address in input_addresses:
            self.input_socket.connect(address)
        self.output_sockets: list[zmq.Socket] = []
        for address in output_addresses:
            socket = self.context.socket(zmq.PUSH)
            # No high-water mark: a send never blocks, so the loop keeps checking that the
            # parent lives even if a front end stopped reading (a blocked send would make an
            # orphan).
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.connect(address)
            self.output_sockets.append(socket)
        # Whose requests are whose (one entry per front end's output socket).
        self.router = OutputRouter(len(output_addresses))
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineCoreInput)
        self.engine_core: EngineCore | None = None
        self._shutdown = False
        # True once the loop ended because the parent process was gone.
        self.orphaned = False
        self._last_parent_check = time.monotonic()
        # Utility calls the front end may make (no arguments; results are small dicts).
        self.utility_methods: dict[str, Callable[[], dict[str, Any]]] = {
            "ping": lambda: {"pid": os.getpid()},
            "kv_cache_stats": self._kv_cache_stats,
            # 1 or 0: a result holds ints, floats and strings.
            "reset_prefix_cache": lambda: {"reset": int(self.engine_core.reset_prefix_cache())},
        }

    def start(self, config: EngineConfig) -> None:
        self.engine_core = EngineCore(config)
        # This process is the engine's own (a spawn child): start-up's objects leave the
        # collector's sight, so full collections stop stalling steps (octavo.engine_core.gc_heap).
        freeze_startup_objects()
        self.broadcast(
            EngineCoreReady(
                backend=config.backend,
                num_blocks=self.engine_core.num_blocks,
                block_size=config.cache_config.block_size,
                max_model_len=config.model_config.max_model_len,
                stats=self.engine_core.stats(),  # on the thread that will run the steps
            )
        )

    def run(self) -> int:
        """Serve until shutdown (0) or the parent's death (0); a failing step raises."""
        core = self.engine_core
        while not self._shutdown:
            busy = core.has_unfinished_requests()
            rejected = self._process_inputs(block=not busy)
            if not self._parent_alive():
                logger.warning("the front-end process is gone; engine core exiting")
                self.orphaned = True
                return 0
            if self._shutdown:
                break
            if core.has_unfinished_requests():
                self._send_outputs(core.step(), rejected or {})
            elif rejected is not None:
                # Inputs while idle (aborts, rejections): the front end's gauges must move too.
                self._send_outputs([], rejected)
        return 0

    def _send_outputs(self, outputs: list[EngineCoreOutput], rejected: dict[str, str]) -> None:
        """One ``EngineCoreOutputs`` per front end: its requests' outputs and rejections, and
        the scheduler's snapshot (every front end gets it, for its gauges and admission)."""
        stats = self._stats()
        sockets = self.output_sockets
        if len(sockets) == 1:
            sockets[0].send(self.encoder.encode(
                EngineCoreOutputs(outputs=outputs, stats=stats, rejected=rejected)))
            return
        per_client_rejected: list[dict[str, str]] = [{} for _ in sockets]
        for request_id, message in rejected.items():
            index = self.router.client_of(request_id)
            self.router.forget([request_id])
            if index is not None:
                per_client_rejected[index][request_id] = message
        for socket, client_outputs, client_rejected in zip(
                sockets, self.router.split(outputs), per_client_rejected):
            socket.send(self.encoder.encode(
                EngineCoreOutputs(outputs=client_outputs, stats=stats, rejected=client_rejected)))

    def _process_inputs(self, block: bool) -> dict[str, str] | None:
        """Apply every pending input; wait up to PARENT_CHECK_INTERVAL_S for one if ``block``.

        Returns the rejected request ids (a dict, maybe empty) when any input arrived, else None.
        """
        timeout = int(PARENT_CHECK_INTERVAL_S * 1000) if block else 0
        if not self.input_socket.poll(timeout):
            return None
        rejected: dict[str, str] = {}
        while True:
            try:
                frame = self.input_socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return rejected
            try:
                message = self.decoder.decode(frame)
            except msgspec.DecodeError as exc:
                # Only another process writing to the socket can send one (the front end
                # encodes typed structs): drop it, never fail the loop or other requests.
                logger.error("dropped a malformed frame (%d bytes) on the input socket: %s",
                             len(frame), exc)
                continue
            self._handle(message, rejected)

    def _handle(self, message: EngineCoreInput, rejected: dict[str, str]) -> None:
        core = self.engine_core
        if isinstance(message, EngineCoreAdd):
            for request in message.requests:
                try:
                    self.router.add(request)
                except ValueError as exc:  # its id is another front end's request's
                    self.send(EngineCoreOutputs(outputs=[], stats=self._stats(),
                                                rejected={request.request_id: str(exc)}),
                              request.client_index)
                    continue
                try:
                    core.add_request(request)
                except (ValueError, TypeError) as exc:
                    rejected[request.request_id] = str(exc)
        elif isinstance(message, EngineCoreAbort):
            self.router.forget(message.request_ids)
            if message.stopped:
                core.finish_requests_stopped(message.request_ids)
            else:
                core.abort_requests(message.request_ids)
        elif isinstance(message, EngineCoreUtility):
            self.send(self._call_utility(message), message.client_index)
        elif isinstance(message, EngineCoreShutdown):
            self._shutdown = True
        else:  # pragma: no cover - the decoder only yields the union's members
            raise AssertionError(f"unexpected engine-core input {message!r}")

    def _call_utility(self, call: EngineCoreUtility) -> EngineCoreUtilityResult:
        method = self.utility_methods.get(call.method)
        if method is None:
            return EngineCoreUtilityResult(
                call_id=call.call_id,
                error=f"unknown utility method {call.method!r}; known: "
                      f"{sorted(self.utility_methods)}",
            )
        try:
            return EngineCoreUtilityResult(call_id=call.call_id, result=method())
        except Exception as exc:  # noqa: BLE001  (a utility's failure goes back to its caller)
            return EngineCoreUtilityResult(call_id=call.call_id,
                                           error=f"{type(exc).__name__}: {exc}")

    def _kv_cache_stats(self) -> dict[str, Any]:
        scheduler = self.engine_core.scheduler
        manager = scheduler.kv_cache_manager
        return {
            "num_blocks": self.engine_core.num_blocks,
            "num_free_blocks": manager.num_free_blocks,
            "num_requests": len(scheduler.requests),
            "num_requests_holding_blocks": manager.num_requests_holding_blocks(),
        }

    def _stats(self) -> SchedulerStats:
        return self.engine_core.stats()

    def _parent_alive(self) -> bool:
        now = time.monotonic()
        if now - self._last_parent_check < PARENT_CHECK_INTERVAL_S:
            return True
        self._last_parent_check = now
        return os.getppid() == self.parent_pid

    def send(self, event: EngineCoreEvent, client_index: int = 0) -> None:
        """Send ``event`` to one front end (an unknown index is logged and dropped)."""
        if not 0 <= client_index < len(self.output_sockets):
            logger.error("dropped a %s for client %d: there are %d clients",
                         type(event).__name__, client_index, len(self.output_sockets))
            return
        self.output_sockets[client_index].send(self.encoder.encode(event))

    def broadcast(self, event: EngineCoreEvent) -> None:
        """Send ``event`` to every front end."""
        frame = self.encoder.encode(event)
        for socket in self.output_sockets:
            socket.send(frame)

    def close(self) -> None:
        if self.engine_core is not None:
            try:
                self.engine_core.shutdown()
            except Exception:  # pragma: no cover - best effort at exit
                logger.exception("engine core shutdown failed")
        self.input_socket.close(linger=0)
        for socket in self.output_sockets:
            socket.close(linger=_LINGER_MS)
        self.context.term()
