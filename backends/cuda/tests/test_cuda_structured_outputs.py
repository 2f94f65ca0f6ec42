"""Structured outputs on an NVIDIA GPU (run through the device tool; skipped in CI).

The grammar bitmask is unpacked and applied on the device by the core sampler: the unpacking
must equal the CPU's bit for bit, every constrained output must satisfy its constraint, and
with async scheduling (the CUDA default; constrained steps defer their sampling) the greedy
outputs must equal those of one step at a time, beside unconstrained rows.
"""

from __future__ import annotations

import pytest
import torch
from octavo import LLM, SamplingParams
from octavo.sample.sampler import unpack_bitmask

from tests.distributed.test_equivalence import (
    assert_sent_by_reference,
    bitmasks_sent,
    launches_ahead,
)
from tests.helpers.tiny import make_tiny_model
from tests.structured_output.test_engine import PROMPTS, check, constrained

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
        reason="needs an NVIDIA GPU and a CUDA build of torch",
    ),
]

KINDS = ["json", "regex", "choice", "grammar"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_dim 64: one the Triton kernels take.
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", hidden_size=256,
                           intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("vocab_size", [151936, 49152, 100])
def test_unpack_on_the_gpu_equals_the_cpu(vocab_size: int) -> None:
    words = (vocab_size + 31) // 32
    generator = torch.Generator().manual_seed(vocab_size)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (64, words), dtype=torch.int32, generator=generator)
    want = unpack_bitmask(bitmask, vocab_size)
    got = unpack_bitmask(bitmask.cuda(), vocab_size)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_constrained_outputs_async_equal_sync_beside_free_rows(model_dir, backend: str) -> None:
    """In process and with the rank in a worker process (``mp``, the masks read from the
    grammar process's shared buffers), the next step prepared while the grammars finish the
    one before."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    params = [constrained(KINDS[i % 4]) if i % 2 == 0 else free for i in range(len(PROMPTS))]
    params += [constrained(kind) for kind in KINDS]
    prompts += prompts[: len(KINDS)]
    # Two engines on one GPU: a fixed KV pool each (the default would take 90% of the memory).
    sync = LLM(str(model_dir), device="cuda", dtype="float32", async_scheduling=False,
               num_gpu_blocks_override=512)
    pipelined = LLM(str(model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=512,
                    distributed_executor_backend=backend)
    assert pipelined.llm_engine.engine_core.async_scheduling
    ahead = launches_ahead(pipelined)
    sent = bitmasks_sent(pipelined) if backend == "mp" else None
    want = sync.generate(prompts, params, use_tqdm=False)
    got = pipelined.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert any(ahead)
    if sent is not None:
        assert_sent_by_reference(sent)
    for out, p in zip(got, params):
        if p.structured_outputs is not None:
            kind = p.structured_outputs.key()[0]
            check(kind, out.outputs[0].text)
    for llm in (sync, pipelined):
        engine = llm.llm_engine
        assert engine.num_free_blocks == engine.num_blocks and not engine.has_unfinished_requests()
        assert engine.engine_core.structured_outputs.num_active == 0
        engine.shutdown()
