"""The CPU backend's whole decoder layer as one C++ call (``octavo_cpu.fused_layer``,
``csrc/decoder_layer.cpp``): installed on the layers it covers, and the engine's greedy tokens
and logprobs equal, bit for bit, with it on and off (it calls the same C++ ops in the same
order as the Python layer with the backend's layer kernels). A tiny random Llama written as a
GGUF file with Q4_1 attention/gate/up and Q8_0 down projections, kept in its blocks."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from octavo import LLM, SamplingParams
from octavo.testing.tiny_models import make_tiny_model
from octavo_cpu import quant
from safetensors.torch import load_file

from tests.model_executor.test_gguf_loader import llama_cpp_permute, to_gguf_name

HIDDEN, INTERMEDIATE, NUM_HEADS, NUM_KV_HEADS = 384, 512, 6, 2  # 3 query heads per KV head
TYPES = {"q_proj": "Q4_1", "k_proj": "Q4_1", "v_proj": "Q4_1", "o_proj": "Q4_1",
         "gate_proj": "Q4_1", "up_proj": "Q4_1", "down_proj": "Q8_0"}


def _write_gguf(folder: Path, path: Path, types: dict[str, str]) -> Path:
    config = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_key_length(HIDDEN // NUM_HEADS)
    writer.add_value_length(HIDDEN // NUM_HEADS)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    for hf_name, tensor in load_file(folder / "model.safetensors").items():
        proj = hf_name.split(".")[-2]
        array = tensor.float().numpy()
        if proj == "q_proj":
            array = llama_cpp_permute(array, NUM_HEADS)
        elif proj == "k_proj":
            array = llama_cpp_permute(array, NUM_KV_HEADS)
        array = np.ascontiguousarray(array)
        raw_dtype = None
        if proj in types and hf_name.endswith(".weight"):
            raw_dtype = gguf.GGMLQuantizationType[types[proj]]
            array = gguf.quants.quantize(array, raw_dtype)
        writer.add_tensor(to_gguf_name(hf_name), array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("dense"), "llama", hidden_size=HIDDEN,
                           intermediate_size=INTERMEDIATE, num_attention_heads=NUM_HEADS,
                           num_key_value_heads=NUM_KV_HEADS)


def _fused_layers(llm: LLM) -> int:
    model = llm.llm_engine.engine_core.executor.worker.model
    return sum(getattr(m, "fused_forward", None) is not None for m in model.modules())


def _generate(path: Path, tokenizer: Path, monkeypatch, fused: str, threads: int = 1):
    monkeypatch.setenv("OCTAVO_CPU_FUSED_LAYERS", fused)
    llm = LLM(model=str(path), tokenizer=str(tokenizer), dtype="float32",
              kv_cache_memory_bytes=8 * 2**20, cpu_threads=threads)
    layers = _fused_layers(llm)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    # Batch 1 and a mixed step (one prompt prefilling while the other decodes).
    prompts = [{"prompt_token_ids": [5, 17, 42, 9, 3]},
               {"prompt_token_ids": list(range(30, 70))},
               {"prompt_token_ids": list(range(100, 121))}]
    outputs = llm.generate(prompts[:1], params, use_tqdm=False)
    outputs += llm.generate(prompts[1:], params, use_tqdm=False)
    llm.llm_engine.shutdown()
    return layers, outputs


@pytest.mark.parametrize("threads", [1, 2])
def test_engine_greedy_equal_with_and_without_fused_layers(tiny_folder, tmp_path, monkeypatch,
                                                           threads):
    if not quant.kernels_available():
        pytest.fail("the C++ kernels did not build on this machine (see the warning)")
    path = _write_gguf(tiny_folder, tmp_path / "tiny.gguf", TYPES)
    num_layers = json.loads((tiny_folder / "config.json").read_text())["num_hidden_layers"]
    on_layers, on = _generate(path, tiny_folder, monkeypatch, "1", threads)
    off_layers, off = _generate(path, tiny_folder, monkeypatch, "0", threads)
    assert (on_layers, off_layers) == (num_layers, 0)
    for a, b in zip(on, off, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_on, lp_off in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert {t: e.logprob for t, e in lp_on.items()} == {
                t: e.logprob for t, e in lp_off.items()}


def test_layers_the_op_does_not_cover_keep_their_python_forward(tiny_folder, tmp_path,
                                                                monkeypatch):
    # q/k/v of different types make the QKV weight two runs of blocks: not one matmul.
    types = dict(TYPES, v_proj="Q8_0")
    path = _write_gguf(tiny_folder, tmp_path / "mixed.gguf", types)
    layers, outputs = _generate(path, tiny_folder, monkeypatch, "1")
    assert layers == 0
    assert all(len(out.outputs[0].token_ids) == 10 for out in outputs)


def test_no_fused_layers_without_the_cpp_layer_ops(tiny_folder, tmp_path, monkeypatch):
    # The fused form equals the Python path with the C++ layer ops; without them it stays off.
    monkeypatch.setenv("OCTAVO_CPU_LAYER_KERNELS", "0")
    path = _write_gguf(tiny_folder, tmp_path / "tiny.gguf", TYPES)
    layers, _ = _generate(path, tiny_folder, monkeypatch, "1")
    assert layers == 0


def test_lora_keeps_the_python_layers_and_its_adapter_applies(tiny_folder, tmp_path):
    """With LoRA enabled the layers run their Python forward (one C++ call per layer would
    skip the adapters' products), and an adapter changes the GGUF model's output."""
    from octavo import LoRARequest
    from octavo.testing.lora_adapters import make_peft_adapter

    path = _write_gguf(tiny_folder, tmp_path / "tiny.gguf", TYPES)
    adapter = make_peft_adapter(tiny_folder, tmp_path / "adapter", rank=8,
                                target_modules=["q_proj", "v_proj", "down_proj"])
    llm = LLM(model=str(path), tokenizer=str(tiny_folder), dtype="float32",
              kv_cache_memory_bytes=8 * 2**20, enable_lora=True, max_lora_rank=8)
    try:
        assert _fused_layers(llm) == 0
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
        prompt = [{"prompt_token_ids": list(range(30, 50))}]
        base = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        tuned = llm.generate(prompt, params, use_tqdm=False,
                             lora_request=LoRARequest("a", 1, str(adapter)))[0].outputs[0]
    finally:
        llm.llm_engine.shutdown()
    first = lambda out: out.logprobs[0][out.token_ids[0]].logprob  # noqa: E731
    assert base.token_ids != tuned.token_ids or first(base) != first(tuned)
