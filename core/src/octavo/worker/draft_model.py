"""The draft model of ``"method": "draft_model"`` speculative decoding, run by the worker beside
the target.

KV layout: the draft's KV cache is a second set of layers over the *same* paged blocks as the
target's (same block ids, block tables and slot mapping), so prefix caching, preemption,
swapping and block freeing need no second allocator. After each step (once the rejection
sampler has decided) the runner hands ``propose`` one flat batch (``DraftBatch``) holding, per
scheduled request, the step's tokens the target now keeps (prompt chunk, or the verified
request's last token and its accepted drafts) and, for a request that proposes, the token the
step emitted last (at position ``L - 1``). So:

- every slot whose target KV is valid holds draft KV of the same token, including blocks later
  found by prefix caching (prompt chunks are written as the target writes them);
- slots of rejected drafts hold garbage for both models until a later step rewrites them
  (attention reads only positions below a sequence's length).

The draft's logits at each proposing request's last token give its first proposal; K - 1
one-token steps (batched over the proposing requests) give the rest, writing positions
``L .. L + K - 2``. The scheduler reserves K lookahead slots past a step's tokens
(``SpeculativeConfig.num_lookahead_slots``) so these writes land in the request's own blocks;
a request with fewer slots gets fewer proposals.

Proposals of greedy requests are the draft's argmax (``q`` one-hot). A sampled request's
proposals are drawn from ``q = softmax(draft logits / its temperature)``, and those rows of
``q`` go with them to the rejection sampler (accept with ``min(1, p/q)``, resample from
``max(0, p - q)``), which keeps every emitted token distributed exactly as the target's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pluggy
import torch

from octavo.attention.base import AttentionBackend, AttentionMetadata
from octavo.config import ModelConfig
from octavo.model_executor.layers.attention import Attention
from octavo.model_executor.model_loader import load_model
from octavo.sample.sampler import exponential_race
from octavo.worker.graph_runner import GraphRunner

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DraftRequest:
    """One request the draft proposes for after a step."""

    # Flat index of its newest token (emitted by this step) in the DraftBatch, and that
    # token's position (L - 1).
    flat_index: int
    position: int
    # Its row in the runner's BlockTable and its block ids (the same, as a list).
    block_table_row: int
    block_ids: list[int]
    # Most draft tokens wanted (K, or fewer near max_model_len).
    max_tokens: int
    # The request's temperature: its drafts are drawn from the draft's softmax at it (0.0:
    # greedy, the draft's argmax).
    temperature: float = 0.0


@dataclass(slots=True)
class DraftBatch:
    """The draft's first forward after a step: the tokens to write (see the module doc)."""

    input_ids: torch.Tensor  # [num_tokens] int64, on the device
    positions: torch.Tensor  # [num_tokens] int64, on the device
    metadata: AttentionMetadata
    # The requests that propose (their newest token is in the batch).
    requests: list[DraftRequest]
    # EAGLE only: the target's hidden state of each row's position, [num_tokens, hidden]
    # (None for a draft model, which reads only tokens).
    target_hidden: torch.Tensor | None = None


# (slot mapping, query_start_loc, seq_lens, block table rows) -> metadata, as the runner builds it.
MetadataBuilder = Callable[[torch.Tensor, list[int], list[int], list[int]], AttentionMetadata]


