"""The batched rejection sampler of speculative decoding: which draft tokens the target model
accepts, and the token it adds, for every request of a step at once (torch on the logits'
device; no Python loop over rows or the vocabulary).

Layout ("flat rows"): request ``b`` with ``k_b`` draft tokens owns ``k_b + 1`` consecutive rows
of the target's distributions: row ``j < k_b`` is the target's distribution at the position of
draft ``j`` (given the tokens before it, drafts ``< j`` included), row ``k_b`` the one after the
last draft. A request with no draft has one row: a plain sample.

The rule, per request, row by row from ``j = 0``:

- greedy rows: draft ``j`` is accepted while it equals the target's argmax; at the first
  mismatch (or after the last draft) the target's argmax is emitted. The emitted tokens are
  exactly those of greedy decoding without speculation.
- sampled rows (target distribution ``p``, draft distribution ``q``): draft ``d`` is accepted
  with probability ``min(1, p(d) / q(d))`` (``u * q(d) < p(d)``, ``u ~ U[0, 1)``); at the first
  rejection a token is drawn from ``max(0, p - q)`` renormalised; when every draft is accepted
  a bonus token is drawn from ``p`` of the last row. Each emitted token is then distributed as
  ``p`` (Leviathan et al. 2023, Chen et al. 2023). A deterministic proposer (ngram) has
  ``q = one-hot(d)``: ``draft_probs=None``.

Draws use the exponential race (``octavo.sample.sampler.exponential_race``), which needs no
normalisation, so ``max(0, p - q)`` is raced as it is; rows in ``seeded_rows`` (a request with no
draft and a seed) draw exactly as the plain sampler would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from octavo.sample.metadata import SamplingMetadata
from octavo.sample.sampler import Sampler, apply_min_p, apply_top_k_top_p, exponential_race

# Marks the columns after a request's emitted tokens in ``RejectionOutput.token_ids``.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(slots=True)
class RejectionOutput:
    """What the rejection sampler decided for one step."""

    # [num_reqs, max_k + 1] int64: request b's emitted tokens in columns 0 .. num_emitted[b]-1,
    # PLACEHOLDER_TOKEN_ID after them.
    token_ids: torch.Tensor
    # [num_reqs] int64: tokens emitted per request (accepted drafts + 1), in 1 .. k_b + 1.
    num_emitted: torch.Tensor
    # [num_rows] int64: per flat row, the token emitted at that position, or (rows after the
    # request's last emitted one) some token: logprobs are computed for every row and only the
    # first num_emitted[b] of request b are kept.
    row_token_ids: torch.Tensor


def rejection_sample(
    target_argmax: torch.Tensor,  # [num_rows] int64: argmax of each row's processed logits
    target_probs: torch.Tensor | None,  # [num_rows, vocab] float32 (None: every row greedy)
    is_greedy: torch.Tensor | None,  # [num_rows] bool (None: every row greedy)
    draft_token_ids: torch.Tensor,  # [num_rows] int64: row's draft, -1 on each request's last row
    num_draft_tokens: list[int],  # k_b per request; sum(k_b + 1) == num_rows
    draft_probs: torch.Tensor | None = None,  # [num_rows, vocab] (None: q is one-hot)
    seeded_rows: list[tuple[int, int]] | None = None,  # (row, step seed) of seeded plain rows
    uniform: torch.Tensor | None = None,  # [num_rows] U[0, 1) draws (None: drawn here)
) -> RejectionOutput:
    """Accept/reject every request's drafts and emit its next tokens (see the module doc).

    Raises ``ValueError`` when the row counts disagree.
    """
    device = target_argmax.device
    num_rows = target_argmax.shape[0]
    num_reqs = len(num_draft_tokens)
    if sum(num_draft_tokens) + num_reqs != num_rows or draft_token_ids.shape[0] != num_rows:
        raise ValueError(f"{num_rows} rows given for {num_reqs} requests with "
                         f"{sum(num_draft_tokens)} draft tokens (expected k + 1 rows each)")
    all_greedy = target_probs is None
    has_draft = draft_token_ids >= 0  # [num_rows]
    safe_draft = draft_token_ids.clamp(min=0).unsqueeze(1)  # [num_rows, 1]
    greedy_accept = has_draft & (draft_token_ids == target_argmax)
    if all_greedy:
        accept = greedy_accept
        final = target_argmax
    else:
        assert is_greedy is not None, "sampled rows need is_greedy"
        p_draft = target_probs.gather(1, safe_draft).squeeze(1)  # [num_rows]
        if draft_probs is None:
            q_draft = torch.ones_like(p_draft)
            residual = target_probs.scatter(1, safe_draft, 0.0)  # p - one-hot(d), clamped
        else:
            q_draft = draft_probs.gather(1, safe_draft).squeeze(1)
            residual = (target_probs - draft_probs).clamp_(min=0.0)
        # Rows without a draft draw from p itself (the bonus token, or a plain sample).
        residual = torch.where(has_draft.unsqueeze(1), residual, target_probs)
        if uniform is None:
            uniform = torch.rand(num_rows, device=device)
        random_accept = has_draft & (uniform * q_draft < p_draft)
        accept = torch.where(is_greedy, greedy_accept, random_accept)
        drawn = exponential_race(residual, seeded_rows or [])
        final = torch.where(is_greedy, target_argmax, drawn)
    # Gather the flat rows into [num_reqs, max_k + 1] (padded columns count as rejections).
    rows_per_req = torch.tensor(num_draft_tokens, dtype=torch.int64) + 1
    offsets = torch.cumsum(rows_per_req, 0) - rows_per_req
    max_cols = int(rows_per_req.max()) if num_reqs else 1
    cols = torch.arange(max_cols, dtype=torch.int64)
    valid = cols.unsqueeze(0) < rows_per_req.unsqueeze(1)  # [num_reqs, max_cols]
    index = (offsets.unsqueeze(1) + cols.unsqueeze(0)).clamp(max=max(num_rows - 1, 0))
    index, valid = index.to(device), valid.to(device)
    accepted = accept[index] & valid  # [num_reqs, max_cols]
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [num_reqs]
    position = cols.to(device).unsqueeze(0)
    token_ids = torch.where(position < num_accepted.unsqueeze(1), draft_token_ids[index],
                            final[index])
    token_ids = token_ids.masked_fill(position > num_accepted.unsqueeze(1), PLACEHOLDER_TOKEN_ID)
    # Per flat row: its request's accepted count and its column.
    req_of_row = torch.repeat_interleave(torch.arange(num_reqs), rows_per_req).to(device)
    col_of_row = (torch.arange(num_rows) - torch.repeat_interleave(offsets, rows_per_req)).to(device)
    row_token_ids = torch.where(col_of_row < num_accepted[req_of_row], draft_token_ids, final)
    return RejectionOutput(token_ids=token_ids, num_emitted=num_accepted + 1,
                           row_token_ids=row_token_ids)


def target_distribution(
    sampler: Sampler, logits: torch.Tensor, metadata: SamplingMetadata
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The target's distribution at every row, as the plain sampler would sample it:
    ``(argmax [rows], probs [rows, vocab] or None, is_greedy [rows] or None)``.

    The argmax is that of the processed logits (grammar, bias, masks, min_tokens, penalties:
    what greedy rows take); ``probs`` (None when every row is greedy) adds temperature, top-k,
    top-p and min-p and a softmax (what sampled rows draw from).
    """
    if metadata.all_greedy and metadata.no_penalties and metadata.bias_row_ids is None and (
            metadata.min_tokens_row_ids is None and metadata.grammar_bitmask is None
            and metadata.token_masks is None and metadata.logits_processors is None):
        return logits.argmax(dim=-1), None, None
    processed = sampler.process_logits(logits, metadata)  # [rows, vocab] float32
    argmax = processed.argmax(dim=-1)
    if metadata.all_greedy:
        return argmax, None, None
    assert metadata.temperature is not None
    processed.div_(metadata.temperature.unsqueeze(1))
    if metadata.top_k is not None or metadata.top_p is not None:
        processed = apply_top_k_top_p(processed, metadata.top_k, metadata.top_p)
    if metadata.min_p is not None:
        apply_min_p(processed, metadata.min_p)
    return argmax, processed.softmax(dim=-1), metadata.greedy_mask
