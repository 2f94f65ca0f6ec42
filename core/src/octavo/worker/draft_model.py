"""The draft model of ``"method": "draft_model"`` speculative decoding, run by the worker beside
the target.

KV layout: the draft's KV cache is a second set of layers over the *same* paged blocks as the
target's (same block ids, block tables and slot mapping), so prefix caching, preemption,
swapping and block freeing need no second allocator. Two rules keep every draft KV slot valid
wherever it is read:

1. ``forward_step`` runs the draft over exactly the tokens the target's forward ran over in
   the step (prompt chunks, decode tokens, the tokens being verified): any slot whose target
   KV is valid holds draft KV of the same tokens, including blocks found by prefix caching.
   Slots of rejected drafts hold garbage for both models until the next step rewrites them
   (attention reads only positions below a sequence's length).
2. ``propose`` then feeds each proposing request's newest token (the one the step emitted
   last, at position ``L - 1``) and its own argmax K - 1 times: one-token steps writing
   positions ``L - 1 .. L + K - 2``. The scheduler reserves K lookahead slots past a step's
   tokens (``SpeculativeConfig.num_lookahead_slots``) so these writes land in the request's
   own blocks; a request with fewer slots gets fewer proposals.

Proposals are greedy (argmax of the draft's logits), so the rejection sampler's ``q`` is
one-hot; sampled target rows still keep the target's distribution exactly.
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

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DraftRequest:
    """One request the draft proposes for after a step."""

    # Its newest token (emitted by this step) and that token's position (L - 1).
    last_token_id: int
    position: int
    # Its row in the runner's BlockTable and its block ids (the same, as a list).
    block_table_row: int
    block_ids: list[int]
    # Most draft tokens wanted (K, or fewer near max_model_len).
    max_tokens: int


# (slot mapping, query_start_loc, seq_lens, block table rows) -> metadata, as the runner builds it.
MetadataBuilder = Callable[[torch.Tensor, list[int], list[int], list[int]], AttentionMetadata]


class DraftModelProposer:
    """The draft model, its KV cache layers, and greedy proposals (see the module doc)."""

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

    def forward_step(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     metadata: AttentionMetadata) -> None:
        """Write the draft KV of the step's tokens (the target's flat batch, unchanged)."""
        assert self.model is not None
        self.model(input_ids, positions, self.kv_caches, metadata)

    def propose(self, requests: list[DraftRequest],
                build_metadata: MetadataBuilder) -> list[list[int]]:
        """Greedy proposals, up to ``max_tokens`` each, for ``requests`` (one-token draft steps,
        all requests batched; a request drops out of the batch once it has its proposals or
        its slots run out). Returns one list per request."""
        assert self.model is not None
        bs = self.block_size
        # Draft steps per request: each writes one slot (positions position .. position+m-1).
        steps = [max(0, min(r.max_tokens, len(r.block_ids) * bs - r.position))
                 for r in requests]
        proposals: list[list[int]] = [[] for _ in requests]
        active = [i for i, m in enumerate(steps) if m > 0]
        if not active:
            return proposals
        tokens = torch.tensor([requests[i].last_token_id for i in active], dtype=torch.long,
                              device=self.device)
        outputs: list[tuple[list[int], torch.Tensor]] = []  # (request indices, tokens) per step
        for j in range(max(steps)):
            positions = [requests[i].position + j for i in active]
            rows = [requests[i].block_table_row for i in active]
            slots = [requests[i].block_ids[p // bs] * bs + p % bs
                     for i, p in zip(active, positions)]
            position_tensor = torch.tensor(positions + slots, dtype=torch.long)
            position_tensor = position_tensor.to(self.device, non_blocking=True)
            metadata = build_metadata(position_tensor[len(positions):],
                                      list(range(len(active) + 1)),
                                      [p + 1 for p in positions], rows)
            hidden = self.model(tokens, position_tensor[: len(positions)], self.kv_caches,
                                metadata)
            argmax = self.model.compute_logits(hidden).argmax(dim=-1)
            outputs.append((list(active), argmax))
            keep = [n for n, i in enumerate(active) if steps[i] > j + 1]
            if not keep:
                break
            if len(keep) < len(active):
                argmax = argmax[torch.tensor(keep, dtype=torch.long, device=self.device)]
                active = [active[n] for n in keep]
            tokens = argmax
        host = torch.cat([t for _, t in outputs]).tolist()  # one device-to-host copy
        offset = 0
        for indices, step_tokens in outputs:
            for n, i in enumerate(indices):
                proposals[i].append(host[offset + n])
            offset += step_tokens.shape[0]
        return proposals

    def profile_run(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    metadata: AttentionMetadata, num_blocks: int, dtype: torch.dtype) -> None:
        """The largest step through the draft on a temporary cache of ``num_blocks`` blocks
        (the memory profile counts the draft's activations with the target's)."""
        saved = self.kv_caches
        self.initialize_kv_cache(num_blocks, dtype)
        try:
            self.forward_step(input_ids, positions, metadata)
        finally:
            self.kv_caches = saved
