"""``EngineCoreClient``: the front end's handle on the engine-core process.

Starts ``core_proc.run_engine_core`` in a *spawn* process, binds the two ipc:// sockets in a
private temporary folder, and sends/receives the typed messages of ``engine.messages``
(msgpack via msgspec; nothing is pickled on a socket — only spawn's own process arguments,
the ``EngineConfig``).
Every method runs on the asyncio event loop of the front end.

With ``octavo serve --api-server-count N`` the engine core is started by the supervising
parent process instead (``entrypoints.openai.multi_api_server``), and each of the N API server
processes *attaches* to it: ``EngineCoreClient(attach=CoreAddresses(...))`` binds the two
sockets the core connects to for this front end, stamps its ``client_index`` on every request
and utility call, watches the core's pid instead of a child process, and on shutdown aborts
its own requests and leaves the core running (the parent stops it once every front end is
gone).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from octavo.config import EngineConfig
from octavo.messages.engine_core import (
    EngineCoreAbort,
    EngineCoreAdd,
    EngineCoreEvent,
    EngineCoreFailed,
    EngineCoreInput,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreShutdown,
    EngineCoreUtility,
)

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; nothing more can run."""


class EngineShuttingDownError(EngineDeadError):
    """The engine is stopping (the server's shutdown grace period is over): requests still
    running are cut."""


@dataclass(frozen=True, slots=True)
class CoreAddresses:
    """Where a front end meets an engine core started by someone else (one of several front
    ends of ``--api-server-count``)."""

    # ipc:// address this front end binds and PUSHes inputs to (the core connects).
    input_address: str
    # ipc:// address this front end binds and PULLs the core's events from (the core connects).
    output_address: str
    # This front end's index among the core's clients (0..N-1).
    client_index: int
    # The engine core's pid (watched: its exit makes this front end's engine dead).
    core_pid: int


