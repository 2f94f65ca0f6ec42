"""The EAGLE proposers of ``"method": "eagle"`` (EAGLE-1) and ``"eagle3"`` (EAGLE-3) speculative
decoding, run by the worker beside the target (the heads:
``octavo.model_executor.models.llama_eagle`` and ``llama_eagle3``).

It is the draft-model proposer (``octavo.worker.draft_model``: the head's KV is one more layer
over the *same* paged blocks, K lookahead slots, a first forward over the step's kept tokens,
then K - 1 one-token steps, ``q`` kept for sampled requests) with two differences:

- **Inputs are shifted by one token and carry the target's hidden states.** The row of
  position t holds token ``t + 1`` and the target's hidden state at t (what its decoder
  returned, the input of its LM head, as vLLM passes it). After a step the batch holds, per
  request, every position the target computed this step and keeps (prompt chunk, or the
  verified token and the accepted drafts); the token after the last of them is the newest
  token (or the next prompt token mid-prompt), so every position whose target KV is valid gets
  head KV in the same step, at the same slot. A proposing request's last row (position
  ``L - 2``, the newest token at ``L - 1``) gives its first proposal.
- **The one-token steps feed the head's own output back** as the hidden state of the next
  position: step j writes position ``L - 2 + j`` with the previous proposal as token.

EAGLE-3 (``Eagle3Proposer``, ``"method": "eagle3"``; the head:
``octavo.model_executor.models.llama_eagle3``) is the same proposer with two changes: the
target's hidden state of a row is the concatenation of three of its intermediate states
(``LlamaModel.set_aux_hidden_state_layers``: the target writes them into a persistent buffer
on every forward once asked), which the head's ``fc`` fuses on the first forward only (the
one-token steps feed the head's own pre-norm output back, without ``fc``); and the head's
logits cover its reduced vocabulary, scattered into the target's (``-inf`` elsewhere), so
proposals are target ids and a sampled request's ``q`` is zero outside the draft vocabulary.

CUDA graphs: the worker captures the head's steps as the draft model's (one-token steps, and
first forwards of at most K + 2 tokens a sequence). The graph runner feeds a model token ids
and positions only, so it captures ``StaticHiddenHead``: the head reading its hidden-state
input from a persistent buffer, which ``_run`` fills before each replay.
"""

from __future__ import annotations

import logging

import torch

from octavo.attention.base import AttentionMetadata
from octavo.model_executor.loader.eagle_loader import load_eagle3_head, load_eagle_head
from octavo.model_executor.models.llama_eagle import EagleLlamaForCausalLM
from octavo.model_executor.models.llama_eagle3 import (
    Eagle3LlamaForCausalLM,
    aux_hidden_state_layers,
)
from octavo.worker.draft_model import DraftBatch, DraftModelProposer

logger = logging.getLogger(__name__)


