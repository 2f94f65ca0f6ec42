"""How far fp8 rounding alone moves greedy logprobs on the tiny Llama of the GPU quantization
tests (``backends/cuda/tests/test_cuda_quantization.py``), measured on the CPU: the numbers
behind those tests' tolerances.

    python benchmarks/cpu/fp8_rounding_gap.py

Same model (``make_tiny_model(..., "llama", hidden_size=256, intermediate_size=512, 4 heads,
2 KV heads)``), prompts, 16 greedy tokens and bf16 as the GPU tests; the gap is the tests'
``_assert_greedy_close`` measure: the largest logprob difference on matching tokens, or the
reference's own gap between the two choices where the greedy tokens part.

- ``kv``: ``--kv-cache-dtype fp8`` against the bf16 cache (the CPU runs the same quantization
  as the GPU write kernel, ``quantize_kv``).
- ``fp8 weights, w8a16``: an fp8 checkpoint with activations unquantized against the dense
  model holding its dequantized weights (rounding of the bf16 products only).
- ``fp8 weights, all rows fp8 activations``: ``torch._scaled_mm`` emulated for every matmul
  (per-token e4m3 activations), what the GPU ran before the small-M kernels.
- ``fp8 weights, > 16 rows fp8 activations``: the GPU's current mix (prefill through
  ``_scaled_mm``, decode steps through the w8a16 kernel).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from octavo import LLM, SamplingParams
from octavo.kernels import fp8 as fp8_kernels
from octavo.kernels.skinny import use_small_m_kernel
from octavo.model_executor.layers.quantization import fp8 as fp8_layer
from octavo.testing.quantized_models import write_dense, write_fp8
from octavo.testing.tiny_models import make_tiny_model

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "1 2 3 4 5 6 7"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)


def generate(model: Path, **kwargs):
    llm = LLM(str(model), device="cpu", dtype="bfloat16", **kwargs)
    return llm.generate(PROMPTS, PARAMS, use_tqdm=False)


def gap(ours, reference) -> float:
    worst = 0.0
    for mine, theirs in zip(ours, reference):
        a, b = mine.outputs[0], theirs.outputs[0]
        for step, (token, want) in enumerate(zip(a.token_ids, b.token_ids)):
            if token != want:
                worst = max(worst, b.logprobs[step][want].logprob
                            - b.logprobs[step][token].logprob)
                break
            worst = max(worst, abs(a.logprobs[step][token].logprob
                                   - b.logprobs[step][token].logprob))
    return worst


def emulate_scaled_mm(rows_quantized):
    def linear(x, weight, weight_scale, bias, input_scale=None, block=None):
        return fp8_kernels.fp8_linear_reference(
            x, weight, weight_scale, bias, input_scale, block,
            quantize_input=rows_quantized(x.shape[0]))
    return linear


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    dense = make_tiny_model(tmp / "dense", "llama", hidden_size=256, intermediate_size=512,
                            num_attention_heads=4, num_key_value_heads=2)
    results = {"kv cache fp8 vs bf16": gap(generate(dense, kv_cache_dtype="fp8"),
                                           generate(dense))}
    weights = write_fp8(dense, tmp / "fp8", scheme="tensor")
    reference = generate(write_dense(dense, tmp / "ref", weights))
    results["fp8 weights, w8a16"] = gap(generate(tmp / "fp8"), reference)
    for label, rows in (("fp8 weights, all rows fp8 activations", lambda m: True),
                        ("fp8 weights, > 16 rows fp8 activations",
                         lambda m: not use_small_m_kernel(m))):
        fp8_layer.fp8_linear = emulate_scaled_mm(rows)
        results[label] = gap(generate(tmp / "fp8"), reference)
    for label, value in results.items():
        print(f"{label:<42} max logprob gap {value:.3f}")


if __name__ == "__main__":
    main()
