"""``Scheduler`` driven by a fake model runner: budgets, chunking, preemption, abort, limits."""

from __future__ import annotations

import dataclasses

import pytest
from octavo.config import CacheConfig, SchedulerConfig
from octavo.kv_cache.hashing import block_hasher
from octavo.messages import (
    LogprobsLists,
    ModelRunnerOutput,
    Request,
    RequestStatus,
    SchedulerOutput,
)
from octavo.sampling_params import SamplingParams
from octavo.scheduler.scheduler import Scheduler

BS = 4


class FakeRunner:
    """Mirrors the model runner's bookkeeping; "samples" a token computed from the sequence.

    The next token depends only on the tokens so far, so a request's output is the same
    whatever the batch, chunking or preemption. Checks the scheduler's messages on the way:
    every scheduled token has a slot in the request's blocks and no slot is written twice.
    """

    def __init__(self, block_size: int = BS) -> None:
        self.block_size = block_size
        self.prompt_lens: dict[str, int] = {}
        self.wants_prompt_logprobs: set[str] = set()
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.steps: list[SchedulerOutput] = []

    @staticmethod
    def next_token(tokens: list[int]) -> int:
        return (sum(tokens) * 31 + len(tokens)) % 300 + 10

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(so)
        for req_id in so.finished_req_ids:
            for table in (self.tokens, self.num_computed, self.blocks):
                table.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.tokens, f"{new.req_id} sent as new twice"
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.num_computed[new.req_id] = new.num_computed_tokens
            self.blocks[new.req_id] = list(new.block_ids)
            self.prompt_lens[new.req_id] = len(new.prompt_token_ids)
            if new.sampling_params.prompt_logprobs is not None:
                self.wants_prompt_logprobs.add(new.req_id)
        cached = so.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            assert self.num_computed[req_id] == num_computed
            self.blocks[req_id].extend(cached.new_block_ids.get(req_id, []))
        out = ModelRunnerOutput()
        written: set[int] = set()
        for req_id in [r.req_id for r in so.scheduled_new_reqs] + cached.req_ids:
            start = self.num_computed[req_id]
            end = start + so.num_scheduled_tokens[req_id]
            tokens, blocks = self.tokens[req_id], self.blocks[req_id]
            assert end <= len(tokens), f"{req_id}: scheduled past its known tokens"
            assert len(blocks) * self.block_size >= end, f"{req_id}: no slot for token {end - 1}"
            for pos in range(start, end):
                slot = blocks[pos // self.block_size] * self.block_size + pos % self.block_size
                assert slot not in written, f"slot {slot} written twice in one step"
                written.add(slot)
            self.num_computed[req_id] = end
            last = min(end, self.prompt_lens[req_id] - 1)
            if req_id in self.wants_prompt_logprobs and start < last:
                # Row i: position start + i predicting prompt token start + i + 1.
                targets = tokens[start + 1 : last + 1]
                out.prompt_logprobs[req_id] = LogprobsLists(
                    [[t] for t in targets], [[-1.0] for _ in targets], [1 for _ in targets]
                )
            sampled = []
            if end == len(tokens):
                sampled = [self.next_token(tokens)]
                tokens.append(sampled[0])
            out.req_ids.append(req_id)
            out.sampled_token_ids.append(sampled)
        assert sum(so.num_scheduled_tokens.values()) == so.total_num_scheduled_tokens
        return out


def make_scheduler(num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 16,
                   chunked: bool = True, caching: bool = True, max_model_len: int = 256) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                        enable_chunked_prefill=chunked),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
    )


def make_request(req_id: str, prompt_len: int, max_tokens: int = 4, start: int = 10) -> Request:
    prompt = [(start + 7 * i) % 300 + 5 for i in range(prompt_len)]
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), block_hasher(BS))


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, dict[str, list[int]]]:
    so = scheduler.schedule()
    outputs = scheduler.update_from_output(so, runner.execute(so))
    return so, {o.request_id: o.new_token_ids for o in outputs}


def run_to_end(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 500) -> dict[str, list[int]]:
    """Step until nothing is left; return every request's generated tokens."""
    generated: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return generated
        _, new = step(scheduler, runner)
        for req_id, ids in new.items():
            generated.setdefault(req_id, []).extend(ids)
    raise AssertionError("the scheduler did not finish its requests")


def assert_all_free(scheduler: Scheduler) -> None:
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.num_requests_holding_blocks() == 0
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(FakeRunner.next_token(tokens))
        tokens.append(out[-1])
    return out


