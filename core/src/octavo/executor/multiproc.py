"""``MultiprocExecutor``: one worker process per rank on this host (``--distributed-executor-
backend mp``).

The engine core (this process) spawns ``world_size`` worker processes; each runs a
``WorkerHost`` for its rank: it binds device ``rank``, joins the others through
``torch.distributed`` (the backend's process-group backend; rendezvous on a free TCP port of
127.0.0.1) and loads only its part of the weights. Messages are the msgspec Structs of
``octavo.messages.executor`` over zmq ipc sockets in a private folder: one PUSH socket per
rank for what the engine core sends (the same encoded step to every rank), one PULL socket
for what comes back (the output rank's results; every rank's answer to a lifecycle call).
Grammar masks filled in ``SharedMasks`` (by the engine core's grammars) do not cross the
sockets: every worker maps those buffers, inherited as it starts, and a step's messages name
the buffer.

Failures never hang: while it waits, the executor watches every worker process; one that
exits makes the step raise (naming the rank and its exit code) after every other worker has
been killed. Workers exit on their own when the engine core's process is gone.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import weakref
from typing import Any, NoReturn

import msgspec
import zmq

from octavo import envs
from octavo.config import EngineConfig
from octavo.executor.worker_steps import WorkerStepsExecutor
from octavo.messages.executor import (
    WorkerCall,
    WorkerCallResult,
    WorkerEvent,
    WorkerInput,
    WorkerShutdown,
)
from octavo.messages.shared_masks import SharedMasks

logger = logging.getLogger(__name__)

# How often (seconds) a waiting executor checks its workers, and workers their parent.
_POLL_S = 0.1
_PARENT_CHECK_S = 0.5
# How long a lifecycle call may take (loading a large model's weights takes minutes).
_CALL_TIMEOUT_S = 3600.0


class WorkerDiedError(RuntimeError):
    """A worker process exited while the engine needed it."""


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class MultiprocExecutor(WorkerStepsExecutor):
    """Implements ``octavo.executor.base.Executor`` with one process per rank (the steps:
    ``WorkerStepsExecutor``)."""

    def __init__(self, config: EngineConfig, shared_masks: SharedMasks | None = None) -> None:
        """``shared_masks``: where the engine core's grammar masks are filled, if in shared
        memory (the workers map it as they start; a bitmask in it travels as a reference)."""
        super().__init__(config, shared_masks)
        self._tmpdir = tempfile.mkdtemp(prefix="octavo-workers-")
        self._context = zmq.Context()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkerEvent)
        self._inputs: list[zmq.Socket] = []
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._call_ids = itertools.count(1)
        self._spin_s = envs.worker_spin_s()
        self._closed = False
        try:
            self._start_workers()
            self._call("start")
        except BaseException:
            self.shutdown()
            raise

    # ---- start ---------------------------------------------------------------------------

    def _start_workers(self) -> None:
        output_address = f"ipc://{os.path.join(self._tmpdir, 'out')}"
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(output_address)
        init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
        ctx = multiprocessing.get_context("spawn")
        for rank in range(self.world_size):
            input_address = f"ipc://{os.path.join(self._tmpdir, f'in-{rank}')}"
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.bind(input_address)
            self._inputs.append(sock)
            process = ctx.Process(
                target=run_worker,
                args=(self.config, rank, input_address, output_address, init_method, os.getpid(),
                      self._shared_masks),
                name=f"octavo-worker-{rank}",
                daemon=True,
            )
            process.start()
            self._processes.append(process)
        # Never leave workers behind, even if the owner forgets shutdown().
        weakref.finalize(self, _kill_all, list(self._processes))
        logger.info("started %d worker processes (tensor parallel %d x pipeline parallel %d)",
                    self.world_size, self.config.parallel_config.tensor_parallel_size,
                    self.config.parallel_config.pipeline_parallel_size)

    # ---- the Executor protocol (the steps: WorkerStepsExecutor) ----------------------------

    def check_health(self) -> None:
        for rank, process in enumerate(self._processes):
            if not process.is_alive():
                raise WorkerDiedError(
                    f"worker rank {rank} exited (exit code {process.exitcode})")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        alive = [p for p in self._processes if p.is_alive()]
        if alive:
            try:
                self._send(WorkerShutdown())
            except zmq.ZMQError:
                pass
            deadline = time.monotonic() + 10.0
            for process in alive:
                process.join(max(deadline - time.monotonic(), 0.1))
        _kill_all(self._processes)
        for sock in [*self._inputs, getattr(self, "_output", None)]:
            if sock is not None:
                sock.close(linger=0)
        self._context.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    # ---- plumbing ------------------------------------------------------------------------

    def _call(self, method: str, arg: int | None = None) -> list[int | None]:
        """Call a lifecycle method on every rank; return each rank's value, in rank order."""
        call_id = next(self._call_ids)
        self._send(WorkerCall(call_id=call_id, method=method, arg=arg))
        values: dict[int, int | None] = {}
        while len(values) < self.world_size:
            event = self._receive(_CALL_TIMEOUT_S)
            if isinstance(event, WorkerCallResult) and event.call_id == call_id:
                if event.error is not None:
                    self._fail(f"{method} failed on rank {event.rank}: {event.error}")
                values[event.rank] = event.value
        return [values[rank] for rank in range(self.world_size)]

    def _send(self, message: WorkerInput) -> None:
        frame = self._encoder.encode(message)
        for sock in self._inputs:
            sock.send(frame, copy=False)

    def _next_events(self) -> list[WorkerEvent]:
        return [self._receive(_CALL_TIMEOUT_S)]

    def _receive(self, timeout_s: float) -> WorkerEvent:
        """The next message from any worker; raises if a worker dies or none answers. Polls
        without sleeping for the spin window first (``OCTAVO_WORKER_SPIN_US``)."""
        now = time.monotonic()
        deadline = now + timeout_s
        spin_until = now + self._spin_s
        while True:
            spinning = time.monotonic() < spin_until
            if self._output.poll(0 if spinning else int(_POLL_S * 1000)):
                frame = self._output.recv()
                try:
                    return self._decoder.decode(frame)
                except msgspec.DecodeError as exc:
                    logger.error("dropped a malformed frame (%d bytes) from a worker: %s",
                                 len(frame), exc)
                    continue
            if spinning:
                continue
            try:
                self.check_health()
            except WorkerDiedError as exc:
                self._fail(str(exc))
            if time.monotonic() > deadline:
                self._fail(f"no answer from the workers in {timeout_s:.0f} s")

    def _fail(self, reason: str) -> NoReturn:
        """Stop every worker (a collective would otherwise wait on the dead one) and raise.

        A rank that died is named first: the others usually fail because of it (a collective
        with a dead peer), and their error says less.
        """
        time.sleep(_POLL_S)  # a peer's death is often seen by the others first
        dead = [f"worker rank {rank} exited (exit code {p.exitcode})"
                for rank, p in enumerate(self._processes) if not p.is_alive()]
        if dead and not reason.startswith("worker rank"):
            reason = f"{'; '.join(dead)}; then {reason}"
        logger.error("distributed execution failed: %s; stopping every worker", reason)
        _kill_all(self._processes)
        raise WorkerDiedError(reason)


