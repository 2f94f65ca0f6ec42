"""Per-step sampling inputs: one ``SamplingRow`` per sequence, batched into ``SamplingMetadata``.

The model runner hands the sampler one ``SamplingRow`` per row of logits. ``SamplingMetadata``
turns them into tensors on the logits' device once per step; a ``None`` tensor means "no row
uses this feature", so the sampler can skip that stage entirely (the ``no_*``/``all_*`` flags).

Seeding contract: a seeded row's randomness for one step comes from a fresh generator seeded
with ``step_seed(seed, len(output_token_ids))``. A seeded completion's tokens therefore depend
only on its seed, its position and its logits -- not on the other rows of the batch, nor on
whether the request was preempted and recomputed (on the same device type: CPU and CUDA random
streams differ).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from octavo.sample.logits_processor import LogitsProcessorBatch, LogitsProcessorRegistry
from octavo.sample.token_masks import TokenMasks
from octavo.sampling_params import SamplingParams
from octavo.transfer import host_to_device

_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


@dataclass(slots=True)
class SamplingRow:
    """One row of logits to sample: one sequence (one completion) in this step."""

    # Sampling settings of the request the sequence belongs to.
    params: SamplingParams
    # The prompt's token ids.
    prompt_token_ids: list[int]
    # Tokens generated so far, NOT including the one sampled now.
    output_token_ids: list[int]

    @property
    def seed(self) -> int | None:
        """This completion's effective seed (distinct per completion when n > 1; None:
        unseeded): its sampling params carry it."""
        return self.params.seed


@dataclass(slots=True)
class GrammarRows:
    """Token bitmasks of the constrained rows of a step, on the host (``from_rows`` copies
    them to the logits' device)."""

    # Logits rows the masks apply to.
    row_ids: list[int]
    # [len(row_ids), words] int32, bit t % 32 of word t // 32 set: token t allowed.
    bitmask: torch.Tensor


@dataclass(slots=True)
class DeviceGrammarMasks:
    """The masks of a step's constrained rows already on the logits' device (the model
    runner stages them: ``octavo.worker.grammar_masks``)."""

    # [k] int64 logits rows the masks apply to; None: every row, in order.
    row_ids: torch.Tensor | None
    # [k, words] int32, bit t % 32 of word t // 32 set: token t allowed.
    bitmask: torch.Tensor


@dataclass(slots=True)
class SamplingMetadata:
    """Batched sampling settings of one step; every tensor lives on the logits' device.

    Build it with ``from_rows``. Optional tensors are ``None`` when no row needs that stage.
    Token ids at or above ``vocab_size`` in ``logit_bias`` / stop token ids are dropped;
    in prompt/output ids they are ignored by the penalties.
    """

    # Number of rows (= logits.shape[0]).
    num_rows: int
    # Number of columns of the logits.
    vocab_size: int
    # Every row is greedy: no temperature, filtering or random draw is needed.
    all_greedy: bool
    # No row is greedy: the argmax of the processed logits is not needed.
    all_random: bool
    # [num_rows] bool: True where the row takes the argmax.
    greedy_mask: torch.Tensor
    # [num_rows] float32: temperature of sampled rows (1.0 on greedy rows); None if all_greedy.
    temperature: torch.Tensor | None
    # [num_rows] int64: top_k, vocab_size where disabled; None if no row uses it.
    top_k: torch.Tensor | None
    # [num_rows] float32: top_p, 1.0 where disabled; None if no row uses it.
    top_p: torch.Tensor | None
    # [num_rows] float32: min_p, 0.0 where disabled; None if no row uses it.
    min_p: torch.Tensor | None
    # [num_rows] float32 each: penalties, neutral (1 / 0 / 0) where unused; None if unused by all.
    repetition_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    presence_penalties: torch.Tensor | None
    # [num_rows, max_prompt_len] int64, padded with vocab_size; only with repetition_penalties.
    prompt_token_ids: torch.Tensor | None
    # [num_rows, max_output_len] int64, padded with vocab_size; None when no penalty is used.
    output_token_ids: torch.Tensor | None
    # [num_bias] int64 / int64 / float32: (row, token, bias) triples; None when no row has a bias.
    bias_row_ids: torch.Tensor | None
    bias_token_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    # [num_masked] int64 each: (row, token) pairs set to -inf because min_tokens is not reached.
    min_tokens_row_ids: torch.Tensor | None
    min_tokens_token_ids: torch.Tensor | None
    # (row index, step seed) of every seeded, non-greedy row; see ``step_seed``.
    seeded_rows: list[tuple[int, int]]
    # Most top logprobs any row asked for (k); None when no row asked for logprobs.
    max_num_logprobs: int | None
    # Structured outputs: [num_constrained, words] int32 token bitmasks (bit t % 32 of word
    # t // 32: token t allowed), None when no row is constrained, and the [num_constrained]
    # int64 rows they apply to (None: every row, in order).
    grammar_row_ids: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None
    # allowed_token_ids and bad_words masks (octavo.sample.token_masks); None if unused.
    token_masks: TokenMasks | None = None
    # Plugins' logits processors to run (octavo.sample.logits_processor); None if unused.
    logits_processors: LogitsProcessorBatch | None = None

    @property
    def no_penalties(self) -> bool:
        """True when no row has a repetition, frequency or presence penalty."""
        return self.output_token_ids is None

    @classmethod
    def from_rows(
        cls,
        rows: list[SamplingRow],
        vocab_size: int,
        device: torch.device | str,
        grammar: GrammarRows | DeviceGrammarMasks | None = None,
        logits_processors: LogitsProcessorRegistry | None = None,
    ) -> SamplingMetadata:
        """Batch ``rows`` into tensors on ``device``; row ``i`` describes logits row ``i``.
        ``grammar`` gives the token bitmasks of the constrained rows (structured outputs):
        host rows are copied to ``device``, ``DeviceGrammarMasks`` are used as they are.

        ``logits_processors``: where the rows' named processors come from (needed when a row
        selects one). Raises ``ValueError`` when ``vocab_size`` is not positive.
        """
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
        params = [row.params for row in rows]
        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)

        def floats(values: list[float]) -> torch.Tensor:
            return host_to_device(torch.tensor(values, dtype=torch.float32), device)

        temperature = None
        if not all_greedy:
            temperature = floats([1.0 if g else p.temperature for p, g in zip(params, greedy)])
        top_k = top_p = min_p = None
        if any(p.top_k > 0 and not g for p, g in zip(params, greedy)):
            ks = [vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size) for p in params]
            top_k = host_to_device(torch.tensor(ks, dtype=torch.int64), device)
        if any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)):
            top_p = floats([p.top_p for p in params])
        if any(p.min_p > 0.0 and not g for p, g in zip(params, greedy)):
            min_p = floats([p.min_p for p in params])

        repetition = frequency = presence = prompt_ids = output_ids = None
        if any(p.repetition_penalty != 1.0 for p in params):
            repetition = floats([p.repetition_penalty for p in params])
            prompt_ids = _pad([row.prompt_token_ids for row in rows], vocab_size, device)
        if any(p.frequency_penalty != 0.0 for p in params):
            frequency = floats([p.frequency_penalty for p in params])
        if any(p.presence_penalty != 0.0 for p in params):
            presence = floats([p.presence_penalty for p in params])
        if repetition is not None or frequency is not None or presence is not None:
            output_ids = _pad([row.output_token_ids for row in rows], vocab_size, device)

        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        mask_rows: list[int] = []
        mask_tokens: list[int] = []
        seeded_rows: list[tuple[int, int]] = []
        for i, (row, p) in enumerate(zip(rows, params)):
            for token_id, value in (p.logit_bias or {}).items():
                if token_id < vocab_size:
                    bias_rows.append(i)
                    bias_tokens.append(token_id)
                    bias_values.append(value)
            if len(row.output_token_ids) < p.min_tokens:
                stop_ids = set(p.stop_token_ids or [])
                if not p.ignore_eos:
                    stop_ids |= p.all_stop_token_ids
                for token_id in sorted(stop_ids):
                    if token_id < vocab_size:
                        mask_rows.append(i)
                        mask_tokens.append(token_id)
            if p.seed is not None and not greedy[i]:
                seeded_rows.append((i, step_seed(p.seed, len(row.output_token_ids))))

        def longs(values: list[int]) -> torch.Tensor:
            return host_to_device(torch.tensor(values, dtype=torch.int64), device)

        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=host_to_device(torch.tensor(greedy, dtype=torch.bool), device),
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalties=repetition,
            frequency_penalties=frequency,
            presence_penalties=presence,
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            bias_row_ids=longs(bias_rows) if bias_rows else None,
            bias_token_ids=longs(bias_tokens) if bias_rows else None,
            bias_values=floats(bias_values) if bias_rows else None,
            min_tokens_row_ids=longs(mask_rows) if mask_rows else None,
            min_tokens_token_ids=longs(mask_tokens) if mask_rows else None,
            seeded_rows=seeded_rows,
            max_num_logprobs=max(asked) if asked else None,
            grammar_row_ids=_grammar_row_ids(grammar, longs),
            grammar_bitmask=None if grammar is None else (
                grammar.bitmask if isinstance(grammar, DeviceGrammarMasks)
                else host_to_device(grammar.bitmask, device)),
            token_masks=TokenMasks.from_rows(rows, vocab_size, device),
            logits_processors=_processor_batch(rows, logits_processors, vocab_size, device),
        )