def test_token_budget_and_max_num_seqs() -> None:
    scheduler = make_scheduler(budget=16, max_num_seqs=2)
    runner = FakeRunner()
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 10, max_tokens=3, start=i))
    so, _ = step(scheduler, runner)
    # r0 whole (10), r1 chunked to the remaining 6; r2 waits for a sequence slot.
    assert so.num_scheduled_tokens == {"r0": 10, "r1": 6}
    assert [r.request_id for r in scheduler.running] == ["r0", "r1"]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]
    for _ in range(20):
        if not scheduler.has_unfinished_requests():
            break
        so, _ = step(scheduler, runner)
        assert so.total_num_scheduled_tokens <= 16
        assert len(so.num_scheduled_tokens) <= 2
    assert_all_free(scheduler)


def test_chunked_prefill_splits_a_long_prompt() -> None:
    scheduler = make_scheduler(budget=8)
    runner = FakeRunner()
    request = make_request("long", 40, max_tokens=2)
    scheduler.add_request(request)
    for i in range(5):
        so, new = step(scheduler, runner)
        assert so.num_scheduled_tokens == {"long": 8}
        assert request.num_computed_tokens == 8 * (i + 1)
        assert new == ({} if i < 4 else {"long": [FakeRunner.next_token(request.prompt_token_ids)]})
    assert len(so.scheduled_cached_reqs) == 1 and not so.scheduled_new_reqs
    so, new = step(scheduler, runner)  # one decode step
    assert so.num_scheduled_tokens == {"long": 1}
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert_all_free(scheduler)


def test_without_chunking_a_prompt_runs_whole() -> None:
    scheduler = make_scheduler(budget=8, chunked=False, max_model_len=64)
    runner = FakeRunner()
    scheduler.add_request(make_request("a", 40, max_tokens=2))
    scheduler.add_request(make_request("b", 40, max_tokens=2, start=3))
    so, _ = step(scheduler, runner)
    # The budget is raised to max_model_len (64): a's 40 tokens fit; b's 40 are not split
    # into the 24 left, b waits.
    assert so.num_scheduled_tokens == {"a": 40}
    so, _ = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 40}
    run_to_end(scheduler, runner)
    assert_all_free(scheduler)


def test_prefill_and_decode_share_a_step() -> None:
    scheduler = make_scheduler()
    runner = FakeRunner()
    scheduler.add_request(make_request("a", 5, max_tokens=4))
    step(scheduler, runner)
    scheduler.add_request(make_request("b", 7, max_tokens=4, start=2))
    so, new = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 7}
    assert so.scheduled_cached_reqs.req_ids == ["a"]
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b"]
    assert set(new) == {"a", "b"}


def test_preemption_of_the_newest_and_identical_resumption() -> None:
    # 6 blocks of 4: two requests of 8 prompt + 12 output tokens (5 blocks each) cannot both fit.
    scheduler = make_scheduler(num_blocks=6)
    runner = FakeRunner()
    old, new_req = make_request("old", 8, max_tokens=12), make_request("new", 8, 12, start=5)
    scheduler.add_request(old)
    scheduler.add_request(new_req)
    preempted_at = None
    generated: dict[str, list[int]] = {}
    for i in range(100):
        if not scheduler.has_unfinished_requests():
            break
        so, new = step(scheduler, runner)
        for req_id, ids in new.items():
            generated.setdefault(req_id, []).extend(ids)
        if preempted_at is None and scheduler.num_preemptions:
            preempted_at = i
            assert new_req.status == RequestStatus.PREEMPTED and old.status == RequestStatus.RUNNING
            assert "new" in so.finished_req_ids  # the worker drops its state
            assert scheduler.waiting.peek() is new_req and new_req.num_computed_tokens == 0
            assert scheduler.kv_cache_manager.get_block_ids("new") == []
            num_generated_before = len(new_req.output_token_ids)
            assert num_generated_before > 0
        if preempted_at is not None and any(r.req_id == "new" for r in so.scheduled_new_reqs):
            resumed = next(r for r in so.scheduled_new_reqs if r.req_id == "new")
            # Resumed with the tokens it had generated, recomputed as prompt.
            assert len(resumed.output_token_ids) >= num_generated_before
    assert preempted_at is not None, "the pool was large enough: no preemption happened"
    assert scheduler.stats().num_preemptions >= 1
    assert generated["old"] == expected_output(old.prompt_token_ids, 12)
    assert generated["new"] == expected_output(new_req.prompt_token_ids, 12)
    assert_all_free(scheduler)


