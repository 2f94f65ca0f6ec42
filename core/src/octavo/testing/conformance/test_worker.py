"""The worker's lifecycle, driven the way the executor and the engine core drive it.

``octavo_worker_class`` -> ``init_device`` -> ``load_model`` -> ``determine_num_blocks`` (the
memory hook) -> ``initialize_cache`` -> ``execute_model`` for hand-built scheduler steps (a
prompt, a prompt in two chunks, decodes, a step that only finishes requests) -> ``shutdown``,
which must let the model and the KV cache go.
"""

from __future__ import annotations

import gc
import weakref

from octavo.messages import CachedRequestData, NewRequestData, SchedulerOutput
from octavo.testing.compare import assert_greedy_choices
from octavo.testing.engine_checks import greedy, prompts_of_lengths
from octavo.testing.engines import engine_config, make_worker
from octavo.testing.hf_reference import HFReference

KV_CACHE_BYTES = 4 * 2**20


def new_request(req_id: str, prompt: list[int], block_ids: list[int]) -> NewRequestData:
    return NewRequestData(req_id=req_id, prompt_token_ids=prompt, output_token_ids=[],
                          sampling_params=greedy(8), block_ids=block_ids,
                          num_computed_tokens=0)


def step(new=(), cached=None, tokens=None, finished=()) -> SchedulerOutput:
    tokens = tokens or {}
    return SchedulerOutput(
        scheduled_new_reqs=list(new), scheduled_cached_reqs=cached or CachedRequestData(),
        num_scheduled_tokens=dict(tokens), total_num_scheduled_tokens=sum(tokens.values()),
        finished_req_ids=set(finished),
    )


def test_worker_lifecycle(octavo_pm, octavo_plan, octavo_tiny_model):
    folder = octavo_tiny_model("llama")
    config = engine_config(octavo_plan, folder, kv_cache_memory_bytes=KV_CACHE_BYTES)
    worker = make_worker(octavo_pm, config)

    worker.init_device()
    assert worker.device.type == octavo_plan.device_type, (
        f"init_device chose {worker.device}, the backend declares device type "
        f"{octavo_plan.device_type!r}"
    )

    worker.load_model()
    for name, param in worker.model.named_parameters():
        assert param.device.type == worker.device.type, f"{name} is on {param.device}"
        assert param.dtype == config.model_config.dtype, f"{name} is {param.dtype}"

    per_block = worker.kv_cache_bytes_per_block()
    num_blocks = worker.determine_num_blocks()
    assert num_blocks == KV_CACHE_BYTES // per_block, "kv_cache_memory_bytes was not honoured"
    worker.initialize_cache(num_blocks)
    mc, bs = config.model_config, config.cache_config.block_size
    caches = worker.model_runner.kv_caches
    expected_shape = tuple(worker.model_runner.attn_backend.get_kv_cache_shape(
        num_blocks, bs, mc.num_kv_heads, mc.head_dim))
    assert len(caches) == mc.num_layers
    for cache in caches:
        assert tuple(cache.shape) == expected_shape
        assert cache.dtype == mc.dtype and cache.device.type == worker.device.type

    # a: a 7-token prompt; b: a 21-token prompt in chunks of 12 and 9. Blocks are handed out
    # up front, from the end of the pool, in no particular order.
    prompt_a, prompt_b = prompts_of_lengths([7, 21], seed=5)
    blocks_a = [num_blocks - 1 - 2 * i for i in range(-(-(7 + 4) // bs))]
    blocks_b = [num_blocks - 2 - 2 * i for i in range(-(-(21 + 4) // bs))]
    outputs = [
        worker.execute_model(step(
            new=[new_request("a", prompt_a, blocks_a), new_request("b", prompt_b, blocks_b)],
            tokens={"a": 7, "b": 12})),
        worker.execute_model(step(
            cached=CachedRequestData(req_ids=["a", "b"], num_computed_tokens=[7, 12]),
            tokens={"a": 1, "b": 9})),
        worker.execute_model(step(
            cached=CachedRequestData(req_ids=["a", "b"], num_computed_tokens=[8, 21]),
            tokens={"a": 1, "b": 1})),
    ]
    for out in outputs:
        assert out.req_ids == ["a", "b"], out.req_ids
    sampled = [out.sampled_token_ids for out in outputs]
    assert sampled[0][1] == [], "a prefill chunk that does not end the prompt samples nothing"
    assert all(len(s[0]) == 1 for s in sampled) and all(len(s[1]) == 1 for s in sampled[1:])
    tokens_a = [s[0][0] for s in sampled]
    tokens_b = [s[1][0] for s in sampled[1:]]

    finish = worker.execute_model(step(finished={"a", "b"}))
    assert finish.req_ids == [] and finish.sampled_token_ids == []

    hf = HFReference(folder, octavo_plan.model_dtype)
    for name, prompt, tokens in (("a", prompt_a, tokens_a), ("b", prompt_b, tokens_b)):
        reference = hf.next_token_logprobs(prompt + tokens)[len(prompt) - 1 : -1]
        if octavo_plan.exact:
            assert tokens == reference.argmax(dim=-1).tolist(), f"request {name}"
        assert_greedy_choices(reference, tokens, octavo_plan.model_dtype, f"request {name}")

    model_ref = weakref.ref(worker.model)
    cache_ref = weakref.ref(caches[0])
    del caches, cache
    worker.shutdown()
    gc.collect()
    assert model_ref() is None, "the model is still referenced after Worker.shutdown()"
    assert cache_ref() is None, "the KV cache is still referenced after Worker.shutdown()"
