"""Structured outputs through ``octavo.LLM`` on a tiny random-weight model.

Random weights make any output possible, so these tests show the constraint is what decides:
every output satisfies its regex, choice, grammar or schema. The constrained outputs are then
compared with themselves under every engine feature that changes how steps are cut (async
scheduling, chunked prefill, preemption, prefix caching, mixed batches): greedy outputs must
be identical.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import jsonschema
import pytest
from octavo.sampling_params import SamplingParams, StructuredOutputsParams

from tests.helpers.engine import (
    assert_close_logprobs,
    assert_no_leaks,
    make_llm,
    prompts_of_lengths,
)

PROMPTS = prompts_of_lengths([3, 9, 17, 30, 41], seed=5)

# Schemas whose every output is short on a random model (bounded strings, enums, numbers).
BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["a", "bb", "ccc"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["id", "kind", "ok", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,4}-\d{3}"
CHOICES = ["Paris", "Tokyo", "neither of them"]
# GBNF with a rule reference and bounded repetition (a random model would loop on "+" forever).
GRAMMAR = 'root ::= "(" term ("+" term)? ("+" term)? ")"\nterm ::= [0-9]'


def constrained(kind: str, **kwargs) -> SamplingParams:
    structured = {
        "json": StructuredOutputsParams(json=BOUNDED_SCHEMA, disable_any_whitespace=True),
        "regex": StructuredOutputsParams(regex=REGEX),
        "choice": StructuredOutputsParams(choice=CHOICES),
        "grammar": StructuredOutputsParams(grammar=GRAMMAR),
    }[kind]
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", 64)
    return SamplingParams(structured_outputs=structured, **kwargs)


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), BOUNDED_SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"\([0-9](\+[0-9]){0,2}\)", text), text


@pytest.fixture(scope="module")
def llm(tiny_llama: Path):
    return make_llm(tiny_llama)


def run(llm, params, prompts=PROMPTS):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("kind", ["json", "regex", "choice", "grammar"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_satisfies_its_constraint(llm, kind: str, temperature: float) -> None:
    outputs = run(llm, constrained(kind, temperature=temperature, seed=11))
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        check(kind, completion.text)
    assert_no_leaks(llm)


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(llm) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in run(llm, free)]
    mixed_params = [free if i % 2 else constrained(["json", "regex"][i % 4 // 2])
                    for i in range(len(PROMPTS))]
    mixed = run(llm, mixed_params)
    for i, out in enumerate(mixed):
        if i % 2:
            assert out.outputs[0].token_ids == alone[i]
        else:
            check(["json", "regex"][i % 4 // 2], out.outputs[0].text)
    assert_no_leaks(llm)


def test_n_completions_each_satisfy_the_constraint(llm) -> None:
    out = run(llm, constrained("regex", temperature=1.0, n=4, seed=3), PROMPTS[:2])
    for request in out:
        assert len(request.outputs) == 4
        for completion in request.outputs:
            check("regex", completion.text)
        assert len({c.text for c in request.outputs}) > 1
    assert_no_leaks(llm)


def test_with_logprobs_and_stop_strings(llm) -> None:
    params = constrained("grammar", logprobs=2, stop=["+"], include_stop_str_in_output=False)
    for out in run(llm, params):
        completion = out.outputs[0]
        assert completion.logprobs is not None
        assert len(completion.logprobs) == len(completion.token_ids)
        # The text stops before the first "+", or is a whole one-digit expression.
        assert re.fullmatch(r"\([0-9](\))?", completion.text), completion.text
    assert_no_leaks(llm)


def test_greedy_fast_path_equals_the_full_sampler(llm) -> None:
    """Greedy constrained rows take the runner's argmax-after-mask path; asking for logprobs
    sends the same rows through the full sampler (float32 logits, sampling metadata)."""
    kinds = ["json", "regex", "choice", "grammar", "json"]
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    sampler = runner.sampler
    calls = []
    runner.sampler = lambda *args: calls.append(1) or sampler(*args)
    try:
        fast = run(llm, [constrained(kind) for kind in kinds])
        assert not calls
        full = run(llm, [constrained(kind, logprobs=1) for kind in kinds])
        assert calls
    finally:
        runner.sampler = sampler
    for kind, a, b in zip(kinds, fast, full):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        check(kind, a.outputs[0].text)
    assert_no_leaks(llm)


# Engine settings under which constrained greedy outputs must not change.
SETTINGS = {
    "async": {"async_scheduling": True},
    "chunked": {"max_num_batched_tokens": 8, "max_model_len": 128},
    "preempting": {"block_size": 4, "num_gpu_blocks_override": 28, "max_num_batched_tokens": 16},
    "async-preempting": {"async_scheduling": True, "block_size": 4,
                         "num_gpu_blocks_override": 28, "max_num_batched_tokens": 16},
    "no-prefix-cache": {"enable_prefix_caching": False},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_same_outputs_under_every_engine_setting(tiny_llama: Path, llm, setting: str) -> None:
    params = [constrained(["json", "regex", "choice", "grammar", "json"][i])
              for i in range(len(PROMPTS))]
    want = [o.outputs[0].token_ids for o in run(llm, params)]
    other = make_llm(tiny_llama, **SETTINGS[setting])
    # Grammars compiled first: then every request is a cache copy, admitted in the same step
    # however loaded the machine is, so the small pool really is contended (preemptions).
    # (On one-token prompts of their own: the test prompts' blocks must not be cached.)
    run(other, [constrained(kind, max_tokens=1) for kind in ("json", "regex", "choice", "grammar")],
        [[7]] * 4)
    got = [o.outputs[0].token_ids for o in run(other, params)]
    assert got == want
    if "preempting" in setting:
        assert other.llm_engine.stats().num_preemptions > 0
    assert_no_leaks(other)


def test_async_scheduling_defers_only_the_sampling(tiny_llama: Path) -> None:
    """Under async scheduling a constrained decode's mask needs the token in flight: its step
    is launched with sampling deferred, and sampled once the mask is known."""
    llm = make_llm(tiny_llama, async_scheduling=True)
    core = llm.llm_engine.engine_core
    deferred = []
    original = core.executor.sample_tokens

    def spy(bitmask):
        deferred.append(list(bitmask.req_ids) if bitmask is not None else [])
        return original(bitmask)

    core.executor.sample_tokens = spy
    run(llm, constrained("regex"))
    assert deferred, "no step deferred its sampling"
    assert all(rows for rows in deferred)
    assert_no_leaks(llm)


@pytest.mark.parametrize("setting", ["async", "async-preempting", "async-chunked"])
def test_a_step_prepared_while_the_grammars_finish_gives_the_same_outputs(
        tiny_llama: Path, monkeypatch, setting: str) -> None:
    """``Executor.prepares_ahead``: under async scheduling the next step is prepared while the
    grammars finish the step before, and launched right after its sampling. Constrained and
    free requests side by side (seeded sampling, logprobs, prompt logprobs, n = 2, requests
    ending at different steps, preemption, prompt chunks) give exactly what they give with
    the step prepared after that sampling (``OCTAVO_PREPARE_AHEAD=0``), and nothing leaks.

    The same tokens exactly; logprobs to float32 rounding: when a grammar's compilation ends
    decides which step its request joins, so the batches differ from run to run (either
    setting), and the CPU's matmuls round a row's logits by the batch it is in."""
    from octavo.worker.async_output import PreparedStepOutput

    engine_args = {"async_scheduling": True, **{
        "async": {},
        "async-preempting": {"block_size": 4, "num_gpu_blocks_override": 28,
                             "max_num_batched_tokens": 16},
        "async-chunked": {"max_num_batched_tokens": 8, "max_model_len": 128},
    }[setting]}
    params = [constrained("json"), constrained("regex", logprobs=2),
              SamplingParams(temperature=1.0, seed=3, max_tokens=9, ignore_eos=True, n=2),
              constrained("choice", prompt_logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1,
                             prompt_logprobs=2)]

    def outputs(prepare_ahead: str) -> tuple[list, int]:
        monkeypatch.setenv("OCTAVO_PREPARE_AHEAD", prepare_ahead)
        llm = make_llm(tiny_llama, **engine_args)
        executor = llm.llm_engine.engine_core.executor
        launch = executor.execute_model_async
        prepared = []

        def spy(scheduler_output):
            pending = launch(scheduler_output)
            prepared.append(isinstance(pending, PreparedStepOutput))
            return pending

        executor.execute_model_async = spy
        # The grammars compiled first, so that all requests start together (as above).
        run(llm, [constrained(kind, max_tokens=1) for kind in ("json", "regex", "choice")],
            [[7]] * 3)
        got = run(llm, params)
        if setting == "async-preempting":
            assert llm.llm_engine.stats().num_preemptions > 0
        assert_no_leaks(llm)
        llm.llm_engine.shutdown()
        return ([([c.token_ids for c in o.outputs], [c.logprobs for c in o.outputs],
                  o.prompt_logprobs) for o in got], sum(prepared))

    ahead, num_prepared = outputs("1")
    after, none_prepared = outputs("0")
    assert num_prepared > 0 and none_prepared == 0
    assert [tokens for tokens, _, _ in ahead] == [tokens for tokens, _, _ in after]
    for (_, logprobs, prompt_logprobs), (_, want, want_prompt) in zip(ahead, after, strict=True):
        assert_close_logprobs(logprobs, want, abs_tol=1e-4, same_ranks=True)
        assert_close_logprobs([prompt_logprobs], [want_prompt], abs_tol=1e-4, same_ranks=True)


@pytest.mark.parametrize("accept, interval_us", [("parallel", "200"), ("loop", "0")])
def test_the_grammar_threads_settings_change_no_output(
        tiny_llama: Path, llm, monkeypatch, accept: str, interval_us: str) -> None:
    """Under async scheduling the grammar thread accepts in parallel or in a loop, with the
    GIL switch interval shortened while it works or not: the same greedy outputs as one step
    at a time, the grammar thread working under the short interval (but for the last steps'
    work, which may start after the engine core went idle), and the interval Python's own again
    once the step's masks are in."""
    import sys

    params = [constrained(["json", "regex", "choice", "grammar", "json"][i])
              for i in range(len(PROMPTS))]
    want = [o.outputs[0].token_ids for o in run(llm, params)]
    monkeypatch.setenv("OCTAVO_GRAMMAR_PROCESS", "0")  # the grammar thread under test
    monkeypatch.setenv("OCTAVO_GRAMMAR_ACCEPT", accept)
    monkeypatch.setenv("OCTAVO_GRAMMAR_SWITCH_INTERVAL_US", interval_us)
    default = sys.getswitchinterval()
    other = make_llm(tiny_llama, async_scheduling=True)
    manager = other.llm_engine.engine_core.structured_outputs
    seen = []
    original = manager._advance

    def spy(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():  # the grammar thread
            seen.append(sys.getswitchinterval())
        return original(*args, **kwargs)

    manager._advance = spy
    got = [o.outputs[0].token_ids for o in run(other, params)]
    assert got == want
    expected = default if interval_us == "0" else 200e-6  # CPython keeps whole µs
    # Once no request is left the engine core restores Python's interval at once, while the
    # grammar work of the steps still in flight (up to two) may not have started yet.
    assert len(seen) > 2 and all(abs(interval - expected) < 2e-6 for interval in seen[:-2])
    assert all(abs(interval - expected) < 2e-6 or interval == default for interval in seen[-2:])
    assert sys.getswitchinterval() == default
    assert_no_leaks(other)


@pytest.mark.parametrize("async_scheduling, spin_us", [(False, "0"), (True, "0"),
                                                       (True, "1000")])
def test_grammars_in_a_process_of_their_own_give_the_same_outputs(
        tiny_llama: Path, llm, monkeypatch, async_scheduling: bool, spin_us: str) -> None:
    """``OCTAVO_GRAMMAR_PROCESS=1``: the same greedy outputs as the in-process grammars, one
    step at a time and with the sampling deferred, nothing held afterwards, and the grammar
    process started with the engine (before any constraint) and gone once it shuts down."""
    from octavo.structured_output.process import GrammarProcess

    params = [constrained(["json", "regex", "choice", "grammar", "json"][i])
              for i in range(len(PROMPTS))]
    want = [o.outputs[0].token_ids for o in run(llm, params)]
    monkeypatch.setenv("OCTAVO_GRAMMAR_PROCESS", "1")
    monkeypatch.setenv("OCTAVO_GRAMMAR_SPIN_US", spin_us)  # both ends poll, or both sleep
    other = make_llm(tiny_llama, async_scheduling=async_scheduling)
    structured = other.llm_engine.engine_core.structured_outputs
    assert isinstance(structured, GrammarProcess)
    structured._started()  # the engine's warm-up began it; nothing was submitted yet
    assert structured._process is not None and structured.num_active == 0
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = run(other, params + [free], PROMPTS + PROMPTS[:1])  # a free one beside them
    assert [o.outputs[0].token_ids for o in got[:-1]] == want
    assert got[-1].outputs[0].token_ids == run(llm, free, PROMPTS[:1])[0].outputs[0].token_ids
    assert_no_leaks(other)
    child = structured._process
    other.llm_engine.shutdown()
    assert child.poll() == 0


@pytest.mark.parametrize("async_scheduling, grammar_process", [
    (False, "0"), (True, "0"), (False, "1"), (True, "1")])
def test_stats_time_the_steps_that_waited_for_grammar_work(
        tiny_llama: Path, monkeypatch, async_scheduling: bool, grammar_process: str) -> None:
    """``SchedulerStats.structured_output_*``: one step per sampling under masks (a request's
    tokens each in a step of its own, so at least its output's length), the grammar work
    timed, and nothing counted for unconstrained requests."""
    monkeypatch.setenv("OCTAVO_GRAMMAR_PROCESS", grammar_process)
    llm = make_llm(tiny_llama, async_scheduling=async_scheduling)
    stats = llm.llm_engine.stats
    before = stats()
    assert (before.structured_output_steps, before.structured_output_wait_s,
            before.structured_output_work_s) == (0, 0.0, 0.0)
    run(llm, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), PROMPTS[:2])
    free = stats()
    assert (free.structured_output_steps, free.structured_output_work_s) == (0, 0.0)
    outputs = run(llm, constrained("regex"), PROMPTS[:3])
    after = stats()
    longest = max(len(o.outputs[0].token_ids) for o in outputs)
    assert longest <= after.structured_output_steps <= 3 * longest + 4
    assert after.structured_output_work_s > 0 and after.structured_output_wait_s > 0
    if not async_scheduling:  # every wait is the work itself, done while the engine waits
        assert after.structured_output_wait_s == pytest.approx(after.structured_output_work_s)
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("async_scheduling, in_process", [
    (False, "0"), (True, "0"), (True, "1")])