def test_abort_frees_blocks_in_every_state() -> None:
    scheduler = make_scheduler(num_blocks=8, budget=8)
    runner = FakeRunner()
    running = make_request("running", 20, max_tokens=4)  # mid-prefill after one step
    waiting = make_request("waiting", 6, max_tokens=4, start=3)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    step(scheduler, runner)
    assert running.status == RequestStatus.RUNNING and running.num_computed_tokens == 8
    assert waiting.status == RequestStatus.WAITING
    scheduler.finish_requests(["waiting"], RequestStatus.FINISHED_ABORTED)
    assert waiting.status == RequestStatus.FINISHED_ABORTED and not scheduler.waiting
    scheduler.finish_requests(["running"], RequestStatus.FINISHED_ABORTED)
    assert running.status == RequestStatus.FINISHED_ABORTED
    assert_all_free(scheduler)
    scheduler.finish_requests(["running", "unknown"], RequestStatus.FINISHED_ABORTED)  # no-op
    so = scheduler.schedule()
    assert so.is_empty and so.finished_req_ids == {"running", "waiting"}


def test_abort_of_a_preempted_request() -> None:
    scheduler = make_scheduler(num_blocks=6)
    runner = FakeRunner()
    scheduler.add_request(make_request("old", 8, max_tokens=12))
    victim = make_request("new", 8, max_tokens=12, start=5)
    scheduler.add_request(victim)
    for _ in range(50):
        step(scheduler, runner)
        if victim.status == RequestStatus.PREEMPTED:
            break
    assert victim.status == RequestStatus.PREEMPTED
    scheduler.finish_requests(["new"], RequestStatus.FINISHED_ABORTED)
    assert victim not in scheduler.waiting
    run_to_end(scheduler, runner)
    assert_all_free(scheduler)


def test_a_request_that_can_never_fit_is_an_invariant_violation() -> None:
    """The front end's Processor refuses such requests (tests/engine/test_processor.py): the
    scheduler only asserts it, and holds nothing of the request."""
    scheduler = make_scheduler(num_blocks=4)
    with pytest.raises(AssertionError, match="can never fit the KV cache"):
        scheduler.add_request(make_request("big", 10, max_tokens=10))
    assert not scheduler.requests and not scheduler.waiting
    scheduler.add_request(make_request("fits", 8, max_tokens=8))  # exactly 4 blocks
    assert run_to_end(scheduler, FakeRunner())["fits"] == expected_output(
        make_request("fits", 8).prompt_token_ids, 8
    )
    assert_all_free(scheduler)


def test_duplicate_request_id_is_rejected() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("same", 4))
    with pytest.raises(AssertionError, match="'same' is already in use"):
        scheduler.add_request(make_request("same", 4))
    assert len(scheduler.waiting) == 1


def test_prefix_cache_hit_skips_computed_tokens() -> None:
    scheduler = make_scheduler()
    runner = FakeRunner()
    first = make_request("first", 14, max_tokens=2)
    scheduler.add_request(first)
    run_to_end(scheduler, runner)
    second = make_request("second", 14, max_tokens=2)  # same prompt
    scheduler.add_request(second)
    so, _ = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"second": 14 - 12}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12
    assert second.num_cached_tokens == 12
    assert scheduler.stats().prefix_cache_hit_rate == pytest.approx(12 / 28)
    run_to_end(scheduler, runner)
    assert_all_free(scheduler)


def test_many_requests_under_pressure_all_finish_correctly() -> None:
    """Random-ish mix with a small pool and budget: every output is what it would be alone."""
    scheduler = make_scheduler(num_blocks=12, budget=10, max_num_seqs=5)
    runner = FakeRunner()
    requests = [make_request(f"r{i}", 3 + (i * 5) % 17, max_tokens=2 + i % 7, start=i)
                for i in range(12)]
    for request in requests[:6]:
        scheduler.add_request(request)
    generated = {}
    for i in range(3):
        for req_id, ids in step(scheduler, runner)[1].items():
            generated.setdefault(req_id, []).extend(ids)
    for request in requests[6:]:
        scheduler.add_request(request)
    for req_id, ids in run_to_end(scheduler, runner).items():
        generated.setdefault(req_id, []).extend(ids)
    assert scheduler.num_preemptions > 0
    for request in requests:
        expected = expected_output(request.prompt_token_ids, request.max_tokens)
        assert generated[request.request_id] == expected, request.request_id
    assert_all_free(scheduler)


