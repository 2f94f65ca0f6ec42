"""LoRA on split models and another architecture.

Tensor parallelism (2 ranks, A/B split like the base weights) and pipeline parallelism (2
stages, each loading its own layers' adapter weights) under preemption, chunked prefill and
prefix caching give the same greedy tokens and logprobs as one device; Qwen2 (biased q/k/v)
with adapters matches PEFT.
"""

from __future__ import annotations

import pytest
from octavo.lora_request import LoRARequest

from tests.helpers.engine import assert_no_leaks, greedy, make_llm
from tests.lora.test_lora_engine import NUM_TOKENS, PeftReference, _check_against_reference


PROMPTS = ["The capital of France is", "Once upon a time there was a little",
           "def add(a, b):\n    return", "The capital of France is a city"]
STRESS = dict(enable_prefix_caching=True, max_num_batched_tokens=8, num_gpu_blocks_override=10,
              block_size=4)


def _cases(models):
    names = ["all", "qv", None, "mlp"]
    loras = []
    for name in names:
        loras.append(None if name is None else LoRARequest(
            name, sorted(models.adapters).index(name) + 1, str(models.adapters[name])))
    return names, loras


def _run(llm, models):
    names, loras = _cases(models)
    prompts = PROMPTS * 2
    adapters = (loras + loras[::-1])
    outputs = llm.generate(prompts, greedy(NUM_TOKENS, logprobs=0), use_tqdm=False,
                           lora_request=adapters)
    return outputs, list(zip([names[loras.index(a)] if a else None for a in adapters], prompts))


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2},
                                      {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_split_model_matches_peft(lora_models, parallel) -> None:
    llm = make_llm(lora_models.model, device="cpu", enable_lora=True, max_loras=2,
                   max_lora_rank=16, **parallel, **STRESS)
    try:
        outputs, cases = _run(llm, lora_models)
        assert llm.llm_engine.stats().num_preemptions > 0
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()
    _check_against_reference(outputs, cases, PeftReference(lora_models))


def test_qwen2_with_biases_matches_peft(tmp_path) -> None:
    pytest.importorskip("peft")
    from octavo.testing.lora_adapters import make_peft_adapter
    from octavo.testing.tiny_models import make_tiny_model

    from tests.lora.conftest import ALL, LoRAModels

    model = make_tiny_model(tmp_path / "qwen2", "qwen2")
    models = LoRAModels(model, {
        "all": make_peft_adapter(model, tmp_path / "all", 8, ALL, seed=4),
        "mlp": make_peft_adapter(model, tmp_path / "mlp", 4, ["gate_proj", "down_proj"], seed=5),
        "qv": make_peft_adapter(model, tmp_path / "qv", 2, ["q_proj", "v_proj"], seed=6),
    })
    llm = make_llm(model, enable_lora=True, max_loras=3, max_lora_rank=8)
    try:
        outputs, cases = _run(llm, models)
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()
    _check_against_reference(outputs, cases, PeftReference(models))
