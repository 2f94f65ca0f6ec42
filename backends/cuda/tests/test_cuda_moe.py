"""Mixture-of-experts models on an NVIDIA GPU at Qwen3-30B-A3B's layer shape (skipped in CI).

Two decoder layers of Qwen3-30B-A3B's shape (hidden 2048, 32 query / 4 KV heads of 128, 128
experts of intermediate 768, top 8 renormalised), random weights (transformers' own init),
the tiny test tokenizer: the fused MoE Triton kernel inside the whole engine (CUDA graphs, async
scheduling) against Hugging Face transformers on the same weights.
"""

from __future__ import annotations

import pytest
import torch
from octavo import LLM, SamplingParams

from tests.helpers.tiny import VOCAB_SIZE, train_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
        reason="needs an NVIDIA GPU and a CUDA build of torch",
    ),
]

PROMPTS = [
    "The capital of France is",
    "Once upon a time there was",
    "def add(a, b):\n    return",
    "Hello world! hello World? HELLO, world; 12345 67890 Caf\u00e9 cr\u00e8me",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    folder = tmp_path_factory.mktemp("qwen3-30b-a3b-2-layers")
    config = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=2048, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
        max_position_embeddings=4096, rope_theta=1000000.0, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    train_tokenizer(folder)
    del model
    torch.cuda.empty_cache()
    return folder


@pytest.fixture(scope="module")
def hf_fp32(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    yield tokenizer, model
    del model
    torch.cuda.empty_cache()


def _greedy(max_tokens=24, **kwargs):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def _token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _shutdown(llm):
    llm.llm_engine.shutdown()
    torch.cuda.empty_cache()


def test_fp32_greedy_matches_hf(model_dir, hf_fp32):
    tokenizer, hf = hf_fp32
    llm = LLM(str(model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=256,
              max_num_seqs=16)
    outputs = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    _shutdown(llm)
    for prompt, output in zip(PROMPTS, outputs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids.cuda()
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        ours, theirs = output.outputs[0].token_ids, ref[0, ids.shape[1]:].tolist()
        cut = ours.index(2) if 2 in ours else len(ours)  # HF's min_new_tokens masks EOS
        assert ours[:cut] == theirs[:cut]


def test_bf16_prompt_logprobs_close_to_hf_fp32(model_dir, hf_fp32):
    tokenizer, hf = hf_fp32
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", num_gpu_blocks_override=256,
              max_num_seqs=16)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    _shutdown(llm)
    errors = []
    for prompt, output in zip(PROMPTS, outputs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids.cuda()
        with torch.no_grad():
            ref = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
        for pos, position in enumerate(output.prompt_logprobs[1:]):
            token = ids[0, pos + 1].item()
            errors.append(abs(position[token].logprob - ref[pos, token].item()))
    assert max(errors) < 0.15, max(errors)
    assert sum(errors) / len(errors) < 0.03, sum(errors) / len(errors)


def test_cuda_graphs_equal_eager_and_batch_equals_one_by_one(model_dir):
    """Decode steps replay CUDA graphs holding the MoE kernel; a batch of 64 (many rows per
    expert, other tile sizes) gives what each prompt alone gives (float32)."""
    prompts = [p * (1 + i % 3) for i, p in enumerate(PROMPTS * 16)]  # 64 prompts
    graphs = LLM(str(model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=1024,
                 max_num_seqs=64)
    assert graphs.llm_engine.engine_core.executor.worker.model_runner.graph_runner is not None
    batched = _token_ids(graphs.generate(prompts, _greedy(16), use_tqdm=False))
    alone = [_token_ids(graphs.generate(p, _greedy(16), use_tqdm=False))[0] for p in prompts[:4]]
    _shutdown(graphs)
    assert alone == batched[:4]
    eager = LLM(str(model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=1024,
                max_num_seqs=64, enforce_eager=True)
    eager_out = _token_ids(eager.generate(prompts, _greedy(16), use_tqdm=False))
    _shutdown(eager)
    assert eager_out == batched
