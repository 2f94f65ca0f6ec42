"""The scheduler runs at most ``max_loras`` different adapters at once, and the adapter id
keys the prefix cache; the worker-side mapping groups rows by slot."""

from __future__ import annotations

import torch
from octavo.config import CacheConfig, SchedulerConfig
from octavo.kv_cache.hashing import block_hasher
from octavo.lora.layers import LoRAMapping
from octavo.lora_request import LoRARequest
from octavo.messages import Request
from octavo.sampling_params import SamplingParams
from octavo.scheduler.scheduler import Scheduler

from tests.scheduler.test_scheduler import BS, FakeRunner, assert_all_free, step


def _request(req_id: str, lora_id: int, prompt: list[int] | None = None) -> Request:
    lora = LoRARequest(f"a{lora_id}", lora_id, "/x") if lora_id else None
    return Request(req_id, prompt or [5, 6, 7, 8, 9, 10, 11, 12, 13], SamplingParams(max_tokens=6),
                   block_hasher(BS, lora_id), lora_request=lora)


def test_at_most_max_loras_adapters_run_at_once() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
                          CacheConfig(block_size=BS), num_blocks=64, max_model_len=64,
                          max_loras=2)
    runner = FakeRunner()
    for i, lora_id in enumerate([1, 2, 0, 3, 1, 0, 3]):
        scheduler.add_request(_request(f"r{i}", lora_id))
    seen_third = False
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
        running = {r.lora_int_id for r in scheduler.running if r.lora_int_id}
        assert len(running) <= 2, running
        seen_third |= 3 in running
    assert seen_third  # adapter 3 ran once a slot freed
    assert_all_free(scheduler)


def test_same_tokens_other_adapter_other_hashes() -> None:
    prompt = list(range(20, 36))
    base, one, two = (_request(n, i, prompt) for n, i in (("b", 0), ("x", 1), ("y", 2)))
    assert len(base.block_hashes) == 4
    assert not set(base.block_hashes) & set(one.block_hashes)
    assert not set(one.block_hashes) & set(two.block_hashes)
    assert _request("z", 1, prompt).block_hashes == one.block_hashes


def test_mapping_groups_rows_by_slot() -> None:
    mapping = LoRAMapping.from_requests([1, -1, 0, 1], [3, 2, 1, 1], torch.device("cpu"))
    assert mapping.group_slots == [0, 1]
    assert mapping.group_starts == [0, 1, 5]
    assert mapping.token_indices.tolist() == [5, 0, 1, 2, 6]
    assert mapping.max_group_size == 4