class EngineCoreClient:
    """Spawns the engine-core process (or attaches to one: ``attach``) and carries messages
    to and from it."""

    def __init__(self, attach: CoreAddresses | None = None) -> None:
        self.attached = attach
        if attach is None:
            self._tmpdir: str | None = tempfile.mkdtemp(prefix="octavo-core-")
            self.input_address = f"ipc://{os.path.join(self._tmpdir, 'input')}"
            self.output_address = f"ipc://{os.path.join(self._tmpdir, 'output')}"
            self.client_index = 0
        else:  # the folder of the addresses belongs to the supervisor
            self._tmpdir = None
            self.input_address = attach.input_address
            self.output_address = attach.output_address
            self.client_index = attach.client_index
        # Sends are plain (never-blocking: no high-water mark) sends; receives are awaited.
        self._sync_context = zmq.Context()
        self._input_socket = self._sync_context.socket(zmq.PUSH)
        self._input_socket.setsockopt(zmq.SNDHWM, 0)
        self._input_socket.bind(self.input_address)
        self._context = zmq.asyncio.Context()
        self._output_socket = self._context.socket(zmq.PULL)
        self._output_socket.setsockopt(zmq.RCVHWM, 0)
        self._output_socket.bind(self.output_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreEvent)
        self.process: multiprocessing.process.BaseProcess | None = None
        # Attached: a pidfd of the core (readable once it exits).
        self._core_pidfd: int | None = None
        self._core_exited = False
        self._closed = False

    async def start(
        self, config: EngineConfig, on_process_exit: Callable[[], None]
    ) -> EngineCoreReady:
        """Spawn the core on ``config`` and wait until it has loaded the model.

        :param on_process_exit: called (on the event loop) when the process ends, whatever
            the reason; the caller decides whether that was expected.
        :raises RuntimeError: the core failed to start (its error message is included).
        """
        if self.attached is not None:
            return await self._attach(on_process_exit)
        ctx = multiprocessing.get_context("spawn")
        from octavo.engine_core.core_proc import run_engine_core

        self.process = ctx.Process(
            target=run_engine_core,
            args=(config, [self.input_address], [self.output_address], os.getpid(),
                  self._tmpdir),
            name="octavo-engine-core",
        )
        self.process.start()
        # Never leave the core behind, even if the owner forgets shutdown() (interpreter exit).
        weakref.finalize(self, _kill_process, self.process)
        loop = asyncio.get_running_loop()
        exited = loop.create_future()

        def sentinel_ready() -> None:
            loop.remove_reader(self.process.sentinel)
            if not exited.done():
                exited.set_result(None)
            on_process_exit()

        loop.add_reader(self.process.sentinel, sentinel_ready)
        receive = asyncio.ensure_future(self.receive())
        done, _ = await asyncio.wait({receive, exited}, return_when=asyncio.FIRST_COMPLETED)
        if receive not in done:
            receive.cancel()
            raise RuntimeError(
                f"the engine-core process exited with code {self.process.exitcode} while starting"
            )
        return _check_ready(receive.result())

    async def _attach(self, on_process_exit: Callable[[], None]) -> EngineCoreReady:
        """Wait for the Ready of a core started by the supervisor, and watch its pid."""
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        pid = self.attached.core_pid

        def core_gone() -> None:
            if self._core_pidfd is not None:
                loop.remove_reader(self._core_pidfd)
            self._core_exited = True
            if not exited.done():
                exited.set_result(None)
            on_process_exit()

        try:
            self._core_pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise RuntimeError(f"the engine-core process {pid} is gone") from None
        loop.add_reader(self._core_pidfd, core_gone)
        receive = asyncio.ensure_future(self.receive())
        done, _ = await asyncio.wait({receive, exited}, return_when=asyncio.FIRST_COMPLETED)
        if receive not in done:
            receive.cancel()
            raise RuntimeError(f"the engine-core process {pid} exited while starting")
        return _check_ready(receive.result())

    @property
    def pid(self) -> int | None:
        if self.attached is not None:
            return self.attached.core_pid
        return self.process.pid if self.process is not None else None

    def is_alive(self) -> bool:
        if self.attached is not None:
            return self._core_pidfd is not None and not self._core_exited
        return self.process is not None and self.process.is_alive()

    async def receive(self) -> EngineCoreEvent:
        """The next message from the core (waits for it).

        A frame that is not a valid ``EngineCoreEvent`` (it can only come from another process
        writing to the socket: the core encodes every message from the same typed structs) is
        logged and dropped; it fails nothing and nobody.
        """
        while True:
            frame = await self._output_socket.recv()
            try:
                return self._decoder.decode(frame)
            except msgspec.DecodeError as exc:
                logger.error("dropped a malformed frame (%d bytes) from the engine core's output "
                             "socket: %s", len(frame), exc)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        if self.client_index:
            for request in requests:
                request.client_index = self.client_index
        self._send(EngineCoreAdd(requests=requests))

    def kill(self) -> None:
        """End the core process at once (it is considered dead already). An attached front
        end does not own the core: the supervisor sees it die (or kills it) and stops every
        front end."""
        if self.process is not None and self.process.is_alive():
            self.process.kill()

    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> None:
        if request_ids:
            self._send(EngineCoreAbort(request_ids=request_ids, stopped=stopped))

    def call_utility(self, call_id: int, method: str) -> None:
        self._send(EngineCoreUtility(call_id=call_id, method=method,
                                     client_index=self.client_index))

    def _send(self, message: EngineCoreInput) -> None:
        if self._closed:
            raise EngineDeadError("the engine core is shut down")
        self._input_socket.send(self._encoder.encode(message), copy=False)

    def shutdown(self, timeout_s: float = 10.0, request_ids: list[str] | None = None) -> None:
        """Ask the core to exit, wait for it, then kill it if it did not; release the sockets.

        Attached: abort ``request_ids`` (this front end's unfinished requests) in the core and
        leave it running; the supervisor stops it.
        """
        if self._closed:
            return
        if self.attached is not None:
            self._detach(request_ids or [])
            return
        process = self.process
        if process is not None and process.is_alive():
            try:
                self._input_socket.send(self._encoder.encode(EngineCoreShutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            process.join(timeout_s)
            if process.is_alive():
                logger.warning("engine core did not exit in %.0f s; killing it", timeout_s)
                process.kill()
                process.join(5.0)
        if process is not None:
            try:
                asyncio.get_running_loop().remove_reader(process.sentinel)
            except (RuntimeError, ValueError, OSError):
                pass
        self._closed = True
        self._input_socket.close(linger=0)
        self._output_socket.close(linger=0)
        self._close_contexts()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _detach(self, request_ids: list[str]) -> None:
        if request_ids and not self._core_exited:
            try:
                self._input_socket.send(self._encoder.encode(
                    EngineCoreAbort(request_ids=request_ids)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        if self._core_pidfd is not None:
            try:
                asyncio.get_running_loop().remove_reader(self._core_pidfd)
            except (RuntimeError, ValueError, OSError):
                pass
            os.close(self._core_pidfd)
            self._core_pidfd = None
        self._closed = True
        # The aborts may take a moment to leave: wait for them a little, never forever.
        self._input_socket.close(linger=1000)
        self._output_socket.close(linger=0)
        self._close_contexts()

    def _close_contexts(self) -> None:
        self._context.term()
        self._sync_context.term()


def _kill_process(process: multiprocessing.process.BaseProcess) -> None:
    if process.is_alive():
        process.kill()
        process.join(5.0)


def _check_ready(event: EngineCoreEvent) -> EngineCoreReady:
    """The core's first message, which must say it is ready."""
    if isinstance(event, EngineCoreFailed):
        raise RuntimeError(f"the engine core failed to start: {event.message}")
    if not isinstance(event, EngineCoreReady):
        raise RuntimeError(f"unexpected first message from the engine core: {event!r}")
    return event
