"""``ModelRunner``: turns a ``SchedulerOutput`` into one forward pass and one sampler call.

It keeps a small state per request (tokens, blocks, progress) updated from the scheduler's
"what changed" messages, builds the flat batch (token ids, positions, slot mapping, block
tables), runs the model, computes logits only where they are needed (the last token of each
sequence that samples, and prompt positions that asked for prompt logprobs) and samples the
whole batch in one call.

``execute_model_async`` launches a step and returns before its tokens are read back; a later
step may then take a request's next input straight from the device tensor of tokens the
previous step sampled (see ``octavo.worker.async_output``). ``execute_model`` is the same,
waited for.

Structured outputs: a step's ``grammar_bitmask`` masks the logits of its constrained rows
before sampling. When the masks need a token still in flight (async scheduling), the step
comes with ``sampling_deferred``: its forward pass is launched at once and its sampling by
``sample_tokens`` once the engine core has the masks, so the device runs the forward pass while
the host computes them. The next step may arrive before that call: it is prepared at once and
launched by ``sample_tokens``, right after the sampling it may read tokens from.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pluggy
import torch

from octavo.attention.base import AttentionBackend, AttentionMetadata
from octavo.config import EngineConfig, kv_cache_torch_dtype
from octavo.distributed.parallel_state import ParallelState
from octavo.kernels.argmax import argmax_rows
from octavo.lora.manager import LoRAManager
from octavo.lora_request import LoRARequest
from octavo.messages import GrammarBitmask, LogprobsLists, ModelRunnerOutput, SchedulerOutput
from octavo.model_executor.layers.attention import Attention
from octavo.model_executor.model_loader import load_model
from octavo.model_executor.models.interfaces import IntermediateTensors
from octavo.sample.logits_processor import LogitsProcessorRegistry
from octavo.sample.logprobs import LogprobsTensors, compute_logprobs
from octavo.sample.metadata import SamplingMetadata, SamplingRow
from octavo.sample.sampler import Sampler, SamplerOutput, mask_by_bitmask
from octavo.sampling_params import SamplingParams
from octavo.spec_decode.proposals import params_may_speculate
from octavo.spec_decode.rejection_sampler import rejection_sample, target_distribution
from octavo.transfer import DeviceToHostCopy, host_to_device
from octavo.worker.async_output import (
    DeferredStepOutput,
    PendingStepOutput,
    PreparedStepOutput,
    StepOutput,
)
from octavo.worker.block_table import BlockTable
from octavo.worker.decode_rows import DecodeRows
from octavo.worker.draft_model import DraftBatch, DraftModelProposer, DraftRequest
from octavo.worker.eagle import Eagle3Proposer, EagleProposer
from octavo.worker.grammar_masks import GrammarMaskUpload
from octavo.worker.graph_runner import GraphRunner
from octavo.worker.kv_block_mover import KVBlockMover, default_kv_block_mover
from octavo.worker.pipeline import StageIO
from octavo.worker.row_ladder import RowLadder, pad_step, padded_logits, warm_up_logits


#: Prompt positions whose logits a step computes at once for prompt logprobs.
PROMPT_LOGPROBS_SLICE = 2048

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CachedRequestState:
    """The runner's view of one request."""

    # Request id.
    req_id: str
    # Number of prompt tokens at the front of token_ids.
    num_prompt_tokens: int
    # Prompt followed by the generated tokens.
    token_ids: list[int]
    # The prompt alone and the generated tokens alone (kept beside token_ids so the sampler
    # gets them without copying long lists every step).
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Sampling settings (this completion's own: its seed is the effective one).
    sampling_params: SamplingParams
    # KV blocks, in order.
    block_ids: list[int]
    # Tokens already in the KV cache.
    num_computed_tokens: int
    # This request's row in the runner's BlockTable (the same ids as block_ids).
    block_table_row: int = -1
    # Greedy with nothing but a grammar changing the logits, and no logprobs: the argmax of
    # the (grammar-masked) logits is the whole sampler.
    greedy_after_grammar: bool = False
    # Penalties (bad words, logits processors) need every generated token id on the host
    # before sampling.
    needs_token_history: bool = False
    # The scheduler chooses its tokens (a beam): what this worker samples is not appended.
    tokens_from_scheduler: bool = False
    # Its LoRA adapter (None: the base model).
    lora_request: LoRARequest | None = None


def pending_in_order(num_tokens: int, sampled_rows: np.ndarray) -> bool:
    """Whether a step of ``num_tokens`` inputs, ``sampled_rows`` of them pending (each one's
    row in the last step's sampled tokens), has input i at row i for every i: its inputs are
    then those tokens' first rows."""
    return len(sampled_rows) == num_tokens and bool(
        (sampled_rows == np.arange(num_tokens)).all())


@dataclass(slots=True)
class _StepInputs:
    """The flat batch of one step, on the device."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    # Flat index of the last token of every request that samples this step, on the device
    # (indexing with a host list would copy it synchronously, waiting for the whole stream).
    sample_indices: torch.Tensor
    # Per sampling request: its token count once this step's input is in (prompt + output).
    num_tokens_before_sample: list[int]
    # Request ids in step order.
    req_ids: list[str]
    # Which requests sample (parallel to req_ids).
    samples: list[bool]
    # The BlockTable rows of the requests that sample, in sample order (forks included).
    sample_rows: np.ndarray
    # Prompt-logprob positions per request id: (flat indices, target token ids).
    prompt_logprob_positions: dict[str, tuple[list[int], list[int]]]
    # Speculative decoding: per sampling request (in sample order), the draft tokens it
    # verifies ([]: none; it then has one row in sample_indices, else 1 + len(drafts));
    # None when no request of the step has drafts.
    spec_drafts: list[list[int]] | None = None
    # Inputs still on the device: their flat indices and their rows in the previous step's
    # sampled tokens, read into input_ids just before the forward pass (``_read_pending``),
    # so that the rest of the inputs can be built before that step's sampling is launched.
    pending_inputs: tuple[torch.Tensor, torch.Tensor] | None = None
    # sample_indices is 0, 1, ..., k - 1 (a decode step): the sampled rows are the first k
    # rows of the hidden states, a view (no gather kernel).
    samples_first_rows: bool = False
    # Every input is pending and input i is row i of the previous step's sampled tokens (a
    # steady decode): the inputs are a view of those tokens (no gather and scatter kernels).
    pending_in_order: bool = False

    def sampled_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states of the rows that sample, in sample order."""
        if self.samples_first_rows:
            return hidden[: len(self.sample_rows)]
        return hidden[self.sample_indices]


@dataclass(slots=True)
class _SamplePlan:
    """A step's sampling bookkeeping, taken when its forward pass is launched: who samples,
    who owns their rows then, and where the next step finds their tokens. The sampling may be
    launched later (``sampling_deferred``), after the next step's requests were updated."""

    # The requests that sample, in sample order, and their places among the step's requests
    # (a range when every request samples).
    states: list[CachedRequestState]
    step_rows: list[int] | range
    # Which of them append what they sample (None: all).
    appends: np.ndarray | None
    # Their rows' owners (``DecodeRows.epoch``) and ``DecodeRows.num_claims`` at the launch.
    epochs: np.ndarray
    num_claims: int
    # The requests that asked for prompt logprobs, with how many top logprobs each.
    prompt_logprobs: list[tuple[str, int]]

    def sampled_req_ids(self, inputs: _StepInputs) -> list[str]:
        """The ids of ``states``, in order (the step's own list when every request samples:
        no per-row list built for each constrained step's masks)."""
        if isinstance(self.step_rows, range):
            return inputs.req_ids
        return [state.req_id for state in self.states]


class ModelRunner:
    """Holds the model, its KV cache and the per-request state on one device."""

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        attn_backend: AttentionBackend,
        pm: pluggy.PluginManager,
        parallel: ParallelState | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self.attn_backend = attn_backend
        self.pm = pm
        # This rank's place in a split model (one rank: every collective is the identity).
        self.parallel = parallel or ParallelState.single()
        self.stage_io: StageIO | None = None
        # With pipeline parallelism the last stage samples, but every stage needs the tokens:
        # they all take them from the scheduler (CachedRequestData.new_token_ids) instead of
        # appending what they sampled.
        self.tokens_from_scheduler = self.parallel.ranks.pp_size > 1
        self.model_config = config.model_config
        self.block_size = config.cache_config.block_size
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        # Host block pool of swapped-out requests, per layer (empty without swap space).
        self.host_kv_caches: list[torch.Tensor] = []
        # Moves whole blocks (swaps, copies-on-write); set with the KV cache.
        self.kv_block_mover: KVBlockMover | None = None
        self.requests: dict[str, CachedRequestState] = {}
        # Block ids of every request in self.requests, one persistent row each.
        self.block_table = BlockTable(
            num_rows=config.scheduler_config.max_num_seqs,
            num_cols=-(-config.model_config.max_model_len // self.block_size),
        )
        # Per request (by its block-table row): what a pure-decode step's inputs are made of.
        self.decode_rows = DecodeRows(config.scheduler_config.max_num_seqs)
        # Build pure-decode steps from decode_rows (False: always the general loop; tests
        # compare the two).
        self.vectorised_decode = True
        # Live requests that ask for prompt logprobs, and those whose tokens the scheduler
        # chooses (beams): while there are any, every step takes the general loop.
        self._prompt_logprob_req_ids: set[str] = set()
        self._scheduler_token_req_ids: set[str] = set()
        self.sampler = Sampler(LogitsProcessorRegistry(pm))
        # The grammar masks of every sampling path, staged in pinned buffers kept across
        # steps.
        self.grammar_masks = GrammarMaskUpload(device, config.scheduler_config.max_num_seqs)
        # The last launched step; its sampled tokens may not be on the host yet.
        self._last_step: StepOutput | None = None
        # A launched step waiting for sample_tokens: its output, hidden states, inputs and
        # sampling plan.
        self._deferred: tuple[DeferredStepOutput, torch.Tensor, _StepInputs,
                              _SamplePlan] | None = None
        # A step prepared while _deferred waits, launched by sample_tokens: its scheduler
        # output, inputs and the output that stands for it.
        self._prepared: tuple[SchedulerOutput, _StepInputs, PreparedStepOutput] | None = None
        # Replays captured steps where it can (set by the worker once the KV cache exists;
        # see Worker.make_graph_runner); None: every step runs eagerly.
        self.graph_runner: GraphRunner | None = None
        # GEMM row counts rounded up to a ladder (set by GPU workers through use_row_ladder;
        # see octavo.worker.row_ladder): the LM head's sampled rows, and the token count of
        # eager steps when padding tokens are inert (pad_eager_steps). None: as they are.
        self.row_ladder: RowLadder | None = None
        self.pad_eager_steps = False
        # The adapters' device slots (--enable-lora), set by load_model.
        self.lora_manager: LoRAManager | None = None
        # Speculative decoding with a draft model (set by load_model): it runs over every
        # step's tokens and proposes after each step (octavo.worker.draft_model).
        self.drafter: DraftModelProposer | None = None
        # Per request with sampled drafts: the draft distributions its pending drafts were
        # drawn from ([k, vocab]), the rejection sampler's q when they are verified.
        self._draft_probs: dict[str, torch.Tensor] = {}

    # ---- set-up ------------------------------------------------------------------------

    def load_model(self) -> None:
        self.model = load_model(self.model_config, self.attn_backend, self.device, self.pm,
                                self.parallel, backend=self.config.backend)
        if self.config.lora_config is not None:
            self.lora_manager = LoRAManager(self.model, self.config.lora_config,
                                            self.model_config.hf_config, self.model_config.dtype,
                                            self.device)
        spec = self.config.speculative_config
        if spec is not None and spec.uses_draft_model:
            # Whole on every rank (replicated, not split): each rank proposes the same drafts
            # from the same tokens, as each runs the same rejection sampler.
            args = (spec.draft_model_config, self.attn_backend, self.device, self.pm,
                    self.config.backend, spec.num_speculative_tokens, self.block_size)
            if spec.method == "eagle3":
                # The target's aux hidden states fill a buffer of its largest forward: the
                # token budget, or a captured verification graph's padded batch.
                sched = self.config.scheduler_config
                max_tokens = max(sched.max_num_batched_tokens,
                                 sched.max_num_seqs * (1 + spec.num_speculative_tokens))
                self.drafter = Eagle3Proposer(*args, target=self.model, max_tokens=max_tokens)
            elif spec.method == "eagle":
                self.drafter = EagleProposer(*args, target=self.model)
            else:
                self.drafter = DraftModelProposer(*args)
            self.drafter.load_model()
        if self.parallel.ranks.pp_size > 1:
            self.stage_io = StageIO(self.parallel, self.model_config.hf_config.hidden_size,
                                    self.model_config.dtype, self.device)

    def _kv_cache_layout(self) -> tuple[int, int, int]:
        """(attention layers, KV heads, head size) of this rank: its stage's layers and its
        share of the KV heads."""
        assert self.model is not None, "load_model() must run first"
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        assert layers, f"{type(self.model).__name__} has no attention layer"
        return len(layers), layers[0].num_kv_heads, layers[0].head_dim

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """Element type of the KV cache: the model's, or e4m3 with --kv-cache-dtype fp8."""
        return kv_cache_torch_dtype(self.config.cache_config.cache_dtype, self.model_config.dtype)

    def kv_cache_bytes_per_block(self) -> int:
        num_layers, num_kv_heads, head_dim = self._kv_cache_layout()
        shape = self.attn_backend.get_kv_cache_shape(1, self.block_size, num_kv_heads, head_dim)
        element_size = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        draft = 0 if self.drafter is None else self.drafter.kv_cache_bytes_per_block(
            self.kv_cache_dtype)
        return int(np.prod(shape)) * element_size * num_layers + draft

    def initialize_kv_cache(self, num_blocks: int) -> None:
        num_layers, num_kv_heads, head_dim = self._kv_cache_layout()
        shape = self.attn_backend.get_kv_cache_shape(num_blocks, self.block_size, num_kv_heads,
                                                     head_dim)
        # Uninitialised on purpose (zeroing gigabytes costs seconds): kernels never read a
        # slot that was not written (see octavo.attention.base).
        dtype = self.kv_cache_dtype
        self.kv_caches = [
            torch.empty(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks, dtype)
        mover = self.pm.hook.octavo_kv_block_mover(
            backend=self.config.backend, attn_backend=self.attn_backend, device=self.device)
        self.kv_block_mover = mover or default_kv_block_mover(self.attn_backend, self.device)

    def initialize_host_cache(self, num_blocks: int) -> None:
        """Allocate the host block pool of swapped-out requests (after the KV cache)."""
        assert self.kv_block_mover is not None, "initialize_kv_cache() must run first"
        self.host_kv_caches = self.kv_block_mover.allocate_host_cache(self._all_kv_caches(),
                                                                      num_blocks)

    def _all_kv_caches(self) -> list[torch.Tensor]:
        """Every KV layer over the blocks: the target's, then the draft model's."""
        if self.drafter is None:
            return self.kv_caches
        return self.kv_caches + self.drafter.kv_caches

    def _move_blocks(self, so: SchedulerOutput) -> None:
        """The step's block moves, before its forward: swap-outs, copies, swap-ins."""
        if not (so.blocks_to_swap_out or so.blocks_to_copy or so.blocks_to_swap_in):
            return
        mover = self.kv_block_mover
        assert mover is not None, "initialize_kv_cache() must run first"
        if so.blocks_to_swap_out or so.blocks_to_swap_in:
            assert self.host_kv_caches, "the scheduler swaps but no host cache was allocated"
        caches = self._all_kv_caches()
        mover.swap_out(caches, self.host_kv_caches, so.blocks_to_swap_out)
        mover.copy(caches, so.blocks_to_copy)
        mover.swap_in(self.host_kv_caches, caches, so.blocks_to_swap_in)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 metadata: AttentionMetadata) -> torch.Tensor | None:
        """This rank's part of the forward: the hidden states on the last pipeline stage,
        ``None`` on the others (which hand their output to the next stage)."""
        if self.stage_io is None:
            return self.model(input_ids, positions, self.kv_caches, metadata)
        intermediate = self.stage_io.receive(input_ids.shape[0])
        out = self.model(input_ids, positions, self.kv_caches, metadata, intermediate)
        if self.stage_io.is_last:
            return out
        self.stage_io.send(out)
        return None

    @torch.inference_mode()
    def profile_run(self) -> None:
        """Forward the largest single step (token budget, capped at max_model_len) once.

        Uses a temporary KV cache just big enough for it; logits for ``max_num_seqs`` rows.
        """
        sched = self.config.scheduler_config
        num_tokens = min(sched.max_num_batched_tokens, self.model_config.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        saved = self.kv_caches
        self.initialize_kv_cache(num_blocks)
        try:
            positions = torch.arange(num_tokens, device=self.device)
            metadata = self._build_metadata(
                slot_mapping=positions.clone(),
                query_start_loc=[0, num_tokens],
                seq_lens=[num_tokens],
                block_tables=np.arange(num_blocks, dtype=np.int32)[None, :],
            )
            input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            if self.stage_io is None:
                hidden = self.model(input_ids, positions, self.kv_caches, metadata)
            else:  # each stage alone: zeros stand in for the previous stage's output
                hidden_size = self.model_config.hf_config.hidden_size
                zeros = torch.zeros(num_tokens, hidden_size, dtype=self.model_config.dtype,
                                    device=self.device)
                intermediate = None if self.stage_io.is_first else IntermediateTensors(
                    zeros, zeros.clone())
                hidden = self.model(input_ids, positions, self.kv_caches, metadata,
                                    intermediate)
            if self.stage_io is None or self.stage_io.is_last:
                rows = min(sched.max_num_seqs, num_tokens)
                self.model.compute_logits(hidden[:rows])
            if self.drafter is not None:
                self.drafter.profile_run(input_ids, positions, metadata, num_blocks,
                                         self.kv_cache_dtype)
        finally:
            self.kv_caches = saved

    def use_row_ladder(self, sizes: list[int], pad_eager_steps: bool) -> None:
        """Round the LM head's sampled rows up to ``sizes`` (geometrically past the largest),
        warming the head at each size now (after the KV cache exists); with
        ``pad_eager_steps`` (the attention kernels skip padding tokens, as CUDA graphs need)
        also the token count of steps that run eagerly."""
        self.row_ladder = RowLadder(sizes)
        self.pad_eager_steps = pad_eager_steps
        if self.stage_io is None or self.stage_io.is_last:
            warm_up_logits(self.row_ladder, self.model.compute_logits,
                           self.model_config.hf_config.hidden_size, self.model_config.dtype,
                           self.device)

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's float32 logits of ``hidden``'s rows (through the row ladder, if any)."""
        if self.row_ladder is None:
            return self.model.compute_logits(hidden)
        return padded_logits(self.row_ladder, self.model.compute_logits, hidden)

    def _eager_forward(self, inputs: _StepInputs) -> torch.Tensor | None:
        """``_forward`` of a step no graph runs; its token count padded up to the row ladder
        where that is on and safe (not with LoRA, whose mapping is per real token, nor with a
        draft model or pipeline stages, which read the step's tokens themselves)."""
        if (not self.pad_eager_steps or self.row_ladder is None
                or self.lora_manager is not None or self.drafter is not None
                or self.stage_io is not None):
            return self._forward(inputs.input_ids, inputs.positions, inputs.metadata)
        input_ids, positions, metadata = pad_step(self.row_ladder, inputs.input_ids,
                                                  inputs.positions, inputs.metadata)
        hidden = self._forward(input_ids, positions, metadata)
        return hidden[: inputs.metadata.num_tokens]

    # ---- one step ----------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and return its results."""
        return self.execute_model_async(scheduler_output).result()

    @torch.inference_mode()
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepOutput:
        """Launch one step; its results are read back when ``result()`` is called.

        Contract: steps are launched in schedule order, and step N's result is taken before
        step N+2 is launched (at most one step in flight behind the one being launched). A
        step with ``sampling_deferred`` samples when ``sample_tokens`` is called, which must
        come before its result is taken. The next step may come before that call: it is then
        prepared at once (requests updated, inputs built and their copies queued) and
        launched by ``sample_tokens``, right after that sampling (its inputs may be tokens
        that sampling picks), so its host work runs while the grammar masks are computed.
        """
        assert self._prepared is None, "a prepared step was never launched (sample_tokens)"
        if self._last_step is not None:
            self._last_step.wait_previous()  # keeps at most one step in flight behind this one
        self._update_states(scheduler_output)
        self._move_blocks(scheduler_output)
        if scheduler_output.is_empty:
            return PendingStepOutput.ready(ModelRunnerOutput())
        inputs = self._prepare_inputs(scheduler_output)
        if self._deferred is not None:
            prepared = PreparedStepOutput()
            self._prepared = (scheduler_output, inputs, prepared)
            return prepared
        return self._launch(scheduler_output, inputs)

    def _launch(self, scheduler_output: SchedulerOutput, inputs: _StepInputs) -> StepOutput:
        """Launch a prepared step: its forward pass, then its sampling unless deferred."""
        lora_step = self._prepare_lora(scheduler_output, inputs.req_ids)
        self._read_pending(inputs)
        try:
            if self.graph_runner is not None and self.graph_runner.can_run(inputs.metadata):
                hidden = self.graph_runner.run(inputs.input_ids, inputs.positions,
                                               inputs.metadata)
            else:
                hidden = self._eager_forward(inputs)
        finally:
            if lora_step:
                self.lora_manager.finish_step()
        step: StepOutput
        if hidden is None:  # a pipeline stage before the last: nothing sampled here
            step = PendingStepOutput.ready(ModelRunnerOutput(
                req_ids=inputs.req_ids, sampled_token_ids=[[] for _ in inputs.req_ids]))
        elif inputs.spec_drafts is not None:
            assert not scheduler_output.sampling_deferred, "speculation runs without async"
            step = self._sample_speculative(hidden, inputs, scheduler_output)
        elif scheduler_output.sampling_deferred:
            step = DeferredStepOutput(self._last_step)
            self._deferred = (step, hidden, inputs, self._plan_sampling(inputs))
        else:
            step = self._sample(hidden, inputs, self._plan_sampling(inputs), self._last_step,
                                scheduler_output.grammar_bitmask)
        self._last_step = step
        return step

    @torch.inference_mode()
    def sample_tokens(self, grammar_bitmask: GrammarBitmask | None) -> None:
        """Launch the sampling of the step launched with ``sampling_deferred``, masked by
        ``grammar_bitmask``, then the step prepared meanwhile, if any. Without such a step (a
        pipeline stage that does not sample, or an empty step) it does nothing."""
        if self._deferred is None:
            return
        step, hidden, inputs, plan = self._deferred
        self._deferred = None
        step.attach(self._sample(hidden, inputs, plan, step.previous, grammar_bitmask))
        if self._prepared is not None:
            scheduler_output, inputs, prepared = self._prepared
            self._prepared = None
            prepared.attach(self._launch(scheduler_output, inputs))

    def discard_in_flight(self) -> None:
        """Forget launched steps whose results will never be taken (the engine discarded
        them after an error); their requests' states are dropped by the next step."""
        self._last_step = None
        self._deferred = None
        self._prepared = None

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self._forget(req_id)
        for new in so.scheduled_new_reqs:
            self._forget(new.req_id)  # only if still known: re-added without being finished
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                num_prompt_tokens=len(new.prompt_token_ids),
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                prompt_token_ids=list(new.prompt_token_ids),
                output_token_ids=list(new.output_token_ids),
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                block_table_row=self.block_table.add_row(new.block_ids),
                greedy_after_grammar=new.sampling_params.is_greedy_after_grammar,
                needs_token_history=new.sampling_params.needs_output_token_ids,
                tokens_from_scheduler=new.tokens_from_scheduler,
                lora_request=new.lora_request,
            )
            self._track(self.requests[new.req_id])
        cached = so.scheduled_cached_reqs
        requests = self.requests
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            requests[req_id].num_computed_tokens = num_computed
        for req_id, token_ids in cached.new_token_ids.items():
            state = requests[req_id]
            if self.tokens_from_scheduler or state.tokens_from_scheduler:
                state.token_ids.extend(token_ids)
                state.output_token_ids.extend(token_ids)
                self.decode_rows.sync(state.block_table_row, state.token_ids)
        for req_id, replaced in cached.replaced_block_ids.items():
            state = requests[req_id]
            for index, block_id in replaced:
                state.block_ids[index] = block_id
                self.block_table.replace(state.block_table_row, index, block_id)
        for req_id, block_ids in cached.new_block_ids.items():
            state = requests[req_id]
            state.block_ids.extend(block_ids)
            self.block_table.append(state.block_table_row, block_ids)
        for fork in so.forked_reqs:
            parent = self.requests[fork.parent_req_id]
            self._forget(fork.req_id)
            params = fork.sampling_params
            self.requests[fork.req_id] = CachedRequestState(
                req_id=fork.req_id,
                num_prompt_tokens=parent.num_prompt_tokens,
                token_ids=list(parent.token_ids),
                prompt_token_ids=parent.prompt_token_ids,
                output_token_ids=list(parent.output_token_ids),
                sampling_params=params,
                block_ids=list(fork.block_ids),
                num_computed_tokens=fork.num_computed_tokens,
                block_table_row=self.block_table.add_row(fork.block_ids),
                greedy_after_grammar=params.is_greedy_after_grammar,
                needs_token_history=params.needs_output_token_ids,
                lora_request=parent.lora_request,
            )
            self._track(self.requests[fork.req_id])

    def _track(self, state: CachedRequestState) -> None:
        """A request just added: its decode row, and whether it keeps steps general."""
        self.decode_rows.claim(state.block_table_row, state.token_ids)
        if state.sampling_params.prompt_logprobs is not None:
            self._prompt_logprob_req_ids.add(state.req_id)
        if state.tokens_from_scheduler:
            self._scheduler_token_req_ids.add(state.req_id)

    def _prepare_lora(self, so: SchedulerOutput, req_ids: list[str]) -> bool:
        """Put the step's adapters in slots and set their rows; whether any row has one."""
        if self.lora_manager is None:
            return False
        states = [self.requests[req_id] for req_id in req_ids if req_id in so.num_scheduled_tokens]
        if all(s.lora_request is None for s in states):
            return False
        in_use = {s.lora_request.lora_int_id for s in self.requests.values()
                  if s.lora_request is not None}
        self.lora_manager.prepare([s.lora_request for s in states],
                                  [so.num_scheduled_tokens[s.req_id] for s in states], in_use)
        return self.lora_manager.active

    def _forget(self, req_id: str) -> None:
        self._draft_probs.pop(req_id, None)
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.block_table.free_row(state.block_table_row)
            self._prompt_logprob_req_ids.discard(req_id)
            self._scheduler_token_req_ids.discard(req_id)

    def _prepare_inputs(self, so: SchedulerOutput) -> _StepInputs:
        if self._is_pure_decode(so):
            inputs = self._prepare_decode_inputs(so)
            if inputs is not None:
                return inputs
        req_ids = [r.req_id for r in so.scheduled_new_reqs] + so.scheduled_cached_reqs.req_ids
        # Per request, plain Python lists (per-request numpy calls cost more than the
        # arithmetic: this loop runs for every request every step); per token, numpy after
        # the loop: the input ids are one list (a prompt chunk adds a slice of its tokens in
        # one C-level extend), positions and slots are computed from the per-request ranges.
        input_ids: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        block_table_rows: list[int] = []
        sample_indices: list[int] = []
        sample_rows: list[int] = []
        num_tokens_before_sample: list[int] = []
        samples: list[bool] = []
        prompt_positions: dict[str, tuple[list[int], list[int]]] = {}
        # Forks sample the logits of their parent's last row: (flat index, tokens) per parent.
        sample_of: dict[str, tuple[int, int]] = {}
        # Inputs still on the device: flat index, and the request's block-table row (its row
        # in the last step's sampled tokens is in decode_rows).
        pending_flat: list[int] = []
        pending_rows: list[int] = []
        spec_tokens = so.scheduled_spec_decode_tokens
        # With a draft model every step samples through the speculative path (it proposes).
        spec_drafts: list[list[int]] | None = (
            [] if spec_tokens or self.drafter is not None else None)
        requests = self.requests
        num_scheduled = so.num_scheduled_tokens
        forking = bool(so.forked_reqs)
        for req_id in req_ids:
            state = requests[req_id]
            start = state.num_computed_tokens
            num_new = num_scheduled[req_id]
            end = start + num_new
            num_known = len(state.token_ids)
            if (num_new == 1 and not spec_tokens and not forking and spec_drafts is None
                    and state.sampling_params.prompt_logprobs is None):
                # A decode: the general body below, for this case alone (it runs for every
                # request every step).
                if start < num_known:
                    input_ids.append(state.token_ids[start])
                else:  # sampled by the step in flight: read it on the device
                    pending_flat.append(len(input_ids))
                    pending_rows.append(state.block_table_row)
                    input_ids.append(0)
                    num_known += 1
                flat_start = query_start_loc[-1]
                query_start_loc.append(flat_start + 1)
                seq_lens.append(end)
                block_table_rows.append(state.block_table_row)
                does_sample = end == num_known
                samples.append(does_sample)
                if does_sample:
                    sample_indices.append(flat_start)
                    num_tokens_before_sample.append(end)
                    sample_rows.append(state.block_table_row)
                continue
            drafts = spec_tokens.get(req_id, []) if spec_tokens else []
            if drafts:
                # The last known token, then the drafts: logits at every one of them.
                assert start + 1 == num_known and num_new == 1 + len(drafts), (
                    f"{req_id}: drafts must follow its last token")
                input_ids.append(state.token_ids[start])
                input_ids.extend(drafts)
                num_known = end
            elif num_new == 1:
                if start < num_known:
                    input_ids.append(state.token_ids[start])
                else:  # sampled by the step in flight: read it on the device
                    pending_flat.append(len(input_ids))
                    pending_rows.append(state.block_table_row)
                    input_ids.append(0)
                    num_known += 1
            else:
                assert end <= num_known, f"{req_id}: a chunk past its known tokens"
                input_ids.extend(state.token_ids[start:end])
            flat_start = query_start_loc[-1]
            query_start_loc.append(flat_start + num_new)
            seq_lens.append(end)
            block_table_rows.append(state.block_table_row)
            does_sample = end == num_known
            samples.append(does_sample)
            if does_sample:
                sample_indices.extend(range(flat_start + num_new - 1 - len(drafts),
                                            flat_start + num_new))
                num_tokens_before_sample.append(end - len(drafts))
                sample_rows.append(state.block_table_row)
                if spec_drafts is not None:
                    spec_drafts.append(drafts)
                if so.forked_reqs:
                    sample_of[req_id] = (flat_start + num_new - 1, end)
            if state.sampling_params.prompt_logprobs is not None:
                # Position p predicts prompt token p + 1.
                last = min(end, state.num_prompt_tokens - 1)
                if start < last:
                    flat = list(range(flat_start, flat_start + last - start))
                    targets = state.token_ids[start + 1 : last + 1]
                    prompt_positions[req_id] = (flat, targets)
        for fork in so.forked_reqs:
            flat_index, end = sample_of[fork.parent_req_id]
            req_ids.append(fork.req_id)
            samples.append(True)
            sample_indices.append(flat_index)
            num_tokens_before_sample.append(end)
            sample_rows.append(requests[fork.req_id].block_table_row)
            if spec_drafts is not None:
                spec_drafts.append([])
        num_tokens = len(input_ids)
        rows = np.array(block_table_rows, dtype=np.intp)
        positions, slots, num_blocks = self._positions_and_slots(rows, query_start_loc, seq_lens)
        sampled_rows = self.decode_rows.sampled_row[np.array(pending_rows, dtype=np.intp)]
        flat_host = np.concatenate([
            np.fromiter(input_ids, dtype=np.int64, count=num_tokens), positions, slots,
            np.array(pending_flat, dtype=np.int64), sampled_rows,
            np.array(sample_indices, dtype=np.int64)])
        token_ids, flat_positions, slot_mapping, flat_sample_indices, pending = (
            self._flat_to_device(flat_host, num_tokens, len(pending_flat)))
        block_tables = self.block_table.gather(rows, int(num_blocks.max()))
        metadata = self._build_metadata(slot_mapping, query_start_loc, seq_lens, block_tables)
        return _StepInputs(
            input_ids=token_ids,
            positions=flat_positions,
            metadata=metadata,
            sample_indices=flat_sample_indices,
            num_tokens_before_sample=num_tokens_before_sample,
            req_ids=req_ids,
            samples=samples,
            sample_rows=np.array(sample_rows, dtype=np.intp),
            prompt_logprob_positions=prompt_positions,
            spec_drafts=spec_drafts,
            pending_inputs=pending,
            pending_in_order=pending_in_order(num_tokens, sampled_rows),
        )

    def _positions_and_slots(self, rows: np.ndarray, query_start_loc: list[int],
                             seq_lens: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every token's position and KV cache slot (int64, ``[num_tokens]`` each) for
        requests at block-table ``rows`` that run tokens ``seq_len - query_len .. seq_len``
        each, in flat order; and each request's number of blocks.

        Vectorised: a prompt chunk of thousands of tokens costs a few array operations, not a
        Python loop over its tokens."""
        bounds = np.array(query_start_loc, dtype=np.int64)  # [num_reqs + 1]
        ends = np.array(seq_lens, dtype=np.int64)  # [num_reqs]
        query_lens = np.diff(bounds)
        num_blocks = self.block_table.num_blocks(rows)
        bs = self.block_size
        # A slot past a request's blocks would read another request's (or no) block.
        assert ((ends - 1) // bs < num_blocks).all(), (
            f"a request runs past its blocks: positions up to {(ends - 1).tolist()}, "
            f"blocks {num_blocks.tolist()} of {bs} tokens")
        # Flat index i of request r is position i + (end_r - query_start_loc[r + 1]).
        positions = (np.arange(bounds[-1], dtype=np.int64)
                     + np.repeat(ends - bounds[1:], query_lens))  # [num_tokens]
        token_rows = np.repeat(rows, query_lens)  # [num_tokens]
        slots = (self.block_table.block_ids_at(token_rows, positions // bs).astype(np.int64) * bs
                 + positions % bs)  # [num_tokens]
        return positions, slots, num_blocks

    def _is_pure_decode(self, so: SchedulerOutput) -> bool:
        """Whether every request of the step runs one token, with no new request, fork,
        draft, prompt logprobs or scheduler-chosen tokens anywhere (a few O(1) checks)."""
        return (self.vectorised_decode and not so.scheduled_new_reqs and not so.forked_reqs
                and not so.scheduled_spec_decode_tokens and self.drafter is None
                and not self.tokens_from_scheduler and not self._prompt_logprob_req_ids
                and not self._scheduler_token_req_ids
                and so.total_num_scheduled_tokens == len(so.scheduled_cached_reqs.req_ids))

    def _prepare_decode_inputs(self, so: SchedulerOutput) -> _StepInputs | None:
        """The inputs of a pure-decode step (``_is_pure_decode``), built from
        ``decode_rows`` with vectorised operations: exactly what the general loop builds.
        ``None`` when some request's input is neither its last token nor the one in flight
        (a recomputed request one token short of its end): the general loop handles it."""
        cached = so.scheduled_cached_reqs
        req_ids = list(cached.req_ids)
        requests = self.requests
        rows = np.array([requests[req_id].block_table_row for req_id in req_ids], dtype=np.intp)
        rows_state = self.decode_rows
        # [num_reqs] each request's one position: its tokens in the cache before the step.
        start = np.array(cached.num_computed_tokens, dtype=np.int64)
        # 1: its input is its last token; 0 (or less): the step in flight is sampling it.
        ahead = rows_state.num_tokens[rows] - start
        if (ahead > 1).any():
            return None
        pending_flat = np.flatnonzero(ahead <= 0)
        input_ids = rows_state.last_token[rows]
        input_ids[pending_flat] = 0  # read on the device
        bs = self.block_size
        slots = self.block_table.block_ids_at(rows, start // bs).astype(np.int64) * bs + start % bs
        num_reqs = len(req_ids)
        pending_rows = rows_state.sampled_row[rows[pending_flat]]
        flat_host = np.concatenate([input_ids, start, slots, pending_flat, pending_rows,
                                    np.arange(num_reqs, dtype=np.int64)])
        token_ids, positions, slot_mapping, sample_indices, pending = self._flat_to_device(
            flat_host, num_reqs, len(pending_flat))
        seq_lens = (start + 1).tolist()
        block_tables = self.block_table.gather(rows, self.block_table.max_num_blocks(rows))
        metadata = self._build_metadata(slot_mapping, list(range(num_reqs + 1)), seq_lens,
                                        block_tables, max_query_len=1)
        return _StepInputs(
            input_ids=token_ids,
            positions=positions,
            metadata=metadata,
            sample_indices=sample_indices,
            num_tokens_before_sample=list(seq_lens),
            req_ids=req_ids,
            samples=[True] * num_reqs,
            sample_rows=rows,
            prompt_logprob_positions={},
            spec_drafts=None,
            pending_inputs=pending,
            samples_first_rows=True,
            pending_in_order=pending_in_order(num_reqs, pending_rows),
        )

    def _flat_to_device(
        self, flat_host: np.ndarray, num_tokens: int, num_pending: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
               tuple[torch.Tensor, torch.Tensor] | None]:
        """One host-to-device copy of a step's per-token vectors and indices: ``flat_host``
        (int64) holds the input ids, positions and slots (``num_tokens`` each), the flat
        indices of the inputs still on the device and their rows in the last step's sampled
        tokens (``num_pending`` each), then the sample indices. Returns the input ids (those
        pending still 0: ``_read_pending`` fills them), positions, slot mapping, sample
        indices and the pending inputs (``_StepInputs.pending_inputs``)."""
        flat = host_to_device(torch.from_numpy(flat_host), self.device)
        pending = None
        if num_pending:
            pending = (flat[3 * num_tokens : 3 * num_tokens + num_pending],
                       flat[3 * num_tokens + num_pending : 3 * num_tokens + 2 * num_pending])
        return (flat[:num_tokens], flat[num_tokens : 2 * num_tokens],
                flat[2 * num_tokens : 3 * num_tokens], flat[3 * num_tokens + 2 * num_pending :],
                pending)

    def _read_pending(self, inputs: _StepInputs) -> None:
        """Fill the inputs still on the device from the previous step's sampled tokens
        (queued after that step's sampling: the step is being launched)."""
        if inputs.pending_inputs is None:
            return
        assert self._last_step is not None and self._last_step.sampled_token_ids is not None
        sampled = self._last_step.sampled_token_ids
        if inputs.pending_in_order:
            inputs.input_ids = sampled[: inputs.input_ids.shape[0]]
            return
        where, rows = inputs.pending_inputs
        inputs.input_ids[where] = sampled[rows]

    def _build_metadata(
        self,
        slot_mapping: torch.Tensor,
        query_start_loc: list[int],
        seq_lens: list[int],
        block_tables: np.ndarray,
        max_query_len: int | None = None,
    ) -> AttentionMetadata:
        """The step's attention metadata (``max_query_len``: when the caller knows it)."""
        num_seqs = len(seq_lens)
        # query_start_loc and seq_lens travel in one copy.
        lengths = host_to_device(
            torch.from_numpy(np.array(query_start_loc + seq_lens, dtype=np.int32)), self.device
        )
        return AttentionMetadata(
            num_seqs=num_seqs,
            num_tokens=query_start_loc[-1],
            slot_mapping=slot_mapping.to(self.device),
            query_start_loc=lengths[: num_seqs + 1],
            seq_lens=lengths[num_seqs + 1 :],
            block_tables=host_to_device(torch.from_numpy(block_tables), self.device),
            max_query_len=(max_query_len if max_query_len is not None else
                           max(b - a for a, b in zip(query_start_loc, query_start_loc[1:]))),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=list(query_start_loc),
            seq_lens_cpu=list(seq_lens),
        )

    def _plan_sampling(self, inputs: _StepInputs) -> _SamplePlan:
        """The step's ``_SamplePlan``, taken at its launch; the next step reads its
        requests' tokens from this step's sampled tokens, at the rows set here."""
        requests = self.requests
        sample_rows = inputs.sample_rows
        if len(sample_rows) == len(inputs.req_ids):  # every request samples (decode steps)
            step_rows: list[int] | range = range(len(sample_rows))
            states = [requests[req_id] for req_id in inputs.req_ids]
        else:
            step_rows = [i for i, does_sample in enumerate(inputs.samples) if does_sample]
            states = [requests[inputs.req_ids[i]] for i in step_rows]
        decode_rows = self.decode_rows
        decode_rows.sampled_row[sample_rows] = np.arange(len(states))
        # Which sampling requests append what they sample (None: all; not the beams', whose
        # tokens the scheduler chooses, nor any under pipeline parallelism), and who owns
        # their rows now (a request may be forgotten before this step's tokens are read).
        appends: np.ndarray | None = None
        if self.tokens_from_scheduler:
            appends = np.zeros(len(states), dtype=bool)
        elif self._scheduler_token_req_ids:
            appends = np.array([not s.tokens_from_scheduler for s in states], dtype=bool)
        prompt_logprobs = [(req_id, requests[req_id].sampling_params.prompt_logprobs)
                           for req_id in inputs.prompt_logprob_positions]
        return _SamplePlan(states, step_rows, appends, decode_rows.epoch[sample_rows],
                           decode_rows.num_claims, prompt_logprobs)

    def _sample(
        self,
        hidden: torch.Tensor,
        inputs: _StepInputs,
        plan: _SamplePlan,
        previous: StepOutput | None,
        grammar_bitmask: GrammarBitmask | None,
    ) -> PendingStepOutput:
        """Launch sampling (and prompt logprobs) and the copies of their results to the host;
        ``previous`` is the step launched before this one."""
        if previous is not None and previous.is_resolved:
            previous = None
        sample_rows = inputs.sample_rows
        states, step_rows, appends = plan.states, plan.step_rows, plan.appends
        output = ModelRunnerOutput(req_ids=inputs.req_ids, sampled_token_ids=[])
        sampler_output: SamplerOutput | None = None
        if not states:
            sampled = None
        elif all(s.greedy_after_grammar for s in states):
            # The common greedy batch, structured outputs included: skip building sampling
            # metadata (per-row Python work that costs more than the masks themselves).
            logits = self._compute_logits(inputs.sampled_hidden(hidden))
            if grammar_bitmask is not None:
                masks = self.grammar_masks.upload(grammar_bitmask, plan.sampled_req_ids(inputs))
                if masks is not None:
                    mask_by_bitmask(logits, masks.row_ids, masks.bitmask)
            sampled = argmax_rows(logits)
        else:
            logits = self._compute_logits(inputs.sampled_hidden(hidden))
            rows = self._sampling_rows(states, inputs.num_tokens_before_sample, previous)
            grammar = None
            if grammar_bitmask is not None:
                grammar = self.grammar_masks.upload(grammar_bitmask, plan.sampled_req_ids(inputs))
            sampler_output = self.sampler(logits, rows, grammar)
            sampled = sampler_output.sampled_token_ids
        decode_rows = self.decode_rows
        epochs, num_claims = plan.epochs, plan.num_claims
        device_tensors: list[torch.Tensor] = [] if sampled is None else [sampled]
        if sampler_output is not None and sampler_output.logprobs is not None:
            lp = sampler_output.logprobs
            device_tensors += [lp.token_ids, lp.logprobs, lp.ranks]
        prompt_logprob_reqs = plan.prompt_logprobs
        self._prompt_logprob_tensors(hidden, inputs, prompt_logprob_reqs, device_tensors)

        def finalize(host: list[torch.Tensor]) -> ModelRunnerOutput:
            if sampled is None:
                output.sampled_token_ids = [[] for _ in inputs.req_ids]
            else:
                token_ids = host[0].tolist()
                tokens = host[0].numpy()
                if appends is None:
                    for state, token_id in zip(states, token_ids):
                        state.token_ids.append(token_id)
                        state.output_token_ids.append(token_id)
                    decode_rows.append_sampled(sample_rows, epochs, num_claims, tokens)
                else:
                    for state, token_id, append in zip(states, token_ids, appends):
                        if append:
                            state.token_ids.append(token_id)
                            state.output_token_ids.append(token_id)
                    decode_rows.append_sampled(sample_rows[appends], epochs[appends],
                                               num_claims, tokens[appends])
                if isinstance(step_rows, range):
                    output.sampled_token_ids = [[token_id] for token_id in token_ids]
                else:
                    output.sampled_token_ids = [[] for _ in inputs.req_ids]
                    for i, token_id in zip(step_rows, token_ids):
                        output.sampled_token_ids[i] = [token_id]
                host = host[1:]
            if sampler_output is not None and sampler_output.logprobs is not None:
                lp_host = LogprobsTensors(*host[:3])
                host = host[3:]
                for row, state in enumerate(states):
                    num = state.sampling_params.logprobs
                    if num is not None:
                        output.logprobs[state.req_id] = _to_lists(lp_host, row, row + 1, num)
            for k, (req_id, num) in enumerate(prompt_logprob_reqs):
                tensors = LogprobsTensors(*host[3 * k : 3 * k + 3])
                output.prompt_logprobs[req_id] = _to_lists(tensors, 0, len(tensors.ranks), num)
            return output

        return PendingStepOutput(DeviceToHostCopy(device_tensors), finalize, previous, sampled)

    def _sample_speculative(
        self, hidden: torch.Tensor, inputs: _StepInputs, so: SchedulerOutput
    ) -> PendingStepOutput:
        """Sample a step where some requests verify draft tokens (speculative decoding).

        Every sampling request has ``1 + k`` logits rows (``k`` = its drafts, maybe 0); row
        ``j`` is sampled as if drafts ``< j`` were already generated (penalties and min_tokens
        see them), and the rejection sampler (``octavo.spec_decode.rejection_sampler``) keeps
        the drafts the target agrees with plus one token of its own. Requests emit 1 .. k + 1
        tokens; logprobs come per emitted token. Runs one step at a time (no token in flight).
        With a draft model, the draft then proposes the next step's drafts of each request
        that may speculate (``ModelRunnerOutput.spec_token_ids``).
        """
        assert inputs.spec_drafts is not None
        grammar_bitmask = so.grammar_bitmask
        output = ModelRunnerOutput(
            req_ids=inputs.req_ids, sampled_token_ids=[[] for _ in inputs.req_ids]
        )
        step_rows = [i for i, does_sample in enumerate(inputs.samples) if does_sample]
        states = [self.requests[inputs.req_ids[i]] for i in step_rows]
        if not states and not inputs.prompt_logprob_positions:
            # Prompt chunks only (with a draft model): the draft's KV of them, no sampling.
            if self.drafter is not None:
                self._propose_with_draft(inputs, so, {}, hidden)
            return PendingStepOutput.ready(output)
        drafts = inputs.spec_drafts
        rows: list[SamplingRow] = []
        draft_of_row: list[int] = []
        row_of: dict[str, int] = {}
        for state, draft in zip(states, drafts):
            assert len(state.token_ids) == state.num_computed_tokens + 1 or not draft
            row_of[state.req_id] = len(rows)  # constrained requests have no drafts: one row
            for j in range(len(draft) + 1):
                rows.append(SamplingRow(state.sampling_params, state.prompt_token_ids,
                                        state.output_token_ids + draft[:j]))
            draft_of_row += draft + [-1]
        logits = self._compute_logits(hidden[inputs.sample_indices])  # [rows, vocab]
        grammar = None
        if grammar_bitmask is not None:
            grammar = self.grammar_masks.upload(grammar_bitmask, list(row_of),
                                                logits_rows=list(row_of.values()))
        metadata = SamplingMetadata.from_rows(rows, logits.shape[1], logits.device, grammar,
                                              self.sampler.logits_processors)
        argmax, probs, greedy = target_distribution(self.sampler, logits, metadata)
        draft_ids = host_to_device(torch.tensor(draft_of_row, dtype=torch.long), self.device)
        draft_probs = None
        if probs is not None and self._draft_probs:
            draft_probs = self._sampled_draft_probs(states, drafts, draft_ids, probs)
        decided = rejection_sample(argmax, probs, greedy, draft_ids, [len(d) for d in drafts],
                                   draft_probs=draft_probs, seeded_rows=metadata.seeded_rows)
        device_tensors = [decided.token_ids, decided.num_emitted]
        if self.drafter is not None:
            token_ids, num_emitted = decided.token_ids.tolist(), decided.num_emitted.tolist()
            emitted = {state.req_id: ids[:n]
                       for state, ids, n in zip(states, token_ids, num_emitted)}
            output.spec_token_ids = self._propose_with_draft(inputs, so, emitted, hidden)
        if metadata.max_num_logprobs is not None:
            num_top = min(metadata.max_num_logprobs, metadata.vocab_size)
            lp = compute_logprobs(logits, decided.row_token_ids, num_top)
            device_tensors += [lp.token_ids, lp.logprobs, lp.ranks]
        prompt_logprob_reqs = [(req_id, self.requests[req_id].sampling_params.prompt_logprobs)
                               for req_id in inputs.prompt_logprob_positions]
        self._prompt_logprob_tensors(hidden, inputs, prompt_logprob_reqs, device_tensors)
        with_logprobs = metadata.max_num_logprobs is not None

        def finalize(host: list[torch.Tensor]) -> ModelRunnerOutput:
            token_ids, num_emitted = host[0].tolist(), host[1].tolist()
            host = host[2:]
            lp_host = None
            if with_logprobs:
                lp_host = LogprobsTensors(*host[:3])
                host = host[3:]
            first_row = 0
            for i, state, draft, emitted, n in zip(step_rows, states, drafts, token_ids,
                                                   num_emitted):
                emitted = emitted[:n]
                if not (self.tokens_from_scheduler or state.tokens_from_scheduler):
                    state.token_ids.extend(emitted)
                    state.output_token_ids.extend(emitted)
                    if self.requests.get(state.req_id) is state:  # its row is still its own
                        self.decode_rows.sync(state.block_table_row, state.token_ids)
                output.sampled_token_ids[i] = emitted
                num = state.sampling_params.logprobs
                if lp_host is not None and num is not None:
                    output.logprobs[state.req_id] = _to_lists(lp_host, first_row,
                                                              first_row + n, num)
                first_row += len(draft) + 1
            for k, (req_id, num) in enumerate(prompt_logprob_reqs):
                tensors = LogprobsTensors(*host[3 * k : 3 * k + 3])
                output.prompt_logprobs[req_id] = _to_lists(tensors, 0, len(tensors.ranks), num)
            return output

        return PendingStepOutput(DeviceToHostCopy(device_tensors), finalize, None, None)

    def _sampled_draft_probs(self, states: list[CachedRequestState], drafts: list[list[int]],
                             draft_ids: torch.Tensor, probs: torch.Tensor
                             ) -> torch.Tensor | None:
        """The rejection sampler's ``q`` for a step whose drafts include sampled ones: the
        stored draft distributions on those requests' draft rows, one-hot rows for the other
        drafts (None when no verified draft was sampled)."""
        parts: list[tuple[int, torch.Tensor]] = []
        first_row = 0
        for state, draft in zip(states, drafts):
            q = self._draft_probs.get(state.req_id)
            if draft and q is not None and q.shape[0] >= len(draft):
                parts.append((first_row, q[: len(draft)]))
            first_row += len(draft) + 1
        if not parts:
            return None
        has_draft = (draft_ids >= 0).to(probs.dtype).unsqueeze(1)
        draft_probs = torch.zeros_like(probs).scatter_(1, draft_ids.clamp(min=0).unsqueeze(1),
                                                       has_draft)
        for first, q in parts:
            draft_probs[first : first + q.shape[0]] = q
        return draft_probs

    def _propose_with_draft(self, inputs: _StepInputs, so: SchedulerOutput,
                            emitted: dict[str, list[int]],
                            hidden: torch.Tensor | None = None) -> dict[str, list[int]]:
        """Write the draft model's (or EAGLE head's) KV of the step's kept tokens and return
        its proposals for the next step (see ``octavo.worker.draft_model`` and
        ``octavo.worker.eagle``). ``emitted``: the tokens each sampling request emitted this
        step (accepted drafts, then its newest token); ``hidden``: the target's hidden states
        of the step (rows of the flat batch), which an EAGLE-1 head reads (an EAGLE-3 head
        reads the target's aux hidden states of the same rows instead).

        Proposing: the step's sampling requests that may speculate and have room before
        max_model_len, not forks of this step (they have no tokens in the step's batch).
        """
        assert self.drafter is not None
        eagle = isinstance(self.drafter, EagleProposer)
        assert hidden is not None or not eagle, "an EAGLE head needs the target's hidden states"
        if eagle:  # the rows the head reads: the target's output (EAGLE-1) or aux states
            hidden = self.drafter.target_hidden_source(hidden)
        bs = self.block_size
        max_len = self.model_config.max_model_len
        metadata = inputs.metadata
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        hidden_rows: list[int] = []  # EAGLE: the target's row of each position
        query_start_loc = [0]
        seq_lens: list[int] = []
        rows: list[int] = []
        requests: list[DraftRequest] = []
        proposing: list[str] = []
        for i, end in enumerate(metadata.seq_lens_cpu):  # forks come after: not in the batch
            req_id = inputs.req_ids[i]
            state = self.requests[req_id]
            start = end - (metadata.query_start_loc_cpu[i + 1] - metadata.query_start_loc_cpu[i])
            drafts = so.scheduled_spec_decode_tokens.get(req_id, ())
            out = emitted.get(req_id)
            # The positions the target computed this step and keeps: [start, kept_end); the
            # request's tokens as now known (the newest at kept_end when it emitted).
            kept_end = end - len(drafts) + (len(out) - 1 if out else 0)
            known = state.token_ids[: end - len(drafts)] + out if out else state.token_ids
            newest = kept_end  # the newest token's position (L - 1)
            room = min(self.drafter.k, max_len - newest - 1)
            propose = bool(out and room > 0 and newest < len(state.block_ids) * bs
                           and not state.tokens_from_scheduler
                           and params_may_speculate(state.sampling_params))
            if eagle:  # row t: token t + 1 and the target's hidden state at t
                row_end = min(kept_end, len(known) - 1)
                propose = propose and row_end == kept_end
                tokens = known[start + 1 : row_end + 1]
                first_row = metadata.query_start_loc_cpu[i]
                hidden_rows.extend(range(first_row, first_row + row_end - start))
            else:  # row t: token t, up to the newest when proposing
                tokens = known[start : kept_end + (1 if propose else 0)]
            if not tokens:
                continue
            if propose:
                proposing.append(req_id)
                params = state.sampling_params
                requests.append(DraftRequest(
                    flat_index=len(ids) + len(tokens) - 1, position=start + len(tokens) - 1,
                    block_table_row=state.block_table_row, block_ids=state.block_ids,
                    max_tokens=room,
                    temperature=0.0 if params.greedy else float(params.temperature)))
            block_ids = state.block_ids
            ids += tokens
            positions.extend(range(start, start + len(tokens)))
            slots.extend(block_ids[q // bs] * bs + q % bs
                         for q in range(start, start + len(tokens)))
            query_start_loc.append(len(ids))
            seq_lens.append(start + len(tokens))
            rows.append(state.block_table_row)
        if not ids:
            return {}

        def build(slot_mapping: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                  rows: list[int]) -> AttentionMetadata:
            width = max(-(-n // bs) for n in seq_lens)
            return self._build_metadata(slot_mapping, query_start_loc, seq_lens,
                                        self.block_table.gather(rows, width))

        num = len(ids)
        flat = host_to_device(torch.tensor(ids + positions + slots + hidden_rows,
                                           dtype=torch.long), self.device)
        batch = DraftBatch(input_ids=flat[:num], positions=flat[num : 2 * num],
                           metadata=build(flat[2 * num : 3 * num], query_start_loc, seq_lens,
                                          rows),
                           requests=requests,
                           target_hidden=hidden[flat[3 * num :]] if eagle else None)
        proposals, draft_probs = self.drafter.propose(batch, build)
        for req_id in proposing:
            self._draft_probs.pop(req_id, None)
        for i, q in draft_probs.items():
            self._draft_probs[proposing[i]] = q
        return {req_id: p for req_id, p in zip(proposing, proposals) if p}

    def _sampling_rows(
        self,
        states: list[CachedRequestState],
        num_tokens_before_sample: list[int],
        previous: StepOutput | None,
    ) -> list[SamplingRow]:
        """One ``SamplingRow`` per sampling request, counting tokens still in flight.

        Penalties need the ids of every generated token: if a row would lack one, the step in
        flight is waited for first. Otherwise only the count matters (seeds, min_tokens) and
        the missing token is stood in for.
        """
        missing = [
            len(s.token_ids) < n for s, n in zip(states, num_tokens_before_sample)
        ]
        if any(missing) and any(s.needs_token_history for s in states):
            assert previous is not None
            previous.result()
            missing = [False] * len(states)
        return [
            SamplingRow(
                params=s.sampling_params,
                prompt_token_ids=s.prompt_token_ids,
                output_token_ids=s.output_token_ids + [0] if m else s.output_token_ids,
            )
            for s, m in zip(states, missing)
        ]

    def _prompt_logprob_tensors(self, hidden: torch.Tensor, inputs: _StepInputs,
                                reqs: list[tuple[str, int]],
                                device_tensors: list[torch.Tensor]) -> None:
        """Append the prompt-logprob tensors of ``reqs`` (each request that asked, with the
        top logprobs it asked for) to ``device_tensors``, three per request."""
        for req_id, num in reqs:
            tensors = self._prompt_logprobs(hidden, req_id, num, inputs)
            device_tensors += [tensors.token_ids, tensors.logprobs, tensors.ranks]

    def _prompt_logprobs(
        self, hidden: torch.Tensor, req_id: str, num: int, inputs: _StepInputs
    ) -> LogprobsTensors:
        flat, targets = inputs.prompt_logprob_positions[req_id]
        # Indices and targets in one non-blocking copy (a host list would wait for the stream).
        both = host_to_device(torch.tensor(flat + targets, dtype=torch.long), self.device)
        indices, chosen = both[: len(flat)], both[len(flat) :]
        # In slices: a whole chunk's float32 logits (8192 positions x a 152k vocabulary: 5 GB,
        # twice with the log-softmax) would not fit the memory the profile run left aside.
        step = PROMPT_LOGPROBS_SLICE
        parts = [compute_logprobs(self._compute_logits(hidden[indices[i:i + step]]),
                                  chosen[i:i + step], num)
                 for i in range(0, len(flat), step)]
        if len(parts) == 1:
            return parts[0]
        return LogprobsTensors(token_ids=torch.cat([p.token_ids for p in parts]),
                               logprobs=torch.cat([p.logprobs for p in parts]),
                               ranks=torch.cat([p.ranks for p in parts]))


def _long_tensor(values: list[int]) -> torch.Tensor:
    """An int64 host tensor of ``values``: through numpy, about 5x faster than
    ``torch.tensor(values)`` for the per-step lists of a large batch (a list of 1,000 ints:
    ~25 µs against ~135 µs)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def _to_lists(tensors: LogprobsTensors, start: int, end: int, num_top: int) -> LogprobsLists:
    return LogprobsLists(
        token_ids=tensors.token_ids[start:end, : num_top + 1].tolist(),
        logprobs=tensors.logprobs[start:end, : num_top + 1].tolist(),
        ranks=tensors.ranks[start:end].tolist(),
    )
