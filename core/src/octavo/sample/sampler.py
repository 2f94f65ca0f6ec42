"""The batched sampler: one next token per row of logits, plus optional logprobs.

Per step, on the logits' device, in float32 (a copy: the caller's logits are never modified):

0. structured outputs: tokens a constrained row's grammar does not allow get ``-inf`` (its
   bitmask, unpacked on the device: no loop over rows or the vocabulary);
1. ``logit_bias`` is added; tokens outside ``allowed_token_ids`` and the last token of a
   ``bad_words`` sequence the output is completing get ``-inf`` (``token_masks.py``); the
   request's logits processors run (``logits_processor.py``);
2. ``min_tokens``: until a row has generated ``min_tokens`` tokens, its stop tokens
   (``stop_token_ids`` and, unless ``ignore_eos``, the model's EOS ids) get ``-inf``;
3. penalties: repetition (HF: on tokens in prompt or output, ``logit / p`` if positive else
   ``logit * p``), then frequency (``- p * count in output``) and presence (``- p`` if in output);
4. greedy rows take the argmax of these processed logits;
5. other rows: divide by temperature, keep top-k, then top-p (one sort for both), then min-p,
   softmax, and draw ``argmax(probs / q)`` with ``q ~ Exponential(1)`` -- a sample from
   ``probs`` (the "exponential race"). Unseeded rows draw ``q`` in one batched call from the
   device's default generator; each seeded row draws its own ``q`` from a generator seeded
   with ``step_seed(seed, position)`` (see ``octavo.sample.metadata``), so its token depends
   only on its seed, position and logits, whatever the batch and across preemption.

Logprobs, when any row asks for them, come from the raw logits (see ``logprobs.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch

from octavo import envs
from octavo.kernels.argmax import argmax_rows
from octavo.kernels.triton_support import optional_triton_kernels
from octavo.sample.logits_processor import LogitsProcessorRegistry, apply_logits_processors
from octavo.sample.logprobs import LogprobsTensors, compute_logprobs
from octavo.sample.metadata import (
    DeviceGrammarMasks,
    GrammarRows,
    SamplingMetadata,
    SamplingRow,
)
from octavo.sample.token_masks import apply_token_masks

# Smallest exponential draw used: keeps probs / q finite and never 0 / 0.
_MIN_EXPONENTIAL = torch.finfo(torch.float32).tiny


@dataclass(slots=True)
class SamplerOutput:
    """What the sampler returns for one step."""

    # [batch] int64: the token chosen for each row, on the logits' device.
    sampled_token_ids: torch.Tensor
    # Logprobs with k = max requested over rows; None when no row asked for logprobs.
    logprobs: LogprobsTensors | None


class Sampler:
    """Stateless batched sampler; see the module docstring for the exact pipeline.

    :param logits_processors: the registered logits processors rows may select (None: rows
        must select none).
    """

    def __init__(self, logits_processors: LogitsProcessorRegistry | None = None) -> None:
        self.logits_processors = logits_processors

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow],
        grammar: GrammarRows | DeviceGrammarMasks | None = None,
    ) -> SamplerOutput:
        """Sample one token per row; ``logits`` is ``[batch, vocab]`` with ``batch == len(rows)``;
        ``grammar``: bitmasks of the constrained rows (on the host, or already on the device).

        Raises ``ValueError`` when the logits are not 2-D or their batch size differs from
        ``len(rows)``.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        if logits.shape[0] != len(rows):
            raise ValueError(
                f"logits have {logits.shape[0]} rows but {len(rows)} sampling rows were given"
            )
        metadata = SamplingMetadata.from_rows(rows, logits.shape[1], logits.device, grammar,
                                              self.logits_processors)
        return self.sample(logits, metadata)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample with prebuilt ``metadata`` (built for these logits' shape and device)."""
        if tuple(logits.shape) != (metadata.num_rows, metadata.vocab_size):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not match the metadata's "
                f"({metadata.num_rows}, {metadata.vocab_size})"
            )
        if (
            metadata.all_greedy
            and metadata.no_penalties
            and metadata.bias_row_ids is None
            and metadata.min_tokens_row_ids is None
            and metadata.grammar_bitmask is None
            and metadata.token_masks is None
            and metadata.logits_processors is None
        ):
            # Fast path of the common greedy batch: nothing to process, no float32 copy.
            sampled = argmax_rows(logits)
            processed = None
        else:
            processed = self.process_logits(logits, metadata)  # [batch, vocab] float32
        if processed is None:
            pass
        elif metadata.all_greedy:
            sampled = argmax_rows(processed)
        else:
            greedy = None if metadata.all_random else processed.argmax(dim=-1)
            sampled = self.sample_random(processed, metadata)
            if greedy is not None:
                sampled = torch.where(metadata.greedy_mask, greedy, sampled)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            num_top = min(metadata.max_num_logprobs, metadata.vocab_size)
            logprobs = compute_logprobs(logits, sampled, num_top)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def process_logits(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Steps 0-3 (grammar, bias, min_tokens, penalties) on a float32 copy: what greedy rows
        argmax."""
        out = logits.to(torch.float32, copy=True)  # [batch, vocab]
        apply_grammar_bitmask(out, metadata)
        apply_logit_bias(out, metadata)
        apply_token_masks(out, metadata.token_masks)
        apply_logits_processors(out, metadata.logits_processors)
        apply_min_tokens(out, metadata)
        apply_penalties(out, metadata)
        return out

    def sample_random(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Step 5 on processed logits (modified in place): one sampled token per row, [batch].

        Greedy rows get a meaningless value here; ``sample`` replaces it with their argmax.
        """
        assert metadata.temperature is not None, "sample_random needs temperatures"
        logits.div_(metadata.temperature.unsqueeze(1))
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        if metadata.min_p is not None:
            apply_min_p(logits, metadata.min_p)
        probs = logits.softmax(dim=-1)  # [batch, vocab]
        return exponential_race(probs, metadata.seeded_rows)


def apply_grammar_bitmask(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Set the tokens each constrained row's grammar forbids to ``-inf``, in place."""
    if metadata.grammar_bitmask is None:
        return
    mask_by_bitmask(logits, metadata.grammar_row_ids, metadata.grammar_bitmask)


def mask_by_bitmask(logits: torch.Tensor, row_ids: torch.Tensor | None,
                    bitmask: torch.Tensor) -> None:
    """Set the tokens of ``logits`` rows ``row_ids`` [k] (every row, in order, when None)
    that ``bitmask`` [k, words] (on the logits' device) does not allow to ``-inf``, in place.
    On CUDA (and HIP) one Triton kernel (``octavo.kernels.triton.token_bitmask``;
    ``OCTAVO_BITMASK_KERNEL=0``: the torch ops), elsewhere ``mask_by_bitmask_reference``."""
    kernel = _bitmask_kernel() if logits.device.type == "cuda" else None
    if kernel is not None:
        kernel.apply_token_bitmask(logits, row_ids, bitmask)
    else:
        mask_by_bitmask_reference(logits, row_ids, bitmask)


@functools.cache
def _bitmask_kernel() -> ModuleType | None:
    """The Triton kernel's module, or None (switched off, or no Triton here); read once."""
    return optional_triton_kernels("token_bitmask") if envs.bitmask_kernel() else None


def mask_by_bitmask_reference(logits: torch.Tensor, row_ids: torch.Tensor | None,
                              bitmask: torch.Tensor) -> None:
    """``mask_by_bitmask`` in torch ops, on any device: three kernels for every row (bits,
    refused, fill), two more for some rows (gather and scatter of those rows)."""
    refused = _unpack(bitmask, logits.shape[1], allowed=False)  # [k, vocab] bool
    if row_ids is None:
        logits.masked_fill_(refused, float("-inf"))
    else:
        logits[row_ids] = logits[row_ids].masked_fill_(refused, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[k, words]`` int32 bitmask -> ``[k, vocab_size]`` bool (True: allowed). Tokens past
    the bitmask's ``32 * words`` are not allowed."""
    return _unpack(bitmask, vocab_size, allowed=True)


def _unpack(bitmask: torch.Tensor, vocab_size: int, allowed: bool) -> torch.Tensor:
    """``unpack_bitmask`` (``allowed``) or its complement, each in two kernels."""
    k, words = bitmask.shape
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [k, 4 * words], little-endian
    bits = as_bytes.unsqueeze(-1).bitwise_and(_bit_values(bitmask.device))  # [k, 4w, 8]
    out = (bits.ne(0) if allowed else bits.eq(0)).view(k, 32 * words)
    if 32 * words >= vocab_size:
        return out[:, :vocab_size]
    padded = out.new_full((k, vocab_size), not allowed)
    padded[:, : 32 * words] = out
    return padded


@functools.lru_cache(maxsize=None)
def _bit_values(device: torch.device) -> torch.Tensor:
    """[8] uint8: 1, 2, 4, ..., 128 on ``device`` (made once per device, not per step)."""
    return torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=device)


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Add each row's ``logit_bias`` to ``logits`` [batch, vocab] in place."""
    if metadata.bias_row_ids is None:
        return
    assert metadata.bias_token_ids is not None and metadata.bias_values is not None
    index = (metadata.bias_row_ids, metadata.bias_token_ids)
    logits.index_put_(index, metadata.bias_values, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Set the stop tokens of rows below ``min_tokens`` to ``-inf``, in place."""
    if metadata.min_tokens_row_ids is None:
        return
    assert metadata.min_tokens_token_ids is not None
    index = (metadata.min_tokens_row_ids, metadata.min_tokens_token_ids)
    logits.index_put_(index, logits.new_full((), float("-inf")))


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Apply repetition, frequency and presence penalties to ``logits`` [batch, vocab] in place.

    Counts come from ``scatter_add`` of the padded id tensors into a ``[batch, vocab + 1]``
    buffer whose last column absorbs the padding.
    """
    output_ids = metadata.output_token_ids
    if output_ids is None:
        return
    batch, vocab_size = logits.shape
    counts = torch.zeros(batch, vocab_size + 1, dtype=torch.float32, device=logits.device)
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=torch.float32))
    counts = counts[:, :vocab_size]  # [batch, vocab]: occurrences in the output
    in_output = counts > 0  # [batch, vocab]

    if metadata.repetition_penalties is not None:
        assert metadata.prompt_token_ids is not None, "repetition penalty needs prompt ids"
        prompt_ids = metadata.prompt_token_ids
        seen = torch.zeros(batch, vocab_size + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, prompt_ids, torch.ones_like(prompt_ids, dtype=torch.bool))
        seen = seen[:, :vocab_size] | in_output  # [batch, vocab]
        penalty = metadata.repetition_penalties.unsqueeze(1)  # [batch, 1]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, penalized, logits))
    if metadata.frequency_penalties is not None:
        logits.sub_(metadata.frequency_penalties.unsqueeze(1) * counts)
    if metadata.presence_penalties is not None:
        logits.sub_(metadata.presence_penalties.unsqueeze(1) * in_output)


def apply_top_k_top_p(
    logits: torch.Tensor,  # [batch, vocab]
    top_k: torch.Tensor | None,  # [batch] int64 in [1, vocab]
    top_p: torch.Tensor | None,  # [batch] float32 in (0, 1]
) -> torch.Tensor:  # [batch, vocab]
    """Mask to ``-inf`` all but each row's top-k tokens, then all but its top-p nucleus.

    One ascending sort serves both. Top-k keeps every token tied with the k-th largest logit.
    Top-p keeps the smallest set of most likely tokens whose probability (after top-k) adds
    up to at least ``top_p``; the most likely token is always kept.
    """
    vocab_size = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1)  # ascending, [batch, vocab]
    if top_k is not None:
        kth_position = (vocab_size - top_k).clamp(0, vocab_size - 1).unsqueeze(1)  # [batch, 1]
        kth_logit = sorted_logits.gather(1, kth_position)  # [batch, 1]
        sorted_logits.masked_fill_(sorted_logits < kth_logit, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [batch, vocab]
        drop = cumulative <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask tokens whose probability is below ``min_p`` [batch] times the row's maximum."""
    probs = logits.softmax(dim=-1)  # [batch, vocab]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [batch, 1]
    logits.masked_fill_(probs < threshold, float("-inf"))


def exponential_race(
    probs: torch.Tensor,  # [batch, vocab] float32, rows sum to 1
    seeded_rows: list[tuple[int, int]],
) -> torch.Tensor:  # [batch] int64
    """Draw one token per row from ``probs`` as ``argmax(probs / q)``, ``q ~ Exponential(1)``.

    Rows not in ``seeded_rows`` share one batched draw from the default generator; each
    ``(row, seed)`` in ``seeded_rows`` draws its whole ``q`` row from a fresh generator seeded
    with ``seed`` (one small Python loop over seeded rows only).
    """
    q = torch.empty_like(probs).exponential_()  # [batch, vocab]
    for row, seed in seeded_rows:
        generator = torch.Generator(device=probs.device)
        generator.manual_seed(seed)
        q[row].exponential_(generator=generator)
    q.clamp_(min=_MIN_EXPONENTIAL)
    return probs.div(q).argmax(dim=-1)
