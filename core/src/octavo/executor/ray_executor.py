"""``RayExecutor``: one Ray actor per rank, placed on a Ray cluster (``--distributed-executor-
backend ray``), for models split over more devices than one host has.

The engine core connects to the running cluster (``ray.init(address="auto")``, or
``RAY_ADDRESS``; a Ray instance already initialised in this process is used as it is),
reserves one bundle per rank in a placement group (one GPU each for GPU backends, one CPU for
the CPU backend; ``PACK``: as few hosts as possible), and starts a ``_RayWorker`` actor in
each. Ray gives each GPU actor its own device (``CUDA_VISIBLE_DEVICES``), so every rank binds
local device 0; the ranks rendezvous through ``torch.distributed`` on a free port of rank 0's
host.

Messages are the same msgspec-encoded Structs as the multiprocess executor's
(``octavo.messages.executor``), passed as ``bytes`` arguments of actor calls: Ray runs an
actor's calls in the order they were made, so every rank sees the steps in order. Shutdown
(and any failure) kills the actors and removes the placement group.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any, NoReturn

import msgspec

from octavo.config import EngineConfig
from octavo.executor.multiproc import WorkerDiedError, free_tcp_port
from octavo.executor.worker_steps import WorkerStepsExecutor
from octavo.messages.executor import (
    WorkerCall,
    WorkerCallResult,
    WorkerEvent,
    WorkerInput,
    WorkerShutdown,
    WorkerStepResult,
)

logger = logging.getLogger(__name__)

# Seconds to wait for the cluster to place every rank before saying it cannot.
_PLACEMENT_TIMEOUT_S = 60.0


class _RayWorker:
    """The actor of one rank: a ``WorkerHost`` fed with encoded messages."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        from octavo.logger import configure_logging

        configure_logging()
        self.config = config
        self.rank = rank
        self.host: Any = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkerInput)

    def rendezvous_address(self) -> str:
        """``tcp://<this host>:<free port>`` (asked of rank 0)."""
        import ray

        host = ray.util.get_node_ip_address()
        return f"tcp://{host}:{free_tcp_port(host)}"

    def setup(self, distributed_init_method: str) -> None:
        import ray

        from octavo.executor.worker_host import WorkerHost

        # Ray shows each GPU actor only its own device: it is local device 0.
        local_rank = 0 if ray.get_gpu_ids() else None
        self.host = WorkerHost(self.config, self.rank, distributed_init_method, local_rank)

    def handle(self, frame: bytes) -> list[bytes]:
        events = self.host.handle(self._decoder.decode(frame))
        return [self._encoder.encode(event) for event in events]


def _unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why a ``host:port`` Ray address cannot be reached (None: reachable, or another form
    such as "auto" or "ray://", which Ray checks itself)."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return None
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{host}:{port}: {exc.strerror or exc}"