def _processor_batch(rows: list[SamplingRow], registry: LogitsProcessorRegistry | None,
                     vocab_size: int, device: torch.device | str) -> LogitsProcessorBatch | None:
    if not any(row.params.logits_processors for row in rows):
        return None
    if registry is None:
        raise ValueError("rows select logits processors but no registry was given")
    return LogitsProcessorBatch.from_rows(rows, registry, vocab_size, device)


def step_seed(seed: int, position: int) -> int:
    """The 64-bit generator seed of a seeded row at ``position`` (= tokens generated so far).

    A fixed mix (splitmix64 finalizer) of ``seed`` and ``position``; nearby seeds and positions
    give unrelated streams. Any Python int ``seed`` is accepted (taken modulo 2**64).
    """
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    return _mix64((_mix64(seed & _MASK64) + (position + 1) * _GOLDEN64) & _MASK64)


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection on 64-bit ints that scrambles every bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _pad(
    token_ids: list[list[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:  # [num_rows, max_len] int64
    """Right-pad each list with ``vocab_size`` (the penalties' scratch column).

    Ids at or above ``vocab_size`` are replaced by the pad so they touch no real token.
    """
    max_len = max((len(ids) for ids in token_ids), default=0)
    padded = np.full((len(token_ids), max_len), vocab_size, dtype=np.int64)
    for i, ids in enumerate(token_ids):
        padded[i, : len(ids)] = ids
    out = torch.from_numpy(padded).clamp_(max=vocab_size)
    return host_to_device(out, device)


def _grammar_row_ids(grammar: GrammarRows | DeviceGrammarMasks | None,
                     longs: Callable[[list[int]], torch.Tensor]) -> torch.Tensor | None:
    """The logits rows the masks apply to, on the device (None: every row, in order)."""
    if grammar is None:
        return None
    if isinstance(grammar, DeviceGrammarMasks):
        return grammar.row_ids
    return longs(grammar.row_ids)
