"""``octavo serve --api-server-count N``: N API server processes in front of one engine core.

One API server process (HTTP, tokenization, detokenization, SSE encoding) tops out at some
thousands of streamed chunks a second; past that the engine waits for it. With N > 1 the
``octavo serve`` process becomes a supervisor (as vLLM's ``run_multi_api_server``):

- it gives each of N spawned API server processes a listening socket of its own on the
  server's address (the one ``octavo serve`` bound first, then N - 1 more), all with
  ``SO_REUSEPORT``, so that Linux deals each new connection to one of them by a hash of its
  addresses: the connections spread evenly. (On one shared socket, the process that woke first
  took every connection waiting: asyncio accepts up to its backlog at once, and in 4 of about
  50 test runs one of two API servers got all 48 connections of a burst.) Where
  ``SO_REUSEPORT`` does not deal connections (not Linux), they share the one socket;
- it spawns one engine-core process whose input socket reads from every API server (and from
  the supervisor, which alone sends the shutdown) and which has one output socket per API
  server: requests carry their API server's ``client_index``, and each step sends each API
  server one message with its own requests' outputs (``engine_core.output_router``);
- each API server runs the same app as with N = 1, its ``AsyncLLM`` attached to that core
  (``CoreAddresses``) instead of spawning its own.

Lifetime: SIGTERM/SIGINT to the supervisor is passed to every API server, which stops
accepting and lets its requests finish (``--shutdown-timeout``) as one server would; once all
have exited the supervisor tells the core to exit, waits for it (then kills it) and removes the
ipc and metrics folder. If any process dies on its own, the supervisor stops the others the
same way and exits 1. An API server whose supervisor is gone exits; so does the core (it checks
its parent). Nothing is left behind.

``/metrics``: prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, a folder
of this run): whichever API server answers the scrape adds up every process's counters and
histograms; gauges are the engine core's snapshot (the most recent one written); the counters
that come from the engine core's totals (prefix cache, preemptions, speculative decoding) are
counted by API server 0 alone.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq

from octavo.config import EngineConfig
from octavo.engine.core_client import CoreAddresses
from octavo.messages.engine_core import EngineCoreShutdown

logger = logging.getLogger(__name__)

# How long the engine core may take to exit once told to (then it is killed).
CORE_EXIT_TIMEOUT_S = 30.0
# How often an API server checks that its supervisor is alive.
SUPERVISOR_CHECK_INTERVAL_S = 0.5


def check_api_server_count(count: int, allow_runtime_lora_updating: bool) -> None:
    """``ValueError`` (one line) for an ``--api-server-count`` that cannot work."""
    if count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {count}")
    if count > 1 and allow_runtime_lora_updating:
        raise ValueError(
            f"--api-server-count {count} cannot be used with "
            "OCTAVO_ALLOW_RUNTIME_LORA_UPDATING=1: an adapter loaded at run time would be known "
            "to one API server only; serve adapters with --lora-modules, or use one API server")


def deals_by_reuse_port() -> bool:
    """Whether the kernel deals connections among sockets listening on one address with
    ``SO_REUSEPORT`` (Linux does, by a hash of each connection's addresses; BSD and macOS
    accept the option without balancing)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def listening_sockets(sock: socket.socket, count: int) -> list[socket.socket]:
    """One listening socket per API server: ``sock`` first, then, when ``sock`` has
    ``SO_REUSEPORT``, ``count - 1`` more on its address (else ``sock`` for every one)."""
    reuse_port = getattr(socket, "SO_REUSEPORT", None)
    if count == 1 or reuse_port is None or not sock.getsockopt(socket.SOL_SOCKET, reuse_port):
        return [sock] * count
    from octavo.entrypoints.openai.api_server import bind_socket

    host, port = sock.getsockname()[:2]
    extra: list[socket.socket] = []
    try:
        for _ in range(count - 1):
            extra.append(bind_socket(host, port, reuse_port=True))
    except BaseException:
        for other in extra:
            other.close()
        raise
    return [sock, *extra]


