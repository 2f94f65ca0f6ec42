"""Hugging Face transformers ``generate`` on the same workload, for ``--compare-hf``.

Static batches (left-padded), greedy, exactly ``max(output_len)`` new tokens per batch with EOS
disabled; only the tokens each request asked for are counted, as a serving system would
return them. Same dtype and device as the Octavo run. A progress bar counts the decoding
steps of all batches (with the time left), through a pass-through logits processor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from octavo.config import ModelConfig

if TYPE_CHECKING:
    from octavo.cli.bench import Workload


@dataclass(slots=True)
class HFResult:
    # Wall-clock seconds for the whole workload (model load excluded).
    elapsed_s: float
    # Requested output tokens / elapsed.
    output_tokens_per_s: float
    # Static batch size used.
    batch_size: int


def load_hf_model(model_config: ModelConfig, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": model_config.dtype}
    if model_config.gguf_file is not None:
        kwargs["gguf_file"] = model_config.gguf_file.name
    model = AutoModelForCausalLM.from_pretrained(model_config.model_dir, **kwargs)
    return model.to(device).eval()


class _StepProgress:
    """A logits processor that changes nothing and advances a progress bar once per decoding
    step (``generate`` calls its logits processors once per new token)."""

    def __init__(self, bar) -> None:
        self.bar = bar

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.bar.update(1)
        return scores


@torch.inference_mode()
def run_hf_generate(model_config: ModelConfig, workload: Workload, batch_size: int | None,
                    device: str = "cpu") -> HFResult:
    from tqdm.auto import tqdm
    from transformers import LogitsProcessorList

    model = load_hf_model(model_config, device)
    batch_size = batch_size or len(workload.prompts)
    pad_id = 0
    batches = range(0, len(workload.prompts), batch_size)
    num_steps = sum(max(workload.output_lens[first:first + batch_size]) for first in batches)
    bar = tqdm(total=num_steps, desc=f"HF generate ({len(batches)} batch(es))", unit="step",
               dynamic_ncols=True)
    progress = LogitsProcessorList([_StepProgress(bar)])
    start = time.perf_counter()
    for first in batches:
        prompts = workload.prompts[first : first + batch_size]
        longest = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, longest - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, longest - len(prompt):] = 1
        new_tokens = max(workload.output_lens[first : first + batch_size])
        model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            logits_processor=progress,
        )
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    bar.close()
    return HFResult(elapsed, workload.num_output_tokens / elapsed, batch_size)
