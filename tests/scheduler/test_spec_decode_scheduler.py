"""The scheduler's side of speculative decoding, driven by hand-written runner outputs:
drafts scheduled with KV slots, rejected ones rolled back, a stop inside a step cuts the
tokens and their logprobs, drafts capped by max_tokens and the token budget, counters."""

from __future__ import annotations

from octavo.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from octavo.messages import LogprobsLists, ModelRunnerOutput, Request, RequestStatus
from octavo.sampling_params import SamplingParams
from octavo.scheduler.scheduler import Scheduler

BS = 4
NUM_BLOCKS = 64
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


def make_scheduler(k: int = 3, **scheduler_kwargs) -> Scheduler:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1,
                             prompt_lookup_max=2)
    return Scheduler(SchedulerConfig(**scheduler_kwargs), CacheConfig(block_size=BS),
                     num_blocks=NUM_BLOCKS, max_model_len=128, speculative_config=spec)


def request(req_id: str = "a", max_tokens: int = 10, **params) -> Request:
    return Request(req_id, PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                  **params))


def output(so, sampled: dict[str, list[int]], logprobs: bool = False) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[sampled.get(r, []) for r in req_ids])
    if logprobs:
        for r, tokens in sampled.items():
            out.logprobs[r] = LogprobsLists([[t] for t in tokens], [[-0.5] for _ in tokens],
                                            [1 for _ in tokens])
    return out


def test_drafts_scheduled_rejections_rolled_back_and_counted() -> None:
    scheduler = make_scheduler()
    req = request()
    scheduler.add_request(req)
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 8} and not so.scheduled_spec_decode_tokens
    scheduler.update_from_output(so, output(so, {"a": [3]}))
    assert req.spec_token_ids == [1, 2, 3]  # "2 3" was followed by "1 2 3"
    so = scheduler.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    assert so.num_scheduled_tokens == {"a": 4}
    assert req.num_computed_tokens == 12
    assert len(scheduler.kv_cache_manager.get_block_ids("a")) == 3  # slots for every draft
    # The target accepts draft 1, then says 7 instead of 2.
    outs = scheduler.update_from_output(so, output(so, {"a": [1, 7]}))
    assert outs[0].new_token_ids == [1, 7]
    assert req.output_token_ids == [3, 1, 7]
    assert req.num_computed_tokens == req.num_tokens - 1 == 10  # drafts 2, 3 rolled back
    assert req.num_output_placeholders == 0
    stats = scheduler.stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens) == (1, 3, 1)
    assert stats.spec_decode_num_accepted_tokens_per_pos == [1, 0, 0]
    # No draft for "... 1 7" (7 never occurred): a plain one-token decode next.
    assert req.spec_token_ids == []
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 1} and not so.scheduled_spec_decode_tokens


def test_stop_inside_a_step_cuts_tokens_and_logprobs_and_frees_blocks() -> None:
    scheduler = make_scheduler()
    req = request(stop_token_ids=[2], logprobs=0)
    scheduler.add_request(req)
    so = scheduler.schedule()
    scheduler.update_from_output(so, output(so, {"a": [3]}))
    so = scheduler.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    outs = scheduler.update_from_output(so, output(so, {"a": [1, 2, 3, 9]}, logprobs=True))
    (out,) = outs
    assert out.new_token_ids == [1, 2]
    assert out.finish_reason == "stop" and out.stop_reason == 2
    assert out.new_logprobs.token_ids == [[1], [2]] and out.new_logprobs.ranks == [1, 1]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert scheduler.kv_cache_manager.num_free_blocks == NUM_BLOCKS
    assert not scheduler.has_unfinished_requests()


def test_drafts_capped_by_max_tokens_and_the_token_budget() -> None:
    scheduler = make_scheduler(k=5)
    req = request(max_tokens=3)
    scheduler.add_request(req)
    so = scheduler.schedule()
    scheduler.update_from_output(so, output(so, {"a": [3]}))
    so = scheduler.schedule()
    # 2 tokens left to generate: at most 1 draft (a step emits up to drafts + 1).
    assert so.scheduled_spec_decode_tokens == {"a": [1]}
    outs = scheduler.update_from_output(so, output(so, {"a": [1, 2]}))
    assert outs[0].finish_reason == "length" and req.output_token_ids == [3, 1, 2]

    scheduler = make_scheduler(k=5, max_num_batched_tokens=16)
    first, second = request("a"), request("b")
    scheduler.add_request(first)
    so = scheduler.schedule()
    scheduler.update_from_output(so, output(so, {"a": [3]}))
    scheduler.add_request(second)
    so = scheduler.schedule()
    # "a" verifies its drafts (1 + 5 tokens) and "b"'s prompt gets the rest of the budget.
    assert so.num_scheduled_tokens == {"a": 6, "b": 8}
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2, 3, 1, 2]}
    # With a budget of 4 left for "a", it verifies 3 of its drafts.
    scheduler = make_scheduler(k=5, max_num_batched_tokens=4)
    scheduler.add_request(request("a"))
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 4}  # the prompt's first chunk
    scheduler.update_from_output(so, output(so, {}))
    so = scheduler.schedule()
    scheduler.update_from_output(so, output(so, {"a": [3]}))
    so = scheduler.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    assert so.num_scheduled_tokens == {"a": 4}


def test_preemption_drops_drafts() -> None:
    scheduler = make_scheduler()
    req = request()
    scheduler.add_request(req)
    so = scheduler.schedule()
    scheduler.update_from_output(so, output(so, {"a": [3]}))
    assert req.spec_token_ids
    scheduler._preempt([req], so)
    assert req.spec_token_ids == [] and req.num_computed_tokens == 0