class RayExecutor(WorkerStepsExecutor):
    """Implements ``octavo.executor.base.Executor`` with Ray actors (the steps:
    ``WorkerStepsExecutor``; bitmasks carry their rows: actors may run on other hosts)."""

    def __init__(self, config: EngineConfig) -> None:
        import ray

        super().__init__(config)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkerEvent)
        self._call_ids = itertools.count(1)
        # The output rank's answers not read yet, in the order the messages were sent.
        self._output_refs: list[Any] = []
        # Every rank's answers not checked yet (a failure on any rank must surface).
        self._other_refs: list[Any] = []
        self._actors: list[Any] = []
        self._placement_group: Any = None
        self._closed = False
        self._output_rank = self._output_rank_of(config)
        self._connect(ray)
        try:
            self._place(ray)
            self._call("start")
        except BaseException:
            self.shutdown()
            raise

    @staticmethod
    def _output_rank_of(config: EngineConfig) -> int:
        parallel = config.parallel_config
        return (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size

    # ---- start ---------------------------------------------------------------------------

    def _connect(self, ray: Any) -> None:
        if ray.is_initialized():
            return
        address = os.environ.get("RAY_ADDRESS", "auto")
        advice = ("start one with `ray start --head` (and `ray start --address=HEAD:6379` on the "
                  "other hosts), set RAY_ADDRESS, or use --distributed-executor-backend mp on "
                  "one host")
        unreachable = _unreachable(address)
        if unreachable:
            # Ray itself would retry for minutes before giving up.
            raise RuntimeError(f"cannot reach a Ray cluster at {address!r} ({unreachable}): "
                               f"{advice}")
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RuntimeError(
                f"cannot reach a Ray cluster at {address!r} ({exc}): {advice}") from None

    def _place(self, ray: Any) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = self._device_type() == "cuda"
        bundle = {"GPU": 1.0} if gpu else {"CPU": 1.0}
        self._placement_group = placement_group([dict(bundle)] * self.world_size,
                                                strategy="PACK")
        ready, _ = ray.wait([self._placement_group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"the Ray cluster cannot place {self.world_size} workers of {bundle}: it has "
                f"{ray.cluster_resources()}; add hosts or lower --tensor-parallel-size x "
                "--pipeline-parallel-size")
        actor_cls = ray.remote(_RayWorker)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._placement_group, placement_group_bundle_index=rank)
            options = {"num_gpus": 1} if gpu else {"num_cpus": 1}
            self._actors.append(actor_cls.options(
                scheduling_strategy=strategy, name=None, **options).remote(self.config, rank))
        init_method = ray.get(self._actors[0].rendezvous_address.remote())
        ray.get([actor.setup.remote(init_method) for actor in self._actors])
        logger.info("started %d Ray workers (%s each) at rendezvous %s", self.world_size,
                    bundle, init_method)

    def _device_type(self) -> str:
        from octavo.backends.selection import list_backends
        from octavo.plugins import get_plugin_manager

        for backend in list_backends(get_plugin_manager()):
            if backend.name == self.config.backend:
                return backend.device_type
        return "cpu"

    # ---- the Executor protocol (the steps: WorkerStepsExecutor) ----------------------------

    def check_health(self) -> None:
        import ray

        ray.get([actor.__ray_ready__.remote() for actor in self._actors], timeout=30)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        import ray

        if self._actors:
            try:
                ray.get([a.handle.remote(self._encoder.encode(WorkerShutdown()))
                         for a in self._actors], timeout=10)
            except Exception:  # noqa: BLE001 - best effort: the actors are killed below anyway
                pass
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors = []
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement_group)
            self._placement_group = None

    # ---- plumbing ------------------------------------------------------------------------

    def _send(self, message: WorkerInput) -> None:
        frame = self._encoder.encode(message)
        refs = [actor.handle.remote(frame) for actor in self._actors]
        self._output_refs.append(refs[self._output_rank])
        self._other_refs += [ref for rank, ref in enumerate(refs) if rank != self._output_rank]

    def _next_events(self) -> list[WorkerEvent]:
        import ray

        if not self._output_refs:
            self._fail("a step was never answered")
        self._check_others(ray)
        return self._get(ray, self._output_refs.pop(0))

    def _call(self, method: str, arg: int | None = None) -> list[int | None]:
        import ray

        frame = self._encoder.encode(WorkerCall(call_id=next(self._call_ids), method=method,
                                                arg=arg))
        refs = [actor.handle.remote(frame) for actor in self._actors]  # all ranks at once
        answers = [self._get(ray, ref) for ref in refs]
        values = []
        for events in answers:
            (event,) = [e for e in events if isinstance(e, WorkerCallResult)]
            if event.error is not None:
                self._fail(f"{method} failed on rank {event.rank}: {event.error}")
            values.append(event.value)
        return values

    def _check_others(self, ray: Any) -> None:
        """Surface a failure of a rank other than the output rank (its answers are only
        checked for errors)."""
        if not self._other_refs:
            return
        done, self._other_refs = ray.wait(self._other_refs, num_returns=len(self._other_refs),
                                          timeout=0)
        for ref in done:
            for event in self._get(ray, ref):
                if isinstance(event, WorkerStepResult) and event.error is not None:
                    self._fail(f"the step failed on {event.error}")

    def _get(self, ray: Any, ref: Any) -> list[WorkerEvent]:
        from ray.exceptions import RayActorError, RayTaskError

        try:
            frames = ray.get(ref)
        except (RayActorError, RayTaskError) as exc:
            self._fail(f"a Ray worker failed ({type(exc).__name__})")
        return [self._decoder.decode(frame) for frame in frames]

    def _fail(self, reason: str) -> NoReturn:
        """Stop every actor and raise; an actor that died is named first (the others usually
        fail because of it, in a collective with a dead peer)."""
        dead = [f"Ray worker rank {rank} died" for rank in self._dead_ranks()]
        if dead:
            reason = f"{'; '.join(dead)}; then {reason}"
        logger.error("distributed execution failed: %s; stopping every Ray worker", reason)
        self.shutdown()
        raise WorkerDiedError(reason)

    def _dead_ranks(self) -> list[int]:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        refs = [actor.__ray_ready__.remote() for actor in self._actors]
        dead = []
        for rank, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=2)
            except RayActorError:
                dead.append(rank)
            except GetTimeoutError:
                pass  # alive, busy
        return dead