def test_discarded_step_is_recomputed_from_scratch() -> None:
    scheduler = make_scheduler(budget=8)
    runner = FakeRunner()
    a, b = make_request("a", 10, max_tokens=6), make_request("b", 5, max_tokens=6, start=4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    for _ in range(3):
        step(scheduler, runner)
    generated_before = {r.request_id: list(r.output_token_ids) for r in (a, b)}
    so = scheduler.schedule()  # ... and the model raises: no update_from_output
    assert not so.is_empty
    scheduler.discard_steps([so])
    assert not scheduler.running and [r.request_id for r in scheduler.waiting] == ["a", "b"]
    assert all(r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0 for r in (a, b))
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks
    # Nothing it would have filled is a prefix-cache hit now.
    for request in (a, b):
        assert scheduler.kv_cache_manager.get_computed_blocks(request)[1] <= 8
    assert {r.request_id: list(r.output_token_ids) for r in (a, b)} == generated_before
    so = scheduler.schedule()
    assert {"a", "b"} <= so.finished_req_ids  # the worker drops its state for both
    scheduler.update_from_output(so, runner.execute(so))
    run_to_end(scheduler, runner)
    assert a.output_token_ids == expected_output(a.prompt_token_ids, 6)
    assert b.output_token_ids == expected_output(b.prompt_token_ids, 6)
    assert_all_free(scheduler)


def test_prompt_logprobs_are_sent_once_across_preemption() -> None:
    scheduler = make_scheduler(num_blocks=8, budget=6)
    runner = FakeRunner()
    requests = []
    for i in range(3):
        prompt = [(7 * i + 3 * j) % 300 + 5 for j in range(13)]
        params = SamplingParams(max_tokens=14, prompt_logprobs=1)
        requests.append(Request(f"r{i}", prompt, params, block_hasher(BS)))
        scheduler.add_request(requests[-1])
    received: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for _ in range(300):
        if not scheduler.has_unfinished_requests():
            break
        so = scheduler.schedule()
        for out in scheduler.update_from_output(so, runner.execute(so)):
            if out.new_prompt_logprobs is not None:
                received[out.request_id] += [row[0] for row in out.new_prompt_logprobs.token_ids]
    assert scheduler.num_preemptions > 0
    for request in requests:
        assert received[request.request_id] == request.prompt_token_ids[1:]
    assert_all_free(scheduler)


@pytest.mark.parametrize("caching", [True, False])
def test_inline_decode_path_gives_the_same_steps_as_the_general_path(
        caching: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's inline path for plain running requests (taken when the step fits the
    blocks a request holds) must schedule exactly what the general path schedules: the same
    messages every step, the same outputs, the same preemptions, under pressure."""

    num_inline = 0

    def run(inline: bool) -> tuple[list[tuple], list[tuple], int]:
        scheduler = make_scheduler(num_blocks=14, budget=12, max_num_seqs=6, caching=caching)
        fits = scheduler.kv_cache_manager.fits_in_held_blocks

        def counted(request: Request, num_new: int) -> bool:
            nonlocal num_inline
            result = fits(request, num_new)
            num_inline += result
            return result

        monkeypatch.setattr(scheduler.kv_cache_manager, "fits_in_held_blocks", counted)
        scheduler.inline_decode = inline
        runner = FakeRunner()
        requests = [make_request(f"r{i}", 3 + (i * 5) % 13, max_tokens=3 + i % 9, start=i % 4)
                    for i in range(14)]
        for request in requests:
            scheduler.add_request(request)
        steps, outputs = [], []
        for _ in range(400):
            if not scheduler.has_unfinished_requests():
                break
            so = scheduler.schedule()
            steps.append((
                [(r.req_id, r.block_ids, r.num_computed_tokens) for r in so.scheduled_new_reqs],
                dataclasses.asdict(so.scheduled_cached_reqs),
                dict(so.num_scheduled_tokens), so.total_num_scheduled_tokens,
                sorted(so.finished_req_ids)))
            for o in scheduler.update_from_output(so, runner.execute(so)):
                outputs.append((o.request_id, o.new_token_ids, o.finish_reason,
                                o.num_cached_tokens))
        assert_all_free(scheduler)
        return steps, outputs, scheduler.num_preemptions

    inline = run(True)
    assert num_inline > 20  # decode steps within a block took the inline path
    assert inline == run(False)
    assert inline[2] > 0  # the pool is small enough to preempt
