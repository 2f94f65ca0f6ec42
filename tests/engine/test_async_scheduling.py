"""Async scheduling (step N+1 scheduled and launched before step N's tokens are read back)
gives exactly the outputs of one step at a time, leaks nothing, and really pipelines. (A
step that fails with another in flight: ``tests/entrypoints/test_llm_features.py``.)

Token ids, text, finish and stop reasons, and the ids and ranks of logprobs must be equal;
logprob values to 1e-4 (under preemption the two modes recompute prompts in different
batches, which moves float sums in the last bits). The CPU backend
runs each step synchronously, so these tests check the bookkeeping, not the overlap itself
(that is measured on the GPU: docs/benchmarks.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from octavo.sampling_params import SamplingParams

from tests.helpers.engine import (
    assert_no_leaks,
    greedy,
    make_llm,
    prompts_of_lengths,
    random_prompts,
)

PROMPTS = prompts_of_lengths([5, 12, 17, 33, 40, 45], seed=1) + random_prompts(4, 3, 20, seed=2)

# Engine settings under which both modes are compared.
SETTINGS = {
    "default": {},
    # A 12-token budget: prompts run in chunks beside decodes.
    "chunked": {"max_num_batched_tokens": 12, "max_model_len": 128},
    # 24 blocks of 4 tokens for ~10 requests: preemption while tokens are in flight.
    "preempting": {"block_size": 4, "num_gpu_blocks_override": 24, "max_num_batched_tokens": 16},
    "one_at_a_time": {"max_num_seqs": 1},
}


def sampling_kinds(eos_like: int) -> dict[str, SamplingParams | list[SamplingParams]]:
    """Parameter sets covering every sampler path; ``eos_like`` is a token the model emits."""
    return {
        "greedy": greedy(12),
        "seeded": [SamplingParams(temperature=1.0, top_p=0.9, seed=7 + i, max_tokens=12,
                                  ignore_eos=True) for i in range(len(PROMPTS))],
        # Penalties need the previous token on the host: the runner waits for it.
        "penalties": SamplingParams(temperature=0.0, repetition_penalty=1.3,
                                    frequency_penalty=0.4, presence_penalty=0.2, max_tokens=12,
                                    ignore_eos=True),
        "logprobs": greedy(8, logprobs=3, prompt_logprobs=2),
        # Stops on a sampled token: the step in flight computed one token too many.
        "stop_token": greedy(16, stop_token_ids=[eos_like]),
        "min_tokens": greedy(10, stop_token_ids=[eos_like], min_tokens=6),
        "n": SamplingParams(temperature=0.8, n=2, seed=3, max_tokens=10, ignore_eos=True,
                            logprobs=1),
        "mixed_lengths": [greedy(1 + i % 5) for i in range(len(PROMPTS))],
    }


def summary(outputs) -> list:
    """Everything a request returns, as nested lists, dicts and tuples (compare with
    ``same``)."""

    def lp(d):
        return None if d is None else {k: (v.logprob, v.rank) for k, v in d.items()}

    result = []
    for out in outputs:
        prompt_lp = [lp(d) for d in out.prompt_logprobs or []]
        for c in out.outputs:
            result.append((list(c.token_ids), c.text, c.finish_reason, c.stop_reason,
                           c.cumulative_logprob, [lp(d) for d in c.logprobs or []], prompt_lp))
    return result


def same(got, want) -> bool:
    """Equal, except floats, which may differ by 1e-4 (see the module docstring)."""
    if isinstance(want, float):
        return isinstance(got, float) and got == pytest.approx(want, abs=1e-4)
    if isinstance(want, (list, tuple)):
        return (type(got) is type(want) and len(got) == len(want)
                and all(same(g, w) for g, w in zip(got, want)))
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    return got == want


def test_same_helper_is_strict_on_everything_but_floats() -> None:
    assert same([(1, "a", {2: (-1.0, 1)})], [(1, "a", {2: (-1.00001, 1)})])
    assert not same([(1, "a", {2: (-1.0, 1)})], [(1, "a", {2: (-1.0, 2)})])
    assert not same([(1, "a", {2: (-1.0, 1)})], [(1, "a", {3: (-1.0, 1)})])
    assert not same([(1, "a")], [(1, "b")])
    assert not same([-1.0], [-1.01])


@pytest.fixture(scope="module")
def eos_like(tiny_llama: Path) -> int:
    """A token that greedy decoding emits in the middle of some outputs."""
    out = make_llm(tiny_llama).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], greedy(12), use_tqdm=False
    )
    return out[0].outputs[0].token_ids[4]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_same_outputs_as_one_step_at_a_time(tiny_llama: Path, eos_like: int,
                                            setting: str) -> None:
    sync = make_llm(tiny_llama, async_scheduling=False, **SETTINGS[setting])
    pipelined = make_llm(tiny_llama, async_scheduling=True, **SETTINGS[setting])
    assert pipelined.llm_engine.engine_core.async_scheduling
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for name, params in sampling_kinds(eos_like).items():
        want = summary(sync.generate(prompts, params, use_tqdm=False))
        got = summary(pipelined.generate(prompts, params, use_tqdm=False))
        assert same(got, want), f"{setting}/{name}"
        assert_no_leaks(pipelined)
    if setting == "preempting":
        assert pipelined.llm_engine.stats().num_preemptions > 0


def test_stop_strings_and_a_second_batch(tiny_llama: Path) -> None:
    """Stop strings end requests from the front end, one step after the engine saw them."""
    sync = make_llm(tiny_llama, async_scheduling=False)
    pipelined = make_llm(tiny_llama, async_scheduling=True)
    texts = [o.outputs[0].text for o in sync.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], greedy(12), use_tqdm=False)]
    params = [greedy(12, stop=[t[3:6]]) if len(t) > 6 else greedy(12) for t in texts]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    want = summary(sync.generate(prompts, params, use_tqdm=False))
    assert same(summary(pipelined.generate(prompts, params, use_tqdm=False)), want)
    assert any(c[2] == "stop" for c in want)
    assert_no_leaks(pipelined)
    # The engine is reused with the last step of the previous batch possibly in flight.
    assert same(summary(pipelined.generate(prompts, params, use_tqdm=False)), want)
    assert_no_leaks(pipelined)


def test_steps_really_overlap(tiny_llama: Path) -> None:
    """Each step() launches the next batch before it records the previous one."""
    llm = make_llm(tiny_llama, async_scheduling=True)
    core = llm.llm_engine.engine_core
    executor = core.executor
    events: list[str] = []
    launch = executor.execute_model_async

    def traced(scheduler_output):
        pending = launch(scheduler_output)
        step_no = sum(e.startswith("launch") for e in events)
        events.append(f"launch {step_no}")
        real_result = pending.result

        def result():
            events.append(f"result {step_no}")
            return real_result()

        pending.result = result
        return pending

    executor.execute_model_async = traced
    llm.llm_engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, greedy(3))
    assert llm.llm_engine.step() == []  # launched the prompt, nothing recorded yet
    assert events == ["launch 0"]
    llm.llm_engine.step()
    assert events == ["launch 0", "launch 1", "result 0"]
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    assert_no_leaks(llm)


def test_abort_with_a_step_in_flight(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama, async_scheduling=True)
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, greedy(20))
    for _ in range(4):
        engine.step()
    assert engine.engine_core._in_flight  # a step is in flight
    engine.abort_request(["0", "2"])
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finished) == ["1", "3"]
    assert all(len(finished[i].outputs[0].token_ids) == 20 for i in ("1", "3"))
    assert_no_leaks(llm)


def test_backend_default_and_override(tiny_llama: Path) -> None:
    """The CPU backend runs steps synchronously, so it defaults to one step at a time."""
    assert not make_llm(tiny_llama).llm_engine.engine_core.async_scheduling
    assert make_llm(tiny_llama, async_scheduling=True).llm_engine.engine_core.async_scheduling


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stats_say_where_the_engine_threads_step_time_went(tiny_llama: Path,
                                                           async_scheduling: bool) -> None:
    """``SchedulerStats.engine_*``: every launched step counted once (as the executor saw it),
    and time in each phase; one step at a time, the launch is part of the wait."""
    llm = make_llm(tiny_llama, async_scheduling=async_scheduling)
    try:
        executor = llm.llm_engine.engine_core.executor
        calls = [0]
        launch = executor.execute_model_async if async_scheduling else executor.execute_model

        def counted(scheduler_output):
            calls[0] += 1
            return launch(scheduler_output)

        if async_scheduling:
            executor.execute_model_async = counted
        else:
            executor.execute_model = counted
        before = llm.llm_engine.stats()
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(6), use_tqdm=False)
        after = llm.llm_engine.stats()
        assert after.engine_steps - before.engine_steps == calls[0] >= 6  # 6 tokens each
        for name in ("schedule", "result_wait", "record"):
            assert getattr(after, f"engine_{name}_s") > getattr(before, f"engine_{name}_s")
        assert (after.engine_launch_s > before.engine_launch_s) == async_scheduling
    finally:
        llm.llm_engine.shutdown()
