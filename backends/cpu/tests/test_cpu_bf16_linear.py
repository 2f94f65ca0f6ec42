"""bfloat16 Hugging Face checkpoints on the CPU backend: their linear layers run on oneDNN's
native-bf16 matmul (torch's own bf16 path: ``brg_matmul:avx512_core_bf16`` on AVX512-BF16
CPUs, an ``..._amx`` kernel such as ``brg_matmul:avx10_1_512_amx`` where the CPU has AMX), not
on a float32 copy of the weights. oneDNN reports each primitive it runs under
``ONEDNN_VERBOSE=1``, so the engine runs in a subprocess with it and its report is read
back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from cpu_info import cpu_flags
from octavo.testing.tiny_models import make_tiny_model


ENGINE = """
import sys
from octavo import LLM, SamplingParams
llm = LLM(model=sys.argv[1], device="cpu", dtype="auto", max_model_len=64)
out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]},
                   SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                   use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 3
print("DTYPE", llm.llm_engine.config.model_config.dtype)
"""


@pytest.mark.skipif("avx512_bf16" not in cpu_flags() or not torch.backends.mkldnn.is_available(),
                    reason="needs a CPU with AVX512-BF16 and torch built with oneDNN")
def test_bf16_checkpoint_linears_run_on_avx512_bf16_matmuls(tmp_path):
    model = make_tiny_model(tmp_path / "bf16", dtype=torch.bfloat16)
    done = subprocess.run([sys.executable, "-c", ENGINE, str(model)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "ONEDNN_VERBOSE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "DTYPE torch.bfloat16" in done.stdout
    matmuls = [line for line in done.stdout.splitlines()
               if line.startswith("onednn_verbose") and ",exec," in line and "matmul" in line]
    assert matmuls, "no oneDNN matmul ran: " + done.stdout[-2000:]
    # Each line's implementation field: "brg_matmul:avx512_core_bf16", "brg_matmul:avx10_1_512_amx".
    implementations = [next(field for field in line.split(",") if "matmul:" in field)
                       for line in matmuls]
    assert all(("bf16" in impl or "amx" in impl) for impl in implementations), matmuls[:3]
    assert all("wei:bf16" in line for line in matmuls), matmuls[:3]