def test_a_token_the_grammar_refuses_ends_only_its_request(
        tiny_llama: Path, monkeypatch, async_scheduling: bool, in_process: str) -> None:
    """With the masks not applied (a sampler bug), the grammar refuses the tokens sampled:
    the request is aborted with what it had, the free requests beside it are unchanged and
    nothing leaks, with the grammar advanced at record time, on the grammar thread or in the
    grammar process."""
    monkeypatch.setenv("OCTAVO_GRAMMAR_PROCESS", in_process)
    llm = make_llm(tiny_llama, async_scheduling=async_scheduling)
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in run(llm, free, PROMPTS[:2])]
    monkeypatch.setattr("octavo.worker.model_runner.mask_by_bitmask", lambda *args: None)
    outputs = run(llm, [free, free, constrained("regex", max_tokens=32)], PROMPTS[:3])
    assert [o.outputs[0].token_ids for o in outputs[:2]] == alone
    assert outputs[2].outputs[0].finish_reason == "abort"
    assert_no_leaks(llm)


def test_a_slow_grammar_does_not_stall_other_requests(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama)
    engine = llm.llm_engine
    manager = engine.engine_core.structured_outputs
    release = threading.Event()
    original = manager._compile

    def slow_compile(params, prompt_token_ids):
        release.wait(30)
        return original(params, prompt_token_ids)

    manager._compile = slow_compile
    slow = engine.add_request("slow", {"prompt_token_ids": PROMPTS[0]}, constrained("regex"))
    del slow
    engine.add_request("free", {"prompt_token_ids": PROMPTS[1]},
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    finished: list[str] = []
    start = time.monotonic()
    while "free" not in finished:
        finished += [o.request_id for o in engine.step() if o.finished]
        assert time.monotonic() - start < 20
    assert "slow" not in finished  # still compiling, and it did not hold the other back
    release.set()
    while "slow" not in finished:
        finished += [o.request_id for o in engine.step() if o.finished]
    assert_no_leaks(llm)


def test_abort_while_compiling_and_while_running_leaks_nothing(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, constrained("json"))
    engine.abort_request(["a"])  # most likely still compiling
    engine.add_request("b", {"prompt_token_ids": PROMPTS[1]},
                       constrained("regex", max_tokens=64))
    for _ in range(200):
        engine.step()
        if engine.engine_core.structured_outputs.is_constrained("b"):
            break
    engine.step()
    engine.abort_request(["b"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(llm)
