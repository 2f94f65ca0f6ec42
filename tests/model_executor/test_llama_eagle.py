"""The EAGLE-1 head (``octavo.model_executor.models.llama_eagle``) against a plain
re-implementation of its formula on the same weights, and its loader's checks.

Reference: ``x = fc(concat(embed(next tokens), target hidden))``, then transformers' own
``LlamaDecoderLayer`` with its input norm removed (EAGLE-1), then the target's LM head; causal
attention over the whole sequence. Ours runs through the paged KV cache, in two chunks over
non-contiguous blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from octavo.attention.base import AttentionMetadata
from octavo.attention.reference import ReferenceAttentionBackend
from octavo.config import ModelConfig
from octavo.model_executor.loader.eagle_loader import load_eagle_head
from octavo.model_executor.models import builtin_registry
from octavo.testing.eagle_heads import eagle_head_tensors, make_tiny_eagle_head, write_eagle_head
from safetensors.torch import load_file, save_file
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from tests.helpers.tiny import make_tiny_model

BLOCK_SIZE = 4
NUM_BLOCKS = 16
TOKENS = [1, 17, 250, 33, 99, 7, 301, 45, 12, 200, 5]


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("target"), "llama")


@pytest.fixture(scope="module")
def target(target_folder: Path) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(target_folder)
    model = builtin_registry().resolve(config.architectures)(config, ReferenceAttentionBackend())
    model.load_weights(load_file(str(target_folder / "model.safetensors")).items())
    return model.eval()


def head_config(folder: Path, load_format: str = "auto") -> ModelConfig:
    return ModelConfig(model=str(folder), gguf_file=None, model_dir=folder,
                       hf_config=AutoConfig.from_pretrained(folder), dtype=torch.float32,
                       max_model_len=128, load_format=load_format)


def load(folder: Path, target: torch.nn.Module):
    return load_eagle_head(head_config(folder), target, ReferenceAttentionBackend(),
                           torch.device("cpu"))


def reference(folder: Path, target: torch.nn.Module, next_ids: list[int],
              target_hidden: torch.Tensor) -> torch.Tensor:
    """The head's logits at every position, from the formula (float32, whole sequence)."""
    config = AutoConfig.from_pretrained(folder)
    config._attn_implementation = "eager"
    tensors = load_file(str(folder / "model.safetensors"))
    embed = tensors.get("embed_tokens.weight", target.model.embed_tokens.weight.detach())
    layer = LlamaDecoderLayer(config, 0)
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in tensors.items()
                           if k.startswith("layers.0.")}, strict=False)
    layer.input_layernorm = torch.nn.Identity()  # EAGLE-1: none on its layer
    n = len(next_ids)
    with torch.no_grad():
        x = torch.cat([embed[torch.tensor(next_ids)], target_hidden], dim=-1)
        x = torch.nn.functional.linear(x, tensors["fc.weight"], tensors.get("fc.bias"))
        x = x.unsqueeze(0)  # [1, n, hidden]
        positions = torch.arange(n).unsqueeze(0)  # row t (token t + 1, hidden t) at position t
        cos_sin = LlamaRotaryEmbedding(config)(x, positions)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
        h = (out[0] if isinstance(out, tuple) else out)[0]
        return torch.nn.functional.linear(h, target.lm_head.weight.detach()).float()


def run_paged(head, next_ids: list[int], target_hidden: torch.Tensor) -> torch.Tensor:
    """Our head over the sequence in two chunks (7 tokens, then 4) through paged blocks."""
    attn = head.layers["0"].self_attn
    caches = [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)]
    table = [13, 4, 9, 2]
    logits = []
    for start, end in ((0, 7), (7, len(next_ids))):
        positions = list(range(start, end))
        slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
        metadata = AttentionMetadata.from_lists(slots, [0, end - start], [end], [table])
        with torch.inference_mode():
            h = head(torch.tensor(next_ids[start:end]), torch.tensor(positions), caches,
                     metadata, target_hidden[start:end])
            logits.append(head.compute_logits(h))
    return torch.cat(logits)