class DraftModelProposer:
    """The draft model, its KV cache layers, and its proposals (see the module doc)."""

    def __init__(self, model_config: ModelConfig, attn_backend: AttentionBackend,
                 device: torch.device, pm: pluggy.PluginManager, backend: str,
                 num_speculative_tokens: int, block_size: int) -> None:
        self.model_config = model_config
        self.attn_backend = attn_backend
        self.device = device
        self.pm = pm
        self.backend = backend
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        # Replays the draft's captured steps where it can (set by the worker once the KV cache
        # exists, as the target's; None: every draft step runs eagerly).
        self.graph_runner: GraphRunner | None = None

    def load_model(self) -> None:
        """Load the draft through the same loader as the target (any supported architecture,
        the target's dtype and device, ``load_format`` included)."""
        self.model = load_model(self.model_config, self.attn_backend, self.device, self.pm,
                                None, backend=self.backend)
        logger.info("speculative decoding: draft model %s loaded (%d layers)",
                    self.model_config.model, self._layout()[0])

    def _layout(self) -> tuple[int, int, int]:
        assert self.model is not None, "load_model() must run first"
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        assert layers, f"draft {type(self.model).__name__} has no attention layer"
        return len(layers), layers[0].num_kv_heads, layers[0].head_dim

    def kv_cache_bytes_per_block(self, dtype: torch.dtype) -> int:
        """Bytes of one block over the draft's layers (added to the target's per block)."""
        num_layers, num_kv_heads, head_dim = self._layout()
        shape = self.attn_backend.get_kv_cache_shape(1, self.block_size, num_kv_heads, head_dim)
        return int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size() * num_layers

    def initialize_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        """The draft's layers over the target's ``num_blocks`` blocks (uninitialised, as the
        target's: nothing reads a slot before it is written)."""
        num_layers, num_kv_heads, head_dim = self._layout()
        shape = self.attn_backend.get_kv_cache_shape(num_blocks, self.block_size, num_kv_heads,
                                                     head_dim)
        self.kv_caches = [torch.empty(shape, dtype=dtype, device=self.device)
                          for _ in range(num_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 metadata: AttentionMetadata) -> torch.Tensor:
        """Run the draft over a flat batch, writing its KV; returns the hidden states (read
        them before the next call: a replayed graph's output buffer is reused)."""
        assert self.model is not None
        if self.graph_runner is not None and self.graph_runner.can_run(metadata):
            return self.graph_runner.run(input_ids, positions, metadata)
        return self.model(input_ids, positions, self.kv_caches, metadata)

    def graph_model(self, max_tokens: int) -> torch.nn.Module:
        """The module the worker captures for this proposer's steps (called as
        ``model(input_ids, positions, kv_caches, metadata)``, at most ``max_tokens`` tokens):
        the draft model itself."""
        assert self.model is not None
        return self.model

    def first_forward(self, batch: DraftBatch) -> torch.Tensor:
        """The forward over a step's batch (``[num_tokens, hidden]``)."""
        return self.forward(batch.input_ids, batch.positions, batch.metadata)

    def step_forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                     metadata: AttentionMetadata, previous: torch.Tensor) -> torch.Tensor:
        """One one-token proposal step over the requests still proposing (``previous``: the
        hidden states that gave ``tokens``, unused by a draft model)."""
        return self.forward(tokens, positions, metadata)

    def propose(self, batch: DraftBatch, build_metadata: MetadataBuilder
                ) -> tuple[list[list[int]], dict[int, torch.Tensor]]:
        """Write the batch's draft KV and return proposals, up to ``max_tokens`` each, for
        ``batch.requests`` (one list per request; [] where its slots run out), and for each
        sampled request (by index) the distributions its proposals were drawn from
        (``[num proposals, vocab]`` float32 on the device). The first proposal comes from the
        batch's forward, the others from one-token steps batched over the requests still
        proposing."""
        assert self.model is not None
        hidden = self.first_forward(batch)
        requests = batch.requests
        proposals: list[list[int]] = [[] for _ in requests]
        if not requests:
            return proposals, {}
        bs = self.block_size
        # Tokens per request: the first from the batch, then one per one-token step, which
        # writes position ``position + j`` (j >= 1) into the request's own blocks.
        steps = [max(0, min(r.max_tokens, len(r.block_ids) * bs - r.position))
                 for r in requests]
        active = [i for i, m in enumerate(steps) if m > 0]
        if not active:
            return proposals, {}
        sampled = any(requests[i].temperature > 0 for i in active)
        index = torch.tensor([requests[i].flat_index for i in active], dtype=torch.long)
        last = hidden[index.to(self.device)]  # [len(active), hidden] (a copy)
        tokens, probs = self._choose(
            self.model.compute_logits(last),
            [requests[i].temperature for i in active] if sampled else None)
        outputs: list[tuple[list[int], torch.Tensor]] = [(list(active), tokens)]
        dists: list[tuple[list[int], torch.Tensor | None]] = [(list(active), probs)]
        for j in range(1, max(steps)):
            keep = [n for n, i in enumerate(active) if steps[i] > j]
            if not keep:
                break
            if len(keep) < len(active):
                kept = torch.tensor(keep, dtype=torch.long, device=self.device)
                tokens, last = tokens[kept], last[kept]
                active = [active[n] for n in keep]
            positions = [requests[i].position + j for i in active]
            slots = [requests[i].block_ids[p // bs] * bs + p % bs
                     for i, p in zip(active, positions)]
            flat = torch.tensor(positions + slots, dtype=torch.long).to(self.device,
                                                                      non_blocking=True)
            metadata = build_metadata(flat[len(positions):], list(range(len(active) + 1)),
                                      [p + 1 for p in positions],
                                      [requests[i].block_table_row for i in active])
            last = self.step_forward(tokens, flat[: len(positions)], metadata, last)
            tokens, probs = self._choose(
                self.model.compute_logits(last),
                [requests[i].temperature for i in active] if sampled else None)
            outputs.append((list(active), tokens))
            dists.append((list(active), probs))
        host = torch.cat([t for _, t in outputs]).tolist()  # one device-to-host copy
        offset = 0
        for indices, step_tokens in outputs:
            for n, i in enumerate(indices):
                proposals[i].append(host[offset + n])
            offset += step_tokens.shape[0]
        q_rows: dict[int, list[torch.Tensor]] = {}
        for indices, probs in dists:
            if probs is None:
                continue
            for n, i in enumerate(indices):
                if requests[i].temperature > 0:
                    q_rows.setdefault(i, []).append(probs[n])
        return proposals, {i: torch.stack(rows) for i, rows in q_rows.items()}

    def _choose(self, logits: torch.Tensor, temperatures: list[float] | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's proposal: the argmax, or for a row with a temperature > 0 a draw from
        ``softmax(logits / temperature)``; returns the tokens and (None when every row is
        greedy) those distributions, float32."""
        argmax = logits.argmax(dim=-1)
        if temperatures is None:
            return argmax, None
        temps = torch.tensor(temperatures, dtype=torch.float32).to(self.device,
                                                                   non_blocking=True)
        is_sampled = temps > 0
        probs = torch.softmax(logits.float() / torch.where(is_sampled, temps, 1.0).unsqueeze(1),
                              dim=-1)
        return torch.where(is_sampled, exponential_race(probs, []), argmax), probs

    def profile_run(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    metadata: AttentionMetadata, num_blocks: int, dtype: torch.dtype) -> None:
        """The largest step through the draft on a temporary cache of ``num_blocks`` blocks
        (the memory profile counts the draft's activations with the target's)."""
        assert self.model is not None
        saved = self.kv_caches
        self.initialize_kv_cache(num_blocks, dtype)
        try:
            self.model(input_ids, positions, self.kv_caches, metadata)
        finally:
            self.kv_caches = saved
