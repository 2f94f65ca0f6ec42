"""``Worker``: runs the model on one device. Backends subclass it for their device.

The base class owns the device-independent logic and the error messages (loading, KV-cache
sizing, stepping); a backend's subclass fills in ``init_device`` and, where it can replay
captured steps, ``make_graph_runner``. Returned to the executor by the ``octavo_worker_class``
hook (``create_worker``).
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pluggy
import torch

from octavo.backends.capabilities import check_head_dim
from octavo.config import EngineConfig
from octavo.distributed.parallel_state import (
    ParallelRanks,
    ParallelState,
    destroy_parallel_state,
    init_parallel_state,
)
from octavo.messages import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from octavo.worker.async_output import StepOutput
from octavo.worker.graph_runner import GraphRunner
from octavo.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def host_memory_bytes() -> int:
    """Physical memory of this host in bytes (0 when the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def create_worker(config: EngineConfig, pm: pluggy.PluginManager, rank: int = 0,
                  distributed_init_method: str | None = None,
                  local_rank: int | None = None) -> Worker:
    """The selected backend's worker (``octavo_worker_class``) for ``rank``, constructed, not
    started (see ``Worker`` for the order of the calls that start it)."""
    worker_cls = pm.hook.octavo_worker_class(
        backend=config.backend, parallel_config=config.parallel_config
    )
    if worker_cls is None:
        raise RuntimeError(
            f"backend {config.backend!r} provides no worker class (octavo_worker_class "
            "returned None); the backend package is incomplete"
        )
    if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
        raise TypeError(
            f"octavo_worker_class for backend {config.backend!r} returned {worker_cls!r}, "
            "which is not a subclass of octavo.worker.worker.Worker"
        )
    return worker_cls(config, pm, rank=rank, distributed_init_method=distributed_init_method,
                      local_rank=local_rank)


class Worker:
    """One device's model runner, KV cache and profiling: one rank of the model.

    The executor starts it in this order: ``init_device`` (the backend binds its device:
    ``local_rank`` says which), ``init_distributed`` (joins the other ranks), ``load_model``
    (this rank's part of the weights), ``determine_num_blocks`` and ``initialize_cache``
    (with the smallest count over the ranks), then steps.

    :param rank: this worker's global rank (0 for a model on one device).
    :param distributed_init_method: the ranks' rendezvous (``tcp://host:port``); ``None`` for
        one rank.
    :param local_rank: the index of this rank's device among those its process sees (default:
        ``rank``; a Ray actor that sees only its own GPU uses 0).
    """

    def __init__(self, config: EngineConfig, pm: pluggy.PluginManager, rank: int = 0,
                 distributed_init_method: str | None = None,
                 local_rank: int | None = None) -> None:
        self.config = config
        self.pm = pm
        parallel = config.parallel_config
        self.ranks = ParallelRanks(rank, parallel.tensor_parallel_size,
                                   parallel.pipeline_parallel_size)
        self.local_rank = rank if local_rank is None else local_rank
        self.distributed_init_method = distributed_init_method
        self.parallel = ParallelState.single()
        self.device = torch.device("cpu")
        self.model_runner: ModelRunner | None = None

    # ---- to be specialised by backends --------------------------------------------------

    def init_device(self) -> None:
        """Pick and prepare the device (threads, streams, ...). Sets ``self.device``."""

    def make_graph_runner(self) -> GraphRunner | None:
        """Capture what this device can replay, once the KV cache exists; ``None``: run every
        step eagerly (the default). Called by ``initialize_cache``."""
        return None

    def row_ladder_sizes(self) -> list[int] | None:
        """Row counts to round the step's GEMMs up to (``octavo.worker.row_ladder``: the LM
        head's sampled rows, warmed once the KV cache exists, and, where the backend's
        kernels treat padding tokens as inert, eager steps' token counts); ``None``: no
        rounding (the default)."""
        return None

    # ---- common logic ------------------------------------------------------------------

    def init_distributed(self) -> None:
        """Join the other ranks (after ``init_device``); a no-op for one rank."""
        if self.ranks.world_size == 1:
            return
        if self.distributed_init_method is None:
            raise RuntimeError("a worker of a split model needs distributed_init_method")
        self.parallel = init_parallel_state(
            self.ranks, self.config.dist_backend, self.distributed_init_method, self.device)

    @property
    def model(self) -> torch.nn.Module:
        assert self.model_runner is not None, "load_model() must run first"
        return self.model_runner.model

    def load_model(self) -> None:
        """Ask the backend for its attention implementation and load the weights."""
        config = self.config
        attn_backend = self.pm.hook.octavo_attention_backend(
            backend=config.backend,
            model_config=config.model_config,
            cache_config=config.cache_config,
        )
        if attn_backend is None:
            raise RuntimeError(
                f"backend {config.backend!r} provides no attention implementation "
                "(octavo_attention_backend returned None)"
            )
        # The backend's declared head sizes were checked at start-up; a plugin may have
        # replaced its kernels, so the implementation actually chosen is checked too.
        check_head_dim(config.backend, config.model_config.head_dim,
                       attn_backend.supported_head_dims(), kernel=attn_backend.name)
        spec = config.speculative_config
        if spec is not None and spec.uses_draft_model:  # the draft runs on the same kernels
            check_head_dim(config.backend, spec.draft_model_config.head_dim,
                           attn_backend.supported_head_dims(), kernel=attn_backend.name)
        torch.manual_seed(config.model_config.seed)  # every rank draws the same samples
        self.model_runner = ModelRunner(config, self.device, attn_backend, self.pm, self.parallel)
        self.model_runner.load_model()

    def profile_run(self) -> None:
        """Run the largest step the scheduler may build, to measure peak activation memory."""
        assert self.model_runner is not None
        self.model_runner.profile_run()

    def kv_cache_bytes_per_block(self) -> int:
        assert self.model_runner is not None
        return self.model_runner.kv_cache_bytes_per_block()

    def max_useful_kv_cache_bytes(self) -> int:
        """The most KV cache the scheduler could ever fill: ``max_num_seqs`` sequences of
        ``max_model_len`` tokens (memory sizing caps its budget at this)."""
        config = self.config
        max_tokens = config.scheduler_config.max_num_seqs * config.model_config.max_model_len
        num_blocks = -(-max_tokens // config.cache_config.block_size)
        return num_blocks * self.kv_cache_bytes_per_block()

    def determine_num_blocks(self) -> int:
        """Number of KV blocks: the override if set, else the backend's memory budget."""
        cache = self.config.cache_config
        model = self.config.model_config
        per_block = self.kv_cache_bytes_per_block()
        if cache.num_gpu_blocks_override is not None:
            num_blocks = cache.num_gpu_blocks_override
        else:
            available = self.pm.hook.octavo_available_kv_cache_memory(
                backend=self.config.backend, worker=self, cache_config=cache
            )
            if available is None:
                raise RuntimeError(
                    f"backend {self.config.backend!r} did not size the KV cache "
                    "(octavo_available_kv_cache_memory returned None)"
                )
            num_blocks = int(available) // per_block
            if num_blocks < 1:
                raise RuntimeError(
                    f"no memory left for the KV cache on {self.device}: {available} bytes "
                    f"available, one block needs {per_block}. Free memory, lower max_model_len, "
                    "or set kv_cache_memory_bytes."
                )
        tokens = num_blocks * cache.block_size
        logger.info(
            "backend %s: %d KV blocks of %d tokens (kv cache dtype %s, %.2f GiB, %d tokens, "
            "max concurrency %.1f at %d tokens per request)",
            self.config.backend, num_blocks, cache.block_size,
            str(self.model_runner.kv_cache_dtype).removeprefix("torch."),
            num_blocks * per_block / 2**30, tokens, tokens / model.max_model_len,
            model.max_model_len,
        )
        return num_blocks

    def determine_num_host_blocks(self) -> int:
        """Blocks of the host pool for swapped-out requests: ``swap_space`` GiB divided by the
        bytes of one of this rank's blocks. Refuses a pool that would take most of the host's
        memory, or that holds not even one block."""
        cache = self.config.cache_config
        per_block = self.kv_cache_bytes_per_block()
        wanted = cache.swap_space_bytes
        total = host_memory_bytes()
        if total and wanted > 0.7 * total:
            raise ValueError(
                f"--swap-space {cache.swap_space} GiB per device is more than 70% of this "
                f"host's {total / 2**30:.1f} GiB of memory; lower --swap-space")
        num_blocks = wanted // per_block
        if num_blocks < 1:
            raise ValueError(
                f"--swap-space {cache.swap_space} GiB holds no KV block ({per_block} bytes "
                "each); raise --swap-space or use --preemption-mode recompute")
        logger.info("swap space: %d host KV blocks (%.2f GiB) on %s", num_blocks,
                    num_blocks * per_block / 2**30, self.device)
        return num_blocks

    def initialize_host_cache(self, num_blocks: int) -> None:
        """Allocate the host block pool (pinned for a GPU), after ``initialize_cache``."""
        assert self.model_runner is not None
        self.model_runner.initialize_host_cache(num_blocks)

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, then let the backend capture what it can replay (and warm
        the LM head's row counts, where the worker rounds GEMM rows)."""
        assert self.model_runner is not None
        self.model_runner.initialize_kv_cache(num_blocks)
        self.model_runner.graph_runner = self.make_graph_runner()
        sizes = self.row_ladder_sizes()
        if sizes:
            self.model_runner.use_row_ladder(
                sizes, pad_eager_steps=self.config.backend_capabilities.cuda_graphs)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.model_runner is not None
        return self.model_runner.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepOutput:
        """Launch a step; see ``ModelRunner.execute_model_async`` for the contract."""
        assert self.model_runner is not None
        return self.model_runner.execute_model_async(scheduler_output)

    def sample_tokens(self, grammar_bitmask: GrammarBitmask | None) -> None:
        """Launch the sampling of a step launched with ``sampling_deferred``."""
        assert self.model_runner is not None
        self.model_runner.sample_tokens(grammar_bitmask)

    def use_grammar_mask_buffers(self, buffers: np.ndarray) -> None:
        """The engine core's grammar mask buffers (``SharedMasks.array``), mapped in this
        process: the runner page-locks them where the device copies from locked memory, and
        uploads a step's masks from there without staging (``GrammarMaskUpload``). Call after
        ``load_model``."""
        assert self.model_runner is not None
        self.model_runner.grammar_masks.use_host_buffers(buffers)

    def discard_in_flight(self) -> None:
        """Forget launched steps whose results will never be taken."""
        if self.model_runner is not None:
            self.model_runner.discard_in_flight()

    def shutdown(self) -> None:
        self.model_runner = None
        if self.ranks.world_size > 1:
            destroy_parallel_state()
