"""Mistral: the Llama decoder, with an optional sliding attention window in its config."""

from __future__ import annotations

from typing import Any

from octavo.model_executor.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Same weights and maths as Llama.

    A set ``config.sliding_window`` is only recorded in ``self.sliding_window``: attention is
    full, so it is exact while the context stays within the window, and the engine caps
    ``max_model_len`` to it.
    """

    @classmethod
    def sliding_window_of(cls, config: Any) -> int | None:
        window = getattr(config, "sliding_window", None)
        return int(window) if window else None
