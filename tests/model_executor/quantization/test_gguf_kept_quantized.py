"""GGUF weights kept in their blocks: every type, merged projections of mixed types, tensor
parallel splits, the backend-kernel seam, and end to end against transformers.

A tiny random Llama (hidden 256, so the 256-value K blocks fit) is written as a GGUF the way
llama.cpp does (``tests.model_executor.test_gguf_loader``: llama.cpp names, Q/K rows
permuted): Q4_0, Q4_1 and Q8_0 linear weights quantized by the ``gguf`` library, Q4_K and Q6_K
as random blocks with small scales (``gguf`` can read those types but not write them). The
kept-quantized model must equal the model built from the same file dequantized while loading,
and ``octavo.LLM`` on the file must equal transformers' GGUF loader (which dequantizes it) in
greedy ids and logprobs. The default SmolLM2 GGUF (Q4_1 layers, Q8_0 embedding) is compared
with transformers directly (slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from octavo.attention.reference import ReferenceAttentionBackend
from octavo.distributed.parallel_state import ParallelRanks, ParallelState
from octavo.kernels.gguf import GGUF_BLOCKS
from octavo.model_executor.layers.quantization.base import QuantizationSource
from octavo.model_executor.layers.quantization.gguf import GGUFConfig, GGUFLinearMethod
from octavo.model_executor.loader.gguf_loader import iterate_gguf_weights, load_gguf_config
from octavo.model_executor.model_loader import process_weights_after_loading
from octavo.model_executor.models.llama import LlamaForCausalLM
from octavo.sampling_params import SamplingParams
from safetensors.torch import load_file

from tests.helpers.engine import make_llm
from tests.helpers.tiny import make_tiny_model
from tests.model_executor.test_gguf_loader import llama_cpp_permute, to_gguf_name

HIDDEN, INTERMEDIATE, NUM_HEADS, NUM_KV_HEADS = 256, 512, 4, 2
HEAD_DIM = HIDDEN // NUM_HEADS
# Which type each projection is written in: every kept type, and q/k/v of different types.
TYPES = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_0",
         "gate_proj": "Q4_1", "up_proj": "Q4_1", "down_proj": "Q8_0"}
# Largest d (Q4_K also dmin) of the random K blocks: weights of about the tiny model's 0.08.
_K_SCALE = {"Q4_K": 3e-4, "Q6_K": 3e-5}
# Same dequantized weights on both sides: only the order of float32 sums differs.
LOGPROB_ATOL = 2e-4
PROMPTS = ["The capital of France is", "def add(a, b):\n    return"]


def random_k_blocks(qtype: str, rows: int, cols: int, generator: torch.Generator) -> np.ndarray:
    """Random ``qtype`` (Q4_K/Q6_K) blocks with small, finite scales (uint8 ``[rows, bytes]``)."""
    block_size, type_size = GGUF_BLOCKS[qtype]
    blocks = torch.randint(0, 256, (rows * cols // block_size, type_size), dtype=torch.uint8,
                           generator=generator)
    for offset in {"Q4_K": [0, 2], "Q6_K": [208]}[qtype]:
        values = (torch.rand(blocks.shape[0], generator=generator) * _K_SCALE[qtype]).half()
        blocks[:, offset:offset + 2] = values.view(torch.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1).numpy()


def write_mixed_gguf(folder: Path, path: Path) -> Path:
    """The HF model in ``folder`` as a llama GGUF whose linear weights use every kept type."""
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    for hf_name, tensor in weights.items():
        proj = hf_name.split(".")[-2]
        array = tensor.float().numpy()
        if proj in TYPES and hf_name.endswith(".weight"):
            qtype = TYPES[proj]
            if qtype in _K_SCALE:
                array = random_k_blocks(qtype, *array.shape, generator)
            else:
                array = gguf.quants.quantize(array, gguf.GGMLQuantizationType[qtype])
            raw_dtype = gguf.GGMLQuantizationType[qtype]
        else:
            raw_dtype = None
        if proj == "q_proj":
            array = llama_cpp_permute(array, NUM_HEADS)
        elif proj == "k_proj":
            array = llama_cpp_permute(array, NUM_KV_HEADS)
        writer.add_tensor(to_gguf_name(hf_name), np.ascontiguousarray(array),
                          raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def build(path: Path, keep: bool, parallel: ParallelState | None = None,
          kernels=None) -> LlamaForCausalLM:
    config = load_gguf_config(path)
    quant_config = None
    if keep:
        quant_config = GGUFConfig.from_source(QuantizationSource(None, path))
        quant_config.kernels = kernels
    model = LlamaForCausalLM(config, ReferenceAttentionBackend(), parallel, quant_config)
    model.load_weights(iterate_gguf_weights(path, keep_quantized=keep))
    process_weights_after_loading(model)
    return model.eval()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("dense"), "llama", hidden_size=HIDDEN,
                           intermediate_size=INTERMEDIATE, num_attention_heads=NUM_HEADS,
                           num_key_value_heads=NUM_KV_HEADS)


@pytest.fixture(scope="module")
def mixed_gguf(tiny_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mixed_gguf(tiny_folder, tmp_path_factory.mktemp("gguf") / "mixed.gguf")


def test_every_type_stays_in_its_blocks_and_matches_the_dequantized_layer(mixed_gguf):
    kept, dense = build(mixed_gguf, keep=True), build(mixed_gguf, keep=False)
    layer = kept.model.layers["0"].self_attn.qkv_proj
    assert isinstance(layer.quant_method, GGUFLinearMethod)
    assert layer.weight.dtype == torch.uint8 and layer.quant_method.qtypes == (
        "Q4_K", "Q4_K", "Q6_K")
    for path, module in kept.named_modules():
        if isinstance(getattr(module, "quant_method", None), GGUFLinearMethod):
            reference = dict(dense.named_modules())[path].weight
            # Exact: the same blocks, the same float32 dequantization, un-permuted rows.
            assert torch.equal(module.quant_method.dequantized_weight(module, torch.float32),
                               reference), path
            x = torch.randn(3, module.gguf_input_size)
            torch.testing.assert_close(module(x), x @ reference.t(), rtol=1e-5, atol=1e-5)


def test_row_and_column_splits_of_blocks_make_the_whole_layer(mixed_gguf):
    """Rank r of 2 holds its rows (column-parallel) or its block columns (row-parallel)."""
    whole = build(mixed_gguf, keep=True)
    ranks = [build(mixed_gguf, keep=True, parallel=ParallelState(ParallelRanks(r, 2, 1)))
             for r in range(2)]
    mlp = [r.model.layers["1"].mlp for r in ranks]
    x = torch.randn(2, HIDDEN)
    gate_up = whole.model.layers["1"].mlp.gate_up_proj(x)
    halves = [m.gate_up_proj(x).chunk(2, dim=-1) for m in mlp]  # [gate_r, up_r] per rank
    torch.testing.assert_close(torch.cat([halves[0][0], halves[1][0], halves[0][1],
                                          halves[1][1]], dim=-1), gate_up)
    h = torch.randn(2, INTERMEDIATE)
    # Row-parallel: each rank's partial product over its inputs; their sum is the layer's.
    down = sum(m.down_proj.quant_method.apply(m.down_proj, part, None)
               for m, part in zip(mlp, h.chunk(2, dim=-1)))
    torch.testing.assert_close(down, whole.model.layers["1"].mlp.down_proj(h))


def test_backend_kernel_is_called_through_the_seam(mixed_gguf):
    """A backend's ``gguf_matmul`` (octavo_quant_kernels) replaces the torch path."""
    calls = []

    class Kernels:
        @staticmethod
        def gguf_matmul(x, blocks, qtype, in_features):
            calls.append((qtype, tuple(blocks.shape), in_features))
            from octavo.kernels.gguf import gguf_matmul_reference

            return gguf_matmul_reference(x, blocks, qtype, in_features)

    model = build(mixed_gguf, keep=True, kernels=Kernels())
    layer = model.model.layers["0"].self_attn.qkv_proj
    layer(torch.randn(2, HIDDEN))
    # q and k (both Q4_K) run as one matmul, v (Q6_K) as another.
    assert [c[0] for c in calls] == ["Q4_K", "Q6_K"]
    assert calls[0][1][0] == (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM


def test_unsupported_type_is_refused_with_the_way_out(tmp_path):
    config = GGUFConfig({"model.layers.0.self_attn.o_proj.weight": "Q5_K"})
    with pytest.raises(ValueError, match="Q5_K.*--quantization none"):
        config.linear_method("model.layers.0.self_attn.o_proj", ())


def test_llm_on_the_gguf_matches_transformers_loading_it(mixed_gguf, tiny_folder, monkeypatch):
    """``octavo.LLM`` on the file keeps every linear weight in its blocks; its greedy ids and
    logprobs equal transformers' GGUF loader's (which dequantizes the file). The CPU backend's
    C++ kernels are off here (they round activations to int8: backends/cpu/tests check them),
    so the gguf method's exact torch path runs."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("OCTAVO_CPU_GGUF_KERNELS", "0")
    llm = make_llm(mixed_gguf, tokenizer=str(tiny_folder))
    assert llm.llm_engine.config.model_config.quantization == "gguf"
    worker_model = llm.llm_engine.engine_core.executor.worker.model
    kept = {m.quant_method.qtypes for m in worker_model.modules()
            if isinstance(getattr(m, "quant_method", None), GGUFLinearMethod)}
    assert {t for types in kept for t in types} == set(TYPES.values())
    hf = AutoModelForCausalLM.from_pretrained(mixed_gguf.parent, gguf_file=mixed_gguf.name,
                                              dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    for output in llm.generate(PROMPTS, params):
        completion = output.outputs[0]
        ids = list(output.prompt_token_ids)
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8,
                              pad_token_id=2, eos_token_id=None, output_logits=True,
                              return_dict_in_generate=True)
        assert list(completion.token_ids) == out.sequences[0, len(ids):].tolist()
        reference = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
        for step, (token, logprobs) in enumerate(zip(completion.token_ids, completion.logprobs)):
            got, want = logprobs[token].logprob, float(reference[step, token])
            assert abs(got - want) <= LOGPROB_ATOL, (step, got, want)


@pytest.mark.slow
def test_default_model_kept_quantized_matches_transformers_logprobs(smollm2_gguf, smollm2_hf,
                                                                    monkeypatch):
    """The default SmolLM2 GGUF runs kept quantized (its linear layers and its Q8_0 tied
    embedding / LM head); on the gguf method's torch path (the CPU backend's C++ kernels off:
    they round activations to int8, backends/cpu/tests/test_cpu_gguf_model.py) its logprobs
    equal transformers' (which dequantizes the file) within float32 summation order."""
    import octavo
    from octavo.model_executor.layers.quantization.gguf import GGUFEmbeddingMethod

    monkeypatch.setenv("OCTAVO_CPU_GGUF_KERNELS", "0")
    llm = octavo.LLM(kv_cache_memory_bytes=32 * 2**20)
    assert llm.llm_engine.config.model_config.quantization == "gguf"
    worker_model = llm.llm_engine.engine_core.executor.worker.model
    assert isinstance(worker_model.lm_head.quant_method, GGUFEmbeddingMethod)
    model, tokenizer = smollm2_hf
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        full = torch.cat([ids, torch.tensor([out.token_ids[:-1]])], dim=1)
        with torch.inference_mode():
            logits = model(full).logits[0, ids.shape[1] - 1:]
        reference = torch.log_softmax(logits.float(), dim=-1)
        assert out.token_ids == reference.argmax(dim=-1).tolist()
        for i, token in enumerate(out.token_ids):
            assert abs(out.logprobs[i][token].logprob - float(reference[i, token])) < 1e-3
    llm.llm_engine.shutdown()


