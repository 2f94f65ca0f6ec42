"""Hugging Face transformers as the end-to-end reference, on the host in float32.

The reference always runs on the CPU, whatever the backend's device, so a backend never has to
make transformers work on its hardware. For a 16-bit backend the checkpoint is loaded in that
dtype (the weights the backend sees) and then computed in float32: the reference is the exact
answer for those weights, and the comparison measures only the backend's own rounding.
"""

from __future__ import annotations

from pathlib import Path

import torch


class HFReference:
    """A tiny checkpoint in transformers, with EOS off so lengths match ``ignore_eos``."""

    def __init__(self, folder: Path, dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM

        weights_dtype = getattr(torch, dtype)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=weights_dtype)
        self.model = model.to(torch.float32).eval()
        self.model.generation_config.eos_token_id = None

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], num_tokens: int) -> list[int]:
        """``generate(do_sample=False)`` token ids after the prompt."""
        input_ids = torch.tensor([prompt_ids])
        out = self.model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
            max_new_tokens=num_tokens, pad_token_id=0,
        )
        return out[0, len(prompt_ids):].tolist()

    @torch.inference_mode()
    def next_token_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """[len(token_ids), vocab] float32: row ``p`` is the distribution of token ``p + 1``."""
        logits = self.model(torch.tensor([token_ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)
