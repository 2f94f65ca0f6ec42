"""Multi-LoRA on an NVIDIA GPU: the Triton shrink/expand kernels inside the engine.

- A Llama of modest real-ish width (hidden 1024, 16 heads, 4 KV heads, intermediate 2816,
  4 layers) in float32 with three random PEFT adapters: one mixed batch (three adapters and
  none, prompts of different lengths) gives each request the greedy tokens of transformers +
  PEFT on the GPU, and logprobs within 1e-3; decode steps with and without adapters replay
  CUDA graphs (those with adapters stage their rows into the LoRA graph inputs).
- The kernels against the torch reference at Llama-3-8B shapes (bf16/fp16): in
  ``tests/kernels/test_triton_lora.py::test_llama8b_shapes`` (run with ``-m gpu``), repeated
  here on the engine's mapping of a mixed prefill/decode step.

Run through the device tool (skipped in CI): ``bash benchmarks/gpu/run_h100.sh lora-tests``.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]

NUM_TOKENS = 16
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["The capital of France is", "Once upon a time there was a little girl who",
           "def add(a, b):\n    return", "Red green blue"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("peft")
    from octavo.testing.lora_adapters import make_peft_adapter
    from octavo.testing.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("cuda-lora")
    model = make_tiny_model(root / "llama", "llama", hidden_size=1024, intermediate_size=2816,
                            num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4)
    adapters = {
        "all16": make_peft_adapter(model, root / "all16", 16, ALL, lora_alpha=32, seed=1,
                                   std=0.05),
        "qv8": make_peft_adapter(model, root / "qv8", 8, ["q_proj", "v_proj"], seed=2, std=0.05),
        "mlp4": make_peft_adapter(model, root / "mlp4", 4, ["gate_proj", "up_proj", "down_proj"],
                                  use_rslora=True, seed=3, std=0.05),
    }
    return model, adapters


def test_mixed_adapter_batch_matches_peft_on_cuda(models) -> None:
    from octavo import LLM, LoRARequest, SamplingParams
    from octavo.testing.lora_adapters import peft_reference_model
    from transformers import AutoTokenizer

    model_dir, adapters = models
    names = sorted(adapters)
    loras = {name: LoRARequest(name, i + 1, str(adapters[name])) for i, name in enumerate(names)}
    cases = [(name, prompt) for prompt in PROMPTS for name in [*names, None]]
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
              num_gpu_blocks_override=512)
    try:
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        assert runner.lora_manager.batch.use_kernels
        graphs, shapes = runner.graph_runner, []
        original = graphs.run
        graphs.run = lambda ids, pos, md: shapes.append(graphs.shape_for(md)) or original(
            ids, pos, md)
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True,
                                logprobs=0)
        outputs = llm.generate([p for _, p in cases], params, use_tqdm=False,
                               lora_request=[None if n is None else loras[n] for n, _ in cases])
        # A step of no adapter after LoRA steps (CUDA graphs) still gives the base model.
        base_again = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
        assert sum(1 for shape in shapes if shape[2]) >= NUM_TOKENS - 2, shapes  # LoRA graphs
        assert any(not shape[2] for shape in shapes)  # base_again's steps: graphs without
    finally:
        llm.llm_engine.shutdown()

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for name in [*names, None]:
        reference = peft_reference_model(model_dir, None if name is None else adapters[name])
        reference = reference.to("cuda")
        for (case_name, prompt), output in zip(cases, outputs):
            if case_name != name:
                continue
            ids = list(tokenizer(prompt).input_ids)
            generated = []
            with torch.inference_mode():
                for step in range(NUM_TOKENS):
                    logits = reference(input_ids=torch.tensor([ids + generated],
                                                              device="cuda")).logits[0, -1]
                    logprobs = torch.log_softmax(logits.float(), dim=-1)
                    token = int(logits.argmax())
                    completion = output.outputs[0]
                    assert completion.token_ids[step] == token, (name, prompt, step)
                    got = completion.logprobs[step][token].logprob
                    assert math.isclose(got, logprobs[token].item(), abs_tol=1e-3), (
                        name, prompt, step, got, logprobs[token].item())
                    generated.append(token)
            if name is None and prompt == PROMPTS[0]:
                assert base_again == generated
        del reference
        torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_on_engine_mapping_at_llama8b_shapes(dtype) -> None:
    from octavo.kernels.triton.lora import lora_shrink_expand
    from octavo.lora.layers import LoRAMapping, lora_torch

    device = torch.device("cuda")
    # 4 adapters (slots), rank 16 x 3 merged shards (QKV), 256 decodes + 2 prompts + no-LoRA rows.
    slots = [0, -1, 3] + [i % 5 - 1 for i in range(256)]
    lengths = [512, 100, 37] + [1] * 256
    mapping = LoRAMapping.from_requests(slots, lengths, device)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k, n in [(4096, 6144), (4096, 28672), (14336, 4096)]:
        x = torch.randn(sum(lengths), k, device=device, dtype=dtype, generator=gen)
        out = torch.randn(sum(lengths), n, device=device, dtype=dtype, generator=gen)
        lora_a = (torch.randn(4, 48, k, device=device, generator=gen) / k ** 0.5).to(dtype)
        lora_b = (torch.randn(4, n, 48, device=device, generator=gen) * 0.1).to(dtype)
        expected = out.float().clone()
        lora_torch(x.float(), expected, lora_a.float(), lora_b.float(), mapping)
        got = out.clone()
        lora_shrink_expand(x, got, lora_a, lora_b, mapping.token_indices,
                           mapping.group_slots_dev, mapping.group_starts_dev,
                           len(mapping.group_slots), mapping.max_group_size)
        torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)
        assert torch.equal(got[512:612], out[512:612])  # the no-adapter prompt untouched
