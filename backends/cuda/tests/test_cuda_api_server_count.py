"""`octavo serve --api-server-count 2` on an NVIDIA GPU (run through the device tool; skipped in
CI): concurrent streamed and non-streamed greedy completions through two API server processes
equal the offline engine's on the same GPU, and SIGTERM stops every process with exit 0 and
nothing left behind (the engine core and its CUDA context included).

``OCTAVO_TEST_API_DEVICE=cpu`` runs the same file on the CPU (a dry run of this file).
"""

from __future__ import annotations

import asyncio
import os
import signal

import openai
import pytest
import torch
from octavo import LLM, SamplingParams
from octavo.testing.tiny_models import make_tiny_model

from tests.entrypoints.openai.conftest import API_KEY, SERVED_NAME, ServerProcess

DEVICE = os.environ.get("OCTAVO_TEST_API_DEVICE", "cuda")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cuda" and (not torch.cuda.is_available()
                              or getattr(torch.version, "hip", None) is not None),
        reason="needs an NVIDIA GPU and a CUDA build of torch",
    ),
]

NUM_REQUESTS = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Head size 64: the smallest the Triton attention kernels take.
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", hidden_size=256,
                           intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def prompt(i: int) -> str:
    return f"Request {i}: the capital of France is " + "Paris " * (i % 5)


def test_two_api_servers_equal_offline_and_stop_clean(model_dir) -> None:
    max_tokens = [8 + i % 17 for i in range(NUM_REQUESTS)]
    llm = LLM(str(model_dir), device=DEVICE, dtype="float32", num_gpu_blocks_override=256)
    try:
        expected = [llm.generate(prompt(i), SamplingParams(temperature=0.0, max_tokens=n,
                                                           ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0].text
                    for i, n in enumerate(max_tokens)]
    finally:
        llm.llm_engine.shutdown()
    server = ServerProcess(model_dir, "--device", DEVICE, "--api-server-count", "2")
    try:
        async def one(client: openai.AsyncOpenAI, i: int) -> str:
            common = {"model": SERVED_NAME, "prompt": prompt(i), "max_tokens": max_tokens[i],
                      "temperature": 0.0, "extra_body": {"ignore_eos": True}}
            if i % 2:
                return (await client.completions.create(**common)).choices[0].text
            stream = await client.completions.create(stream=True, **common)
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

        async def run_all() -> list[str]:
            clients = [openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY,
                                          max_retries=0, timeout=300) for _ in range(4)]
            try:
                return await asyncio.gather(*(one(clients[i % 4], i)
                                              for i in range(NUM_REQUESTS)))
            finally:
                for client in clients:
                    await client.close()

        texts = asyncio.run(run_all())
        log = server.read_log()
    except BaseException:
        server.kill()
        raise
    assert server.stop(signal.SIGTERM) == 0, log  # checks that no process is left behind
    for i, (text, want) in enumerate(zip(texts, expected)):
        assert text == want, f"request {i}"