def run_multi_api_server(args: Any, sock: socket.socket, config: EngineConfig) -> int:
    """Supervise ``args.api_server_count`` API servers and one engine core until
    SIGTERM/SIGINT (returns 0 if every API server exited 0) or a process dies (returns 1).

    :param args: the server's ``ServerArgs``.
    :param sock: the bound, listening socket (``bind_socket``; with ``reuse_port`` where
        ``deals_by_reuse_port``, see the module docstring).
    :param config: the engine's resolved configuration (the core is built from it).
    """
    from octavo.engine_core.core_proc import run_engine_core

    count = args.api_server_count
    workdir = tempfile.mkdtemp(prefix="octavo-serve-")
    metrics_dir = os.path.join(workdir, "prometheus")
    os.mkdir(metrics_dir)
    # Read by prometheus_client when it is imported: in the spawned API servers, from start.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    inputs = [f"ipc://{workdir}/input-{i}" for i in range(count)]
    outputs = [f"ipc://{workdir}/output-{i}" for i in range(count)]
    control_address = f"ipc://{workdir}/control"
    context = zmq.Context()
    control = context.socket(zmq.PUSH)
    control.bind(control_address)
    stop = _StopSignals()
    ctx = multiprocessing.get_context("spawn")
    core: BaseProcess | None = None
    servers: list[BaseProcess] = []
    stopped_by_signal = False
    try:
        core = ctx.Process(target=run_engine_core, name="octavo-engine-core",
                           args=(config, [*inputs, control_address], outputs, os.getpid(),
                                 workdir))
        core.start()
        for i, server_sock in enumerate(listening_sockets(sock, count)):
            addresses = CoreAddresses(input_address=inputs[i], output_address=outputs[i],
                                      client_index=i, core_pid=core.pid)
            server = ctx.Process(target=run_api_server_worker, name=f"octavo-api-server-{i}",
                                 args=(args, server_sock, addresses, os.getpid()))
            server.start()  # the child has its own copy of the socket now
            servers.append(server)
            if server_sock is not sock:
                # Closed here, so that it leaves the address's group with its API server (a
                # socket no process accepts on would still be dealt connections).
                server_sock.close()
        logger.info("%d API server processes (pids %s) in front of engine core pid %d",
                    count, ", ".join(str(s.pid) for s in servers), core.pid)
        stopped_by_signal = _wait_for_stop_or_exit(stop, [core, *servers])
        if not stopped_by_signal:
            gone = [p for p in [core, *servers] if not p.is_alive()]
            logger.error("%s exited (code %s): stopping the others",
                         gone[0].name if gone else "a process",
                         gone[0].exitcode if gone else "?")
    finally:
        stop.restore()
        _stop_api_servers(servers, args.shutdown_timeout)
        if core is not None:
            _stop_core(core, control)
        control.close(linger=0)
        context.term()
        shutil.rmtree(workdir, ignore_errors=True)
    codes = [server.exitcode for server in servers]
    if stopped_by_signal and codes and all(code == 0 for code in codes):
        return 0
    logger.error("API server exit codes: %s", codes)
    return 1


class _StopSignals:
    """SIGTERM/SIGINT set a flag (restored by ``restore``)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle)
                          for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _wait_for_stop_or_exit(stop: _StopSignals, processes: list[BaseProcess]) -> bool:
    """Block until a stop signal (True) or until any process exits (False)."""
    sentinels = [process.sentinel for process in processes]
    while stop.received is None:
        if multiprocessing.connection.wait(sentinels, timeout=0.2):
            return stop.received is not None
    return True


def _stop_api_servers(servers: list[BaseProcess], shutdown_timeout: float) -> None:
    """SIGTERM each API server (a graceful shutdown: requests in flight may finish), wait for
    all, kill those still running after the grace period and some margin."""
    from octavo.entrypoints.openai.api_server import _ERROR_DELIVERY_S

    for server in servers:
        if server.is_alive():
            os.kill(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + shutdown_timeout + _ERROR_DELIVERY_S + 10.0
    for server in servers:
        server.join(max(deadline - time.monotonic(), 0.0))
        if server.is_alive():
            logger.warning("%s did not exit in time; killing it", server.name)
            server.kill()
            server.join(5.0)


def _stop_core(core: BaseProcess, control: zmq.Socket) -> None:
    if core.is_alive():
        try:
            control.send(msgspec.msgpack.encode(EngineCoreShutdown()), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        core.join(CORE_EXIT_TIMEOUT_S)
        if core.is_alive():
            logger.warning("engine core did not exit in %.0f s; killing it", CORE_EXIT_TIMEOUT_S)
            core.kill()
    core.join(5.0)


def run_api_server_worker(args: Any, sock: socket.socket, addresses: CoreAddresses,
                          supervisor_pid: int) -> None:
    """Entry point of one spawned API server process: serve on ``sock`` with an ``AsyncLLM``
    attached to the supervisor's engine core; exits with ``run_server``'s code."""
    import sys

    from octavo.cli.serve import front_end_threads
    from octavo.entrypoints.openai.api_server import run_server
    from octavo.logger import configure_logging

    configure_logging()
    front_end_threads()
    sys.exit(run_server(args, sock, attach=addresses, supervisor_pid=supervisor_pid))