class StaticHiddenHead(torch.nn.Module):
    """The head as a graph runner calls a model: ``(input_ids, positions, kv_caches,
    metadata)``, its hidden-state input read from the first rows of ``hidden_in`` (a
    persistent ``[max_tokens, hidden]`` buffer, so captured graphs read it where it is)."""

    def __init__(self, head: EagleLlamaForCausalLM | Eagle3LlamaForCausalLM, max_tokens: int,
                 device: torch.device) -> None:
        super().__init__()
        self.head = head
        self.hidden_in = torch.zeros(max_tokens, head.config.hidden_size,
                                     dtype=head.fc.weight.dtype, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        return self.head(input_ids, positions, kv_caches, metadata,
                         self.hidden_in[: input_ids.shape[0]])


class EagleProposer(DraftModelProposer):
    """EAGLE-1 proposals (see the module doc). ``load_model`` needs the loaded target: the
    head shares its LM head (and embedding, unless the checkpoint has one)."""

    def __init__(self, *args, target: torch.nn.Module, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.target = target
        # The module the worker's graph runner captured (None: no graphs).
        self.static_head: StaticHiddenHead | None = None

    def graph_model(self, max_tokens: int) -> torch.nn.Module:
        assert isinstance(self.model, (EagleLlamaForCausalLM, Eagle3LlamaForCausalLM)), (
            "load_model() must run first")
        self.static_head = StaticHiddenHead(self.model, max_tokens, self.device)
        return self.static_head

    def load_model(self) -> None:
        self.model = load_eagle_head(self.model_config, self.target, self.attn_backend,
                                     self.device)

    def target_hidden_source(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows (one per token of the target's last forward) that a batch's
        ``target_hidden`` is gathered from: the target's output ``hidden`` (EAGLE-1)."""
        return hidden

    def first_hidden(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The head's hidden input on the first forward, from the target's rows (EAGLE-1:
        those rows as they are)."""
        return target_hidden

    def target_hidden_size(self) -> int:
        """Width of the target's rows the head reads."""
        assert self.model is not None
        return self.model.config.hidden_size

    def first_forward(self, batch: DraftBatch) -> torch.Tensor:
        assert batch.target_hidden is not None, "an EAGLE batch carries the target's hidden"
        return self._run(batch.input_ids, batch.positions, batch.metadata,
                         self.first_hidden(batch.target_hidden))

    def step_forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                     metadata: AttentionMetadata, previous: torch.Tensor) -> torch.Tensor:
        return self._run(tokens, positions, metadata, previous)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor,
             metadata: AttentionMetadata, hidden: torch.Tensor) -> torch.Tensor:
        """The head over a flat batch (replayed where a graph covers it), writing its KV;
        the result may be a graph's output buffer: read it before the next call."""
        assert self.model is not None
        if (self.graph_runner is not None and self.static_head is not None
                and self.graph_runner.can_run(metadata)):
            self.static_head.hidden_in[: hidden.shape[0]].copy_(hidden)
            return self.graph_runner.run(input_ids, positions, metadata)
        return self.model(input_ids, positions, self.kv_caches, metadata, hidden)

    def profile_run(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    metadata: AttentionMetadata, num_blocks: int, dtype: torch.dtype) -> None:
        """The largest step through the head (zeros for the target's hidden states)."""
        assert self.model is not None
        saved = self.kv_caches
        self.initialize_kv_cache(num_blocks, dtype)
        try:
            hidden = torch.zeros(input_ids.shape[0], self.target_hidden_size(),
                                 dtype=self.model.fc.weight.dtype, device=self.device)
            self._run(input_ids, positions, metadata, self.first_hidden(hidden))
        finally:
            self.kv_caches = saved


class Eagle3Proposer(EagleProposer):
    """EAGLE-3 proposals (see the module doc). ``load_model`` also asks the target for its
    auxiliary hidden states, written into a buffer of ``max_tokens`` rows (at least the
    most tokens one target forward runs, graph padding included)."""

    def __init__(self, *args, max_tokens: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_tokens = max_tokens
        # The target's aux hidden states of its last forward ([max_tokens, 3 * hidden]).
        self.target_aux: torch.Tensor | None = None

    def load_model(self) -> None:
        head = load_eagle3_head(self.model_config, self.target, self.attn_backend, self.device)
        self.model = head
        body = getattr(self.target, "model", None)
        setter = getattr(body, "set_aux_hidden_state_layers", None)
        if setter is None:
            raise ValueError(f"speculative_config: method 'eagle3' needs the target's "
                             f"intermediate hidden states, which {type(self.target).__name__} "
                             "does not give; use method 'draft_model' or 'ngram'")
        target_config = self.target.config
        layers = aux_hidden_state_layers(head.config, target_config.num_hidden_layers)
        self.target_aux = setter(layers, self.max_tokens, head.fc.weight.dtype, self.device)
        logger.info("speculative decoding: the EAGLE-3 head reads target layers %s",
                    list(layers))

    def target_hidden_source(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.target_aux is not None, "load_model() must run first"
        return self.target_aux

    def first_hidden(self, target_hidden: torch.Tensor) -> torch.Tensor:
        assert isinstance(self.model, Eagle3LlamaForCausalLM), "load_model() must run first"
        return self.model.combine_hidden_states(target_hidden)

    def target_hidden_size(self) -> int:
        assert isinstance(self.model, Eagle3LlamaForCausalLM), "load_model() must run first"
        return self.model.input_hidden_size
