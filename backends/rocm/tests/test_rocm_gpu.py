"""The ROCm backend end to end on an AMD GPU. Skipped everywhere else, and so far NEVER RUN:
no AMD machine was available when it was written (docs/rocm.md).

Greedy float32 tokens must equal the CPU backend's on the same tiny model (the engine's
equivalence invariant across backends), with the KV cache sized by the HIP memory profile.
"""

from __future__ import annotations

import pytest
import torch
from octavo import LLM, SamplingParams

pytestmark = [
    pytest.mark.rocm,
    pytest.mark.skipif(
        not (getattr(torch.version, "hip", None) and torch.cuda.is_available()),
        reason="needs an AMD GPU and a ROCm build of torch",
    ),
]

PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "Hello world! hello World? HELLO, world; 12345 67890 Caf\u00e9 cr\u00e8me",
]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tiny_model_factory):
    return tiny_model_factory(request.param)


def _greedy_ids(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_fp32_greedy_matches_the_cpu_backend(model_dir):
    expected = _greedy_ids(LLM(str(model_dir), device="cpu", dtype="float32"))
    llm = LLM(str(model_dir), device="rocm", dtype="float32", gpu_memory_utilization=0.5)
    engine = llm.llm_engine
    assert engine.config.backend == "rocm"
    assert engine.num_blocks > 0  # sized by octavo_rocm.memory's profiling run
    assert _greedy_ids(llm) == expected
    assert engine.num_free_blocks == engine.num_blocks and not engine.has_unfinished_requests()
