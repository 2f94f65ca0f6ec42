"""The contract between the model runner and a model class (built-in or from a plugin).

A model class is built as ``cls(hf_config, attn_backend)`` (plus ``parallel=`` when it declares
``supports_parallel``, and ``max_model_len=``, the engine's context length, when it declares
``accepts_max_model_len``: sliding windows that do not bind and length-dependent rope scaling
follow it) under the runner's default device and dtype, then:

- ``load_weights(weights)`` fills every parameter from ``(HF name, tensor)`` pairs (lazy
  ``CheckpointTensor``s when the class declares ``lazy_weights``);
- ``forward(input_ids, positions, kv_caches, attn_metadata)`` returns the hidden states of the
  flat batch, ``[num_tokens, hidden_size]`` after the final norm; split into pipeline stages, it
  also takes the previous stage's ``IntermediateTensors`` and returns its own on every stage but
  the last;
- ``compute_logits(hidden_states)`` gives float32 ``[n, vocab_size]`` (the last stage only).

``octavo.model_executor.models.llama.LlamaForCausalLM`` is the reference implementation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class IntermediateTensors:
    """What one pipeline stage hands the next: the residual stream, in two parts."""

    # [num_tokens, hidden_size]
    hidden_states: torch.Tensor
    # [num_tokens, hidden_size]
    residual: torch.Tensor
