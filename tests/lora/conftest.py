"""A tiny Llama and three random PEFT adapters of it, built once per test session."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class LoRAModels:
    model: Path
    # name -> adapter folder
    adapters: dict[str, Path]


@pytest.fixture(scope="session")
def lora_models(tmp_path_factory) -> LoRAModels:
    pytest.importorskip("peft")
    from octavo.testing.lora_adapters import make_peft_adapter
    from octavo.testing.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("lora")
    model = make_tiny_model(root / "llama", "llama")
    adapters = {
        # Every projection, rank 8.
        "all": make_peft_adapter(model, root / "all", 8, ALL, lora_alpha=16, seed=1),
        # Attention q/v only, rsLoRA scaling, rank 4.
        "qv": make_peft_adapter(model, root / "qv", 4, ["q_proj", "v_proj"], lora_alpha=8,
                                use_rslora=True, seed=2),
        # The MLP and o_proj at the maximum rank.
        "mlp": make_peft_adapter(model, root / "mlp", 16, ["o_proj", "up_proj", "down_proj"],
                                 lora_alpha=32, seed=3),
    }
    return LoRAModels(model, adapters)
