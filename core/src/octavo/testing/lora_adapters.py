"""Random LoRA adapters in PEFT's format for tests (needs ``peft``).

``make_peft_adapter`` wraps a tiny model folder's weights in a ``peft`` LoRA of the given rank
and target modules, randomises A and B (PEFT starts B at zero, which would change nothing)
and saves the adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).
"""

from __future__ import annotations

from pathlib import Path

import torch


def make_peft_adapter(model_dir: Path, folder: Path, rank: int, target_modules: list[str],
                      lora_alpha: float = 16.0, use_rslora: bool = False, seed: int = 0,
                      std: float = 0.2) -> Path:
    """Save a random LoRA adapter of the model at ``model_dir`` into ``folder``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=lora_alpha, target_modules=target_modules,
                        use_rslora=use_rslora, lora_dropout=0.0, init_lora_weights=False)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, std)
    model.save_pretrained(folder, safe_serialization=True)
    return Path(folder)


def peft_reference_model(model_dir: Path, adapter_dir: Path | None):
    """Transformers' model of ``model_dir`` with the adapter (unmerged), or without."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is None:
        return base.eval()
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()