def test_embedding_and_lm_head_stay_in_their_blocks():
    """A Q8_0 / Q4_K token table is kept as uint8 blocks: lookups and logits equal the table
    dequantized while loading, and a backend's ``gguf_dequantize``/``gguf_matmul`` are used."""
    from octavo.kernels.gguf import dequantize_rows, gguf_matmul_reference
    from octavo.model_executor.layers.quantization.gguf import GGUFEmbeddingMethod
    from octavo.model_executor.layers.vocab import VocabParallelEmbedding, compute_logits
    from octavo.model_executor.loader.gguf_loader import GGUFBlocks
    from octavo.model_executor.model_loader import _quantize_embeddings

    calls = []

    class Kernels:
        @staticmethod
        def gguf_matmul(x, blocks, qtype, in_features):
            calls.append("matmul")
            return gguf_matmul_reference(x, blocks, qtype, in_features)

        @staticmethod
        def gguf_dequantize(blocks, qtype, in_features):
            calls.append("dequantize")
            return dequantize_rows(blocks, qtype, in_features)

    vocab, hidden = 40, 256
    generator = torch.Generator().manual_seed(0)
    for qtype in ("Q8_0", "Q4_K"):
        if qtype in _K_SCALE:
            data = random_k_blocks(qtype, vocab, hidden, generator)
        else:
            values = torch.randn(vocab, hidden, generator=generator).numpy()
            data = gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])
        blocks = GGUFBlocks(np.ascontiguousarray(data).reshape(-1), qtype, (vocab, hidden))
        model = torch.nn.Module()
        model.embed_tokens = VocabParallelEmbedding(vocab, hidden, ParallelState.single())
        config = GGUFConfig({"embed_tokens.weight": qtype})
        config.kernels = Kernels()
        _quantize_embeddings(model, config)
        layer = model.embed_tokens
        assert isinstance(layer.quant_method, GGUFEmbeddingMethod)
        assert layer.weight.dtype == torch.uint8
        layer.weight.weight_loader(layer.weight, blocks, None)
        table = blocks.load()
        ids = torch.tensor([[3, 0], [39, 3]])
        assert torch.equal(layer(ids), table[ids])
        x = torch.randn(5, hidden, generator=generator)
        torch.testing.assert_close(compute_logits(x, layer), x @ table.t(), rtol=1e-5, atol=1e-4)
        assert calls == ["dequantize", "matmul"]
        calls.clear()
    with pytest.raises(ValueError, match="expected Q4_K blocks"):
        layer.weight.weight_loader(layer.weight, torch.zeros(vocab, hidden), None)
