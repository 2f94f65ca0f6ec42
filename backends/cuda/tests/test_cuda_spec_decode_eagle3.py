"""Speculative decoding with an EAGLE-3 head (``"method": "eagle3"``) on an NVIDIA GPU (run
through the device tool; skipped in CI).

Greedy outputs equal those without speculation on the CUDA backend, with CUDA graphs on and
off (on: the target's captured steps write its auxiliary hidden states into their persistent
buffer, and the head's one-token steps and short first forwards replay graphs captured through
``StaticHiddenHead``): with a random head, and with a head built to be exactly right for a
target that repeats its token, where every draft is accepted (so the aux states the head reads
after a replayed target step are the step's own).
"""

from __future__ import annotations

import pytest
import torch
from octavo import LLM, SamplingParams
from octavo.testing.eagle_heads import (
    make_exact_eagle3_head,
    make_repeating_target,
    make_tiny_eagle3_head,
)

from tests.helpers.tiny import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
        reason="needs an NVIDIA GPU and a CUDA build of torch",
    ),
]

# Each last token is in the heads' default draft vocabulary (ids not 3 mod 5).
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 4, [20, 21, 22, 23, 24] * 3, [100, 101, 102],
           [40, 41] * 9, list(range(50, 90))]
# head_dim 64: one the Triton kernels take.
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2}


def _generate(llm: LLM, params: SamplingParams) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": t} for t in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _spec(head) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_random_head_greedy_equal(tmp_path, enforce_eager: bool) -> None:
    target = make_tiny_model(tmp_path / "llama", "llama", num_hidden_layers=4, **SHAPE)
    head = make_tiny_eagle3_head(tmp_path / "head", target, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    kwargs = {"device": "cuda", "dtype": "float32", "num_gpu_blocks_override": 512,
              "enforce_eager": enforce_eager, "max_num_batched_tokens": 64}
    want = _generate(LLM(str(target), **kwargs), params)
    spec = LLM(str(target), speculative_config=_spec(head), **kwargs)
    drafter = spec.llm_engine.engine_core.executor.worker.model_runner.drafter
    assert (drafter.graph_runner is not None) == (not enforce_eager)
    assert _generate(spec, params) == want
    assert spec.llm_engine.stats().spec_decode_num_draft_tokens > 0


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_exact_head_accepts_every_draft(tmp_path, enforce_eager: bool) -> None:
    target = make_repeating_target(tmp_path / "repeat", seed=2, **SHAPE)
    head = make_exact_eagle3_head(tmp_path / "head", target)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kwargs = {"device": "cuda", "dtype": "float32", "num_gpu_blocks_override": 512,
              "enforce_eager": enforce_eager}
    want = _generate(LLM(str(target), **kwargs), params)
    spec = LLM(str(target), speculative_config=_spec(head), **kwargs)
    assert _generate(spec, params) == want
    stats = spec.llm_engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


def test_exact_head_in_bfloat16_accepts_drafts(tmp_path) -> None:
    """The dtype real heads run in (CUDA graphs on): outputs equal, drafts accepted."""
    target = make_repeating_target(tmp_path / "repeat", seed=2, **SHAPE)
    head = make_exact_eagle3_head(tmp_path / "head", target)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kwargs = {"device": "cuda", "dtype": "bfloat16", "num_gpu_blocks_override": 512}
    want = _generate(LLM(str(target), **kwargs), params)
    spec = LLM(str(target), speculative_config=_spec(head), **kwargs)
    assert _generate(spec, params) == want
    assert spec.llm_engine.stats().spec_decode_num_accepted_tokens > 0