def _kill_all(processes: list[Any]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(5.0)


# ---- the worker process ------------------------------------------------------------------------


def run_worker(config: EngineConfig, rank: int, input_address: str, output_address: str,
               distributed_init_method: str, parent_pid: int,
               shared_masks: SharedMasks | None = None) -> None:
    """Entry point of a worker process: serve the executor's messages until told to stop,
    until a step fails (exit 1), or until the parent process is gone (exit 0).
    ``shared_masks``: the engine core's grammar masks, mapped here (bitmasks by reference)."""
    # The engine core owns shutdown: a Ctrl-C sent to the whole process group must not kill
    # the workers under it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from octavo.executor.worker_host import WorkerHost
    from octavo.logger import configure_logging

    configure_logging()
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(WorkerInput)
    host = WorkerHost(config, rank, distributed_init_method, shared_masks=shared_masks)
    # After each message, poll without sleeping for this long: the next one is due within a
    # step's time (OCTAVO_WORKER_SPIN_US).
    spin_s = envs.worker_spin_s()
    exit_code = 0
    last_parent_check = last_message = time.monotonic()
    try:
        while True:
            if time.monotonic() - last_message < spin_s:
                if not inputs.poll(0):
                    continue
            elif not inputs.poll(int(_PARENT_CHECK_S * 1000)):
                if os.getppid() != parent_pid:
                    logger.warning("rank %d: the engine core is gone; exiting", rank)
                    break
                continue
            # Not copied out of zmq: a step's grammar bitmask is decoded as a view of it.
            frame = inputs.recv(copy=False)
            try:
                message = decoder.decode(frame.buffer)
            except msgspec.DecodeError as exc:
                logger.error("rank %d: dropped a malformed frame (%d bytes): %s", rank,
                             len(frame.buffer), exc)
                continue
            for event in host.handle(message):
                outputs.send(encoder.encode(event))
            if isinstance(message, WorkerShutdown):
                break
            if host.stopped:
                exit_code = 1
                break
            now = last_message = time.monotonic()
            if now - last_parent_check > _PARENT_CHECK_S:
                last_parent_check = now
                if os.getppid() != parent_pid:
                    break
    finally:
        host.shutdown()
        inputs.close(linger=0)
        outputs.close(linger=2000)
        context.term()
    sys.exit(exit_code)
