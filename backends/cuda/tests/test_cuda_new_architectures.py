"""Gemma 2, Gemma 3, Phi-3 and Phi-4-mini at their real per-layer shapes on an NVIDIA GPU.

Random bf16 weights (transformers' own init, norms perturbed) in each family's real hidden
size, heads, head_dim, MLP width, vocabulary, window, soft caps and rope; fewer layers than
the real models (enough for the local/global pattern) to keep the run short. Each model:

- float32: greedy tokens equal ``transformers``' ``generate``, for short prompts and for one
  longer than the sliding window (the window binds, in prefill and decode); Phi-4-mini also
  past its original 4096 positions (longrope's long factors, on both sides);
- bfloat16: prompt logprobs against transformers in float32 are no further off than
  transformers' own bfloat16 (the kernels add no error beyond the dtype's).

Run through the device tool (skipped in CI).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from octavo import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
        reason="needs an NVIDIA GPU and a CUDA build of torch",
    ),
]

NUM_TOKENS = 16
NUM_BLOCKS = 1200  # block 16: 19200 tokens, above every max_model_len here


def _gemma2():  # google/gemma-2-2b, 4 of 26 layers
    from transformers import Gemma2Config

    return Gemma2Config(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    ), {}, [7, 19, 33, 4096 + 64]


def _gemma3():  # google/gemma-3-1b-it (text), 6 of 26 layers: five local, one global
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=512, max_position_embeddings=32768, tie_word_embeddings=True,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )
    config.architectures = ["Gemma3ForCausalLM"]
    return config, {"max_model_len": 8192}, [7, 19, 33, 512 + 64]


def _phi3():  # microsoft/Phi-3-mini-4k-instruct, 2 of 32 layers
    from transformers import Phi3Config

    return Phi3Config(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=2,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
        original_max_position_embeddings=4096, sliding_window=2047, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=32000, pad_token_id=32000,
    ), {}, [7, 19, 33, 2047 + 64]


def _phi4_mini(long_context: bool = False):
    """microsoft/Phi-4-mini-instruct, 2 of 32 layers: longrope, partial rotary factor 0.75.

    transformers takes the short factors for a sequence within the original 4096 positions and
    the long ones beyond; Octavo takes them by its context length: 4096 with short prompts,
    8192 with prompts past 4096 tokens.
    """
    from transformers import Phi3Config

    short = [1.0 + 0.02 * i for i in range(48)]
    long = [1.0 + 0.9 * i for i in range(48)]
    config = Phi3Config(
        vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=2,
        num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=131072,
        original_max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.75, "short_factor": short,
                         "long_factor": long, "original_max_position_embeddings": 4096},
        bos_token_id=199999, eos_token_id=199999, pad_token_id=199999,
    )
    if long_context:
        return config, {"max_model_len": 8192}, [4096 + 64, 5000]
    return config, {"max_model_len": 4096}, [7, 19, 33, 1000]


MODELS = {"gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3, "phi4-mini": _phi4_mini,
          "phi4-mini-long": lambda: _phi4_mini(long_context=True)}


def make_checkpoint(folder: Path, config) -> Path:
    """Random bf16 weights of ``config`` (made on the GPU) plus the tiny test tokenizer."""
    from octavo.testing.tiny_models import train_tokenizer
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # (1 + w) norms start at w = 0; make them matter
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder, safe_serialization=True)
    train_tokenizer(folder)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return folder


def make_prompts(lengths: list[int]) -> list[list[int]]:
    """Random prompts of ``lengths`` tokens (each family has one longer than its window)."""
    generator = torch.Generator().manual_seed(1)
    # Ids below 384 so the tiny tokenizer can detokenize the prompts.
    return [torch.randint(3, 384, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module", params=sorted(MODELS))
def checkpoint(request, tmp_path_factory):
    config, llm_kwargs, lengths = MODELS[request.param]()
    folder = make_checkpoint(tmp_path_factory.mktemp(request.param), config)
    return folder, make_prompts(lengths), llm_kwargs


def _hf(folder: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).cuda().eval()
    model.generation_config.eos_token_id = None
    return model


def _release(*objects) -> None:
    for obj in objects:
        shutdown = getattr(getattr(obj, "llm_engine", None), "shutdown", None)
        if shutdown is not None:
            shutdown()
    del objects
    gc.collect()
    torch.cuda.empty_cache()


def test_fp32_greedy_matches_hf(checkpoint):
    folder, prompts, llm_kwargs = checkpoint
    hf = _hf(folder, torch.float32)
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids], device="cuda"), do_sample=False,
                              max_new_tokens=NUM_TOKENS, pad_token_id=0)
            expected.append(out[0, len(ids):].tolist())
    _release(hf)
    llm = LLM(str(folder), device="cuda", dtype="float32", num_gpu_blocks_override=NUM_BLOCKS,
              **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    _release(llm)
    assert got == expected


def _hf_prompt_logprobs(folder: Path, dtype: torch.dtype,
                        prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, ``[len - 1]`` float32 log-probabilities of tokens 1.. given the ones before."""
    model = _hf(folder, dtype)
    result = []
    with torch.inference_mode():
        for ids in prompts:
            logits = model(torch.tensor([ids], device="cuda")).logits[0, :-1].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            result.append(logprobs.gather(1, torch.tensor(ids[1:], device="cuda")[:, None])
                          [:, 0].cpu())
    _release(model)
    return result


def test_bf16_prompt_logprobs_as_close_as_transformers_bf16(checkpoint):
    folder, prompts, llm_kwargs = checkpoint
    exact = _hf_prompt_logprobs(folder, torch.float32, prompts)
    theirs = _hf_prompt_logprobs(folder, torch.bfloat16, prompts)
    llm = LLM(str(folder), device="cuda", dtype="bfloat16", num_gpu_blocks_override=NUM_BLOCKS,
              **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ours = [torch.tensor([position[token].logprob
                          for position, token in zip(o.prompt_logprobs[1:], ids[1:])])
            for o, ids in zip(outputs, prompts)]
    _release(llm)
    for ids, ref, hf_bf16, got in zip(prompts, exact, theirs, ours):
        our_error, their_error = (got - ref).abs(), (hf_bf16 - ref).abs()
        assert our_error.mean() <= 1.5 * their_error.mean() + 0.01, (len(ids), our_error.mean(),
                                                                     their_error.mean())
        assert our_error.max() <= 2.0 * their_error.max() + 0.05, (len(ids), our_error.max(),
                                                                   their_error.max())
