"""Log-probabilities of chosen tokens and of the top-k tokens, from raw logits.

Like vLLM V1's default, logprobs describe the model's own distribution: ``log_softmax`` of the
logits as the model produced them, before logit bias, penalties, temperature or filtering.
The same function serves sampled tokens and prompt logprobs (chosen = the next prompt token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LogprobsTensors:
    """Logprobs of one batch of rows; row ``i`` belongs to logits row ``i``."""

    # [batch, k+1] int64: column 0 = the chosen/actual token, then the top-k tokens by logprob.
    token_ids: torch.Tensor
    # [batch, k+1] float32: log-probabilities of those tokens.
    logprobs: torch.Tensor
    # [batch] int64: rank of the chosen token (1 = most likely; ties share the best rank).
    ranks: torch.Tensor


def compute_logprobs(
    logits: torch.Tensor,  # [batch, vocab], any float dtype
    chosen_token_ids: torch.Tensor,  # [batch] int
    num_top: int,
) -> LogprobsTensors:
    """Logprob and rank of each row's chosen token, plus its ``num_top`` most likely tokens.

    Computed in float32. The top-k columns are sorted by decreasing logprob (ties in an
    unspecified order). The rank is 1 + the number of tokens strictly more likely than the
    chosen one. Raises ``ValueError`` for a ``num_top`` outside ``[0, vocab]`` or mismatched
    shapes.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    batch, vocab_size = logits.shape
    if not 0 <= num_top <= vocab_size:
        raise ValueError(f"num_top must be in [0, {vocab_size}] (the vocab size), got {num_top}")
    if tuple(chosen_token_ids.shape) != (batch,):
        raise ValueError(
            f"chosen_token_ids must have shape ({batch},), got {tuple(chosen_token_ids.shape)}"
        )
    logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [batch, vocab]
    chosen = chosen_token_ids.to(device=logits.device, dtype=torch.int64).unsqueeze(1)  # [batch, 1]
    chosen_logprobs = logprobs.gather(1, chosen)  # [batch, 1]
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1  # [batch]
    if num_top > 0:
        top_logprobs, top_ids = torch.topk(logprobs, num_top, dim=-1)  # [batch, num_top]
        token_ids = torch.cat([chosen, top_ids], dim=1)
        values = torch.cat([chosen_logprobs, top_logprobs], dim=1)
    else:
        token_ids, values = chosen, chosen_logprobs
    return LogprobsTensors(token_ids=token_ids, logprobs=values, ranks=ranks)
