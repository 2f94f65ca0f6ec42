"""``octavo.lora.peft``: what a PEFT adapter folder may hold, and the errors for the rest."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from octavo.errors import InvalidRequestError
from octavo.lora.peft import inspect_adapter, load_adapter_weights
from safetensors.torch import save_file
from transformers import AutoConfig


def _copy(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(config_changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


def test_inspect_reads_rank_scale_and_modules(lora_models) -> None:
    hf = AutoConfig.from_pretrained(lora_models.model)
    info = inspect_adapter("all", lora_models.adapters["all"], 16, hf)
    assert info.rank == 8 and info.scale == 16 / 8
    assert len(info.modules) == 7 * 2  # seven projections, two layers
    rs = inspect_adapter("qv", lora_models.adapters["qv"], 16, hf)
    assert rs.scale == pytest.approx(8 / math.sqrt(4))  # rsLoRA
    assert {m.rsplit(".", 1)[1] for m in rs.modules} == {"q_proj", "v_proj"}


def test_weights_are_read_by_module(lora_models) -> None:
    weights = load_adapter_weights("qv", lora_models.adapters["qv"], 16)
    a, b = weights.modules["model.layers.0.self_attn.q_proj"]
    assert a.shape == (4, 64) and b.shape == (64, 4)


@pytest.mark.parametrize("change,message", [
    ({"r": 32}, "rank 32 is over the engine's max_lora_rank 16 (start it with --max-lora-rank 32"),
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias='all'"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules ['embed_tokens'] are not "
                                                     "supported"),
    ({"peft_type": "IA3"}, "only LORA"),
])
def test_bad_configs(lora_models, tmp_path, change, message) -> None:
    folder = _copy(lora_models.adapters["all"], tmp_path / "bad", **change)
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace("[", r"\[")
                       ) as info:
        inspect_adapter("bad", folder, 16)
    assert info.value.param == "lora_path"
    assert str(info.value).startswith("LoRA adapter 'bad': ")


def test_missing_files(tmp_path, lora_models) -> None:
    with pytest.raises(InvalidRequestError, match="no such folder"):
        inspect_adapter("x", tmp_path / "absent", 16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidRequestError, match="has no adapter_config.json"):
        inspect_adapter("x", tmp_path / "empty", 16)
    folder = _copy(lora_models.adapters["qv"], tmp_path / "bin")
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(InvalidRequestError, match="safe_serialization=True"):
        inspect_adapter("x", folder, 16)
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(InvalidRequestError, match="cannot read"):
        inspect_adapter("x", folder, 16)


def test_unsupported_tensors_and_other_models(lora_models, tmp_path) -> None:
    folder = _copy(lora_models.adapters["qv"], tmp_path / "emb", target_modules="regex.*")
    save_file({"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(4, 384),
               "base_model.model.model.embed_tokens.lora_B.weight": torch.zeros(64, 4)},
              str(folder / "adapter_model.safetensors"))
    with pytest.raises(InvalidRequestError, match=r"adapts modules \['embed_tokens'\]"):
        inspect_adapter("emb", folder, 16)
    # An adapter of a model of another width: shapes checked against the base model.
    hf = AutoConfig.from_pretrained(lora_models.model)
    hf.hidden_size = 128
    with pytest.raises(InvalidRequestError, match="an adapter of another model"):
        inspect_adapter("qv", lora_models.adapters["qv"], 16, hf)
    hf = AutoConfig.from_pretrained(lora_models.model)
    hf.num_hidden_layers = 1
    with pytest.raises(InvalidRequestError, match="not a decoder layer"):
        inspect_adapter("qv", lora_models.adapters["qv"], 16, hf)
