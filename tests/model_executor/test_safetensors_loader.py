"""safetensors loader: tiny HF models saved single-file and sharded, read back name for name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from octavo.model_executor.loader.safetensors_loader import (
    INDEX_FILE,
    iterate_safetensors_weights,
)
from tests.helpers.tiny import make_tiny_model


def hf_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype="auto").state_dict()


def assert_matches_hf(folder: Path, tied: bool) -> dict[str, torch.Tensor]:
    loaded = dict(iterate_safetensors_weights(folder))
    expected = hf_state_dict(folder)
    # save_pretrained drops the tied lm_head.weight; HF's state_dict still lists it.
    expected_names = set(expected) - ({"lm_head.weight"} if tied else set())
    assert set(loaded) == expected_names
    for name, tensor in loaded.items():
        assert tensor.dtype == expected[name].dtype, name
        assert torch.equal(tensor, expected[name]), name
    return loaded


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen3", True)])
def test_single_file(tmp_path: Path, arch: str, tied: bool) -> None:
    folder = make_tiny_model(tmp_path / arch, arch)
    assert (folder / "model.safetensors").is_file() and not (folder / INDEX_FILE).exists()
    assert_matches_hf(folder, tied)


def test_sharded(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "sharded", "qwen2", max_shard_size="20KB")
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (folder / INDEX_FILE).is_file()
    assert_matches_hf(folder, tied=True)


def test_stored_dtype_is_kept(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "bf16", "llama", dtype=torch.bfloat16)
    loaded = assert_matches_hf(folder, tied=False)
    assert {tensor.dtype for tensor in loaded.values()} == {torch.bfloat16}


def test_missing_shard_is_named(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "sharded", "llama", max_shard_size="20KB")
    weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    missing = sorted(set(weight_map.values()))[-1]
    (folder / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing):
        iterate_safetensors_weights(folder)


def test_folder_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    message = r"pytorch_model\.bin.*not supported.*save_pretrained"
    with pytest.raises(FileNotFoundError, match=message):
        iterate_safetensors_weights(tmp_path)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        iterate_safetensors_weights(tmp_path / "absent")