@pytest.mark.parametrize("with_embedding,with_fc_bias", [(False, False), (True, True)])
def test_head_matches_formula(tmp_path: Path, target_folder: Path, target: torch.nn.Module,
                              with_embedding: bool, with_fc_bias: bool) -> None:
    folder = make_tiny_eagle_head(tmp_path / "head", target_folder, seed=3,
                                  with_embedding=with_embedding, with_fc_bias=with_fc_bias)
    head = load(folder, target)
    assert (head.embed_tokens is not None) == with_embedding
    assert (head.fc.bias is not None) == with_fc_bias
    hidden = torch.randn(len(TOKENS), target.config.hidden_size,
                         generator=torch.Generator().manual_seed(0))
    ours = run_paged(head, TOKENS, hidden)
    expected = reference(folder, target, TOKENS, hidden)
    assert ours.shape == (len(TOKENS), target.config.vocab_size)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_shared_embedding_is_the_targets(tmp_path: Path, target_folder: Path,
                                         target: torch.nn.Module) -> None:
    head = load(make_tiny_eagle_head(tmp_path / "head", target_folder), target)
    ids = torch.tensor([3, 5, 7])
    torch.testing.assert_close(head.embed(ids), target.model.embed_tokens(ids))
    # Only the head's own tensors are its parameters (the target's are not counted twice).
    names = {name for name, _ in head.named_parameters()}
    assert not any("embed" in n or "lm_head" in n for n in names), names


def test_missing_fc_weight_is_one_clear_error(tmp_path: Path, target_folder: Path,
                                              target: torch.nn.Module) -> None:
    config = AutoConfig.from_pretrained(target_folder)
    tensors = eagle_head_tensors(config)
    del tensors["fc.weight"]
    folder = write_eagle_head(tmp_path / "head", config, tensors)
    with pytest.raises(ValueError, match="has no 'fc.weight'.*not an EAGLE-1 head"):
        load(folder, target)


def test_hidden_size_mismatch_is_one_clear_error(tmp_path: Path, target_folder: Path,
                                                 target: torch.nn.Module) -> None:
    config = AutoConfig.from_pretrained(target_folder)
    config.hidden_size = 32
    config.head_dim = 8
    folder = write_eagle_head(tmp_path / "head", config, eagle_head_tensors(config))
    with pytest.raises(ValueError, match="hidden size 32, the target 64"):
        load(folder, target)


def test_fc_shape_mismatch_is_one_clear_error(tmp_path: Path, target_folder: Path,
                                              target: torch.nn.Module) -> None:
    config = AutoConfig.from_pretrained(target_folder)
    tensors = eagle_head_tensors(config)
    tensors["fc.weight"] = tensors["fc.weight"][:, :64].contiguous()
    folder = write_eagle_head(tmp_path / "head", config, tensors)
    with pytest.raises(ValueError, match=r"shape \[64, 64\], expected \[64, 128\]"):
        load(folder, target)


def test_missing_layer_weight_is_named(tmp_path: Path, target_folder: Path,
                                       target: torch.nn.Module) -> None:
    config = AutoConfig.from_pretrained(target_folder)
    tensors = eagle_head_tensors(config)
    del tensors["layers.0.mlp.down_proj.weight"]
    folder = write_eagle_head(tmp_path / "head", config, tensors)
    with pytest.raises(ValueError, match="layers.0.mlp.down_proj.weight"):
        load(folder, target)


def test_model_prefix_and_dummy_format(tmp_path: Path, target_folder: Path,
                                       target: torch.nn.Module) -> None:
    config = AutoConfig.from_pretrained(target_folder)
    folder = tmp_path / "head"
    write_eagle_head(folder, config, {})
    # Some exports prefix every name with "model.": accepted.
    save_file({f"model.{k}": v for k, v in eagle_head_tensors(config, seed=5).items()},
              str(folder / "model.safetensors"))
    head = load(folder, target)
    plain = write_eagle_head(tmp_path / "plain", config, eagle_head_tensors(config, seed=5))
    torch.testing.assert_close(head.fc.weight, load(plain, target).fc.weight)
    dummy = load_eagle_head(head_config(folder, "dummy"), target, ReferenceAttentionBackend(),
                            torch.device("cpu"))
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 1
    assert torch.isfinite(dummy.fc.weight).all()
