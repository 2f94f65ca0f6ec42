"""User-visible features of ``octavo.LLM``: stopping rules, n > 1, chat, token prompts, abort."""

from __future__ import annotations

from pathlib import Path

import pytest
from octavo.sampling_params import SamplingParams

from tests.helpers.engine import assert_no_leaks, greedy, make_llm, token_ids

PROMPT = "Hello world! hello"
EOS = 2  # the tiny tokenizer's </s>


@pytest.fixture(scope="module")
def llm(tiny_llama: Path):
    llm = make_llm(tiny_llama)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def reference(llm) -> tuple[list[int], str]:
    """Greedy token ids and text of PROMPT (24 tokens, EOS ignored)."""
    out = llm.generate(PROMPT, greedy(24), use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), out.text


def find_cross_token_stop(tokenizer, ids: list[int]) -> tuple[str, int, int]:
    """A stop string spanning three tokens (k, k+1, k+2), found first where it was taken.

    Returns (stop, character where it starts, number of tokens up to the one completing it).
    Only the leading printable-ASCII part of the text is used, where prefix decodes are exact.
    """
    ends = [len(tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]
    text = tokenizer.decode(ids)
    ascii_len = next((i for i, ch in enumerate(text) if not (ch.isascii() and ch.isprintable())),
                     len(text))
    for k in range(len(ids) - 2):
        start, end = ends[k] - 1, ends[k + 1] + 1
        if ends[k] > (ends[k - 1] if k else 0) and ends[k + 1] > ends[k] and end <= ascii_len:
            stop = text[start:end]
            if text.find(stop) == start and stop.strip():
                return stop, start, k + 3
    raise AssertionError(f"no stop string candidate in {text!r}")


def test_stop_string_across_tokens(llm, reference) -> None:
    ref_ids, ref_text = reference
    stop, start, num_tokens = find_cross_token_stop(llm.get_tokenizer(), ref_ids)
    out = llm.generate(PROMPT, greedy(24, stop=[stop, "never-seen-xyz"]), use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.text == ref_text[:start]
    assert completion.token_ids == ref_ids[:num_tokens]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert_no_leaks(llm)
    kept = llm.generate(PROMPT, greedy(24, stop=stop, include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == ref_text[: start + len(stop)]


def test_stop_string_frees_blocks_in_the_step_it_is_found(llm, reference) -> None:
    ref_ids, _ = reference
    stop, _, num_tokens = find_cross_token_stop(llm.get_tokenizer(), ref_ids)
    engine = llm.llm_engine
    engine.add_request("stopper", PROMPT, greedy(24, stop=stop))
    engine.add_request("other", PROMPT + " world", greedy(24))
    for _ in range(num_tokens):
        outputs = engine.step()
    stopped = [o for o in outputs if o.request_id == "stopper"]
    assert stopped and stopped[0].finished
    assert "stopper" not in engine.engine_core.scheduler.requests  # freed at once
    assert "other" in engine.engine_core.scheduler.requests
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(llm)


def test_stop_token_ids(llm, reference) -> None:
    ref_ids, _ = reference
    stop_id = ref_ids[3]
    first = ref_ids.index(stop_id)
    completion = llm.generate(PROMPT, greedy(24, stop_token_ids=[stop_id]),
                              use_tqdm=False)[0].outputs[0]
    assert completion.token_ids == ref_ids[: first + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_id)
    assert_no_leaks(llm)


def test_min_tokens_delays_stop_tokens(llm, reference) -> None:
    ref_ids, _ = reference
    stop_id = ref_ids[0]
    completion = llm.generate(PROMPT, greedy(24, stop_token_ids=[stop_id], min_tokens=6),
                              use_tqdm=False)[0].outputs[0]
    assert len(completion.token_ids) >= 6
    assert stop_id not in completion.token_ids[:6]
    assert completion.token_ids[0] != ref_ids[0]  # the stop token was masked, not just ignored
    assert_no_leaks(llm)


def test_eos_min_tokens_and_ignore_eos(llm) -> None:
    always_eos = {EOS: 100.0}
    stops = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10,
                                                logit_bias=always_eos), use_tqdm=False)
    completion = stops[0].outputs[0]
    assert completion.token_ids == [EOS] and completion.text == ""
    assert (completion.finish_reason, completion.stop_reason) == ("stop", None)
    delayed = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, min_tokens=4,
                                                  logit_bias=always_eos), use_tqdm=False)
    assert len(delayed[0].outputs[0].token_ids) == 5
    assert delayed[0].outputs[0].token_ids[-1] == EOS
    assert EOS not in delayed[0].outputs[0].token_ids[:4]
    ignored = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                  logit_bias=always_eos), use_tqdm=False)
    assert ignored[0].outputs[0].token_ids == [EOS] * 10
    assert ignored[0].outputs[0].finish_reason == "length"
    assert_no_leaks(llm)


def test_max_tokens_gives_length(llm, reference) -> None:
    completion = llm.generate(PROMPT, greedy(5), use_tqdm=False)[0].outputs[0]
    assert completion.token_ids == reference[0][:5]
    assert (completion.finish_reason, completion.stop_reason) == ("length", None)


def test_max_tokens_is_clipped_to_max_model_len(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama, max_model_len=32, num_gpu_blocks_override=8)
    ids = llm.get_tokenizer()(PROMPT).input_ids
    completion = llm.generate(PROMPT, greedy(None), use_tqdm=False)[0].outputs[0]
    assert len(ids) + len(completion.token_ids) == 32
    assert completion.finish_reason == "length"
    assert_no_leaks(llm)


def test_n_with_seed_gives_different_reproducible_completions(llm) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    first = llm.generate(PROMPT, params, use_tqdm=False)[0]
    completions = [tuple(c.token_ids) for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert len(set(completions)) > 1
    again = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == completions
    assert_no_leaks(llm)


def test_n_with_prompt_logprobs_returns_them_once(llm) -> None:
    params = greedy(4, n=3, prompt_logprobs=1)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    single = llm.generate(PROMPT, greedy(4, prompt_logprobs=1), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert [p and sorted(p) for p in out.prompt_logprobs] == [
        p and sorted(p) for p in single.prompt_logprobs
    ]
    assert_no_leaks(llm)


def test_prompt_logprobs_in_slices_equal_the_whole_chunk(llm, monkeypatch) -> None:
    """The runner computes prompt logprobs a slice of positions at a time (memory); slices of
    2 positions (the 6-token prompt in 3) give what one slice gives."""
    from octavo.worker import model_runner

    params = greedy(2, prompt_logprobs=2)
    whole = llm.generate(PROMPT, params, use_tqdm=False)[0]
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_SLICE", 2)
    sliced = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert len(whole.prompt_token_ids) > 4
    assert len(sliced.prompt_logprobs) == len(whole.prompt_logprobs)
    for got, want in zip(sliced.prompt_logprobs, whole.prompt_logprobs):
        if want is None:
            assert got is None
            continue
        # The same tokens and ranks; values up to the matmul's float32 rounding, which depends
        # on how many rows the LM head multiplies at once.
        assert {t: p.rank for t, p in got.items()} == {t: p.rank for t, p in want.items()}
        for token, logprob in want.items():
            assert got[token].logprob == pytest.approx(logprob.logprob, abs=1e-5)
    assert_no_leaks(llm)


def test_chat_equals_generate_on_the_rendered_prompt(llm) -> None:
    conversations = [
        [{"role": "user", "content": "Hello world!"}],
        [{"role": "system", "content": "Count."}, {"role": "user", "content": "one, two"}],
    ]
    tokenizer = llm.get_tokenizer()
    rendered = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                for c in conversations]
    assert rendered[0] == "<|im_start|>user\nHello world!<|im_end|>\n<|im_start|>assistant\n"
    chat = llm.chat(conversations, greedy(10), use_tqdm=False)
    plain = llm.generate(rendered, greedy(10), use_tqdm=False)
    assert token_ids(chat) == token_ids(plain)
    assert [o.prompt_token_ids for o in chat] == [o.prompt_token_ids for o in plain]
    assert [o.prompt for o in chat] == rendered
    one = llm.chat(conversations[0], greedy(10), use_tqdm=False)
    assert token_ids(one) == token_ids(plain[:1])
    assert_no_leaks(llm)


def test_token_id_prompts(llm, reference) -> None:
    ids = list(llm.get_tokenizer()(PROMPT).input_ids)
    as_ids = llm.generate(ids, greedy(24), use_tqdm=False)
    assert len(as_ids) == 1 and as_ids[0].prompt is None and as_ids[0].prompt_token_ids == ids
    as_dict = llm.generate({"prompt_token_ids": ids}, greedy(24), use_tqdm=False)
    several = llm.generate([ids, {"prompt": PROMPT}], greedy(24), use_tqdm=False)
    assert token_ids(as_ids) == token_ids(as_dict) == [reference[0]]
    assert token_ids(several) == [reference[0], reference[0]]
    assert several[1].prompt == PROMPT
    assert_no_leaks(llm)


def test_outputs_come_back_in_prompt_order(llm) -> None:
    prompts = ["a" * 30, "b", "Hello", "world " * 5]
    params = [greedy(3), greedy(12), greedy(1), greedy(6)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 12, 1, 6]


def test_abort_frees_blocks(llm, reference) -> None:
    engine = llm.llm_engine
    engine.add_request("abort-me", PROMPT, greedy(24, n=2))
    engine.add_request("keep", PROMPT, greedy(24))
    for _ in range(3):
        engine.step()
    assert engine.num_free_blocks < engine.num_blocks
    (aborted,) = engine.abort_request(["abort-me"])
    assert [c.finish_reason for c in aborted.outputs] == ["abort", "abort"]
    assert [len(c.token_ids) for c in aborted.outputs] == [3, 3]
    assert engine.abort_request(["abort-me", "unknown"]) == []  # idempotent
    kept = []
    while engine.has_unfinished_requests():
        kept += [o for o in engine.step() if o.finished]
    assert token_ids(kept) == [reference[0]]
    assert_no_leaks(llm)


def test_abort_of_a_waiting_request(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama, max_num_seqs=1)
    engine = llm.llm_engine
    engine.add_request("running", PROMPT, greedy(8))
    engine.add_request("waiting", PROMPT + "!", greedy(8))
    engine.step()
    assert [r.request_id for r in engine.engine_core.scheduler.waiting] == ["waiting"]
    engine.abort_request(["waiting"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(llm)


class Interrupt(KeyboardInterrupt):
    pass


def test_interrupt_between_steps_leaves_no_leaks(llm, reference, monkeypatch) -> None:
    real_step = llm.llm_engine.step
    calls = []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise Interrupt()
        return real_step()

    monkeypatch.setattr(llm.llm_engine, "step", step)
    with pytest.raises(Interrupt):
        llm.generate([PROMPT, "other " * 10], greedy(24), use_tqdm=False)
    monkeypatch.undo()
    assert_no_leaks(llm)
    assert token_ids(llm.generate(PROMPT, greedy(24), use_tqdm=False)) == [reference[0]]


def test_interrupt_inside_the_model_step_does_not_poison_the_prefix_cache(tiny_llama: Path,
                                                                          monkeypatch) -> None:
    """A step that never ran must not leave its blocks indexed as cached prefixes."""
    prompt = "The capital of France is Paris. The capital of Japan is Tokyo. Once upon a time"
    expected = token_ids(make_llm(tiny_llama, enable_prefix_caching=False)
                         .generate(prompt, greedy(12), use_tqdm=False))
    llm = make_llm(tiny_llama)  # fresh: the prompt's blocks were never computed
    executor = llm.llm_engine.engine_core.executor

    def execute_model(scheduler_output):
        raise Interrupt()

    monkeypatch.setattr(executor, "execute_model", execute_model)
    with pytest.raises(Interrupt):
        llm.generate(prompt, greedy(12), use_tqdm=False)
    monkeypatch.undo()
    assert_no_leaks(llm)
    assert token_ids(llm.generate(prompt, greedy(12), use_tqdm=False)) == expected
    assert token_ids(llm.generate([prompt, prompt], greedy(12), use_tqdm=False)) == expected * 2


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["one-step", "async"])
def test_failed_step_midway_then_the_engine_recovers(tiny_llama: Path, monkeypatch,
                                                    async_scheduling: bool) -> None:
    """A forward that raises after some steps (with async scheduling, while the step before
    is in flight): requests are recomputed, output unchanged."""
    prompts = ["Hello world! hello", "Once upon a time there was a small model"]
    expected = token_ids(make_llm(tiny_llama).generate(prompts, greedy(10), use_tqdm=False))
    llm = make_llm(tiny_llama, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(10))
    executor = engine.engine_core.executor
    method = "execute_model_async" if async_scheduling else "execute_model"
    real = getattr(executor, method)
    engine.step()
    engine.step()
    if async_scheduling:
        assert engine.engine_core._in_flight  # a step is in flight

    def execute_model(scheduler_output):
        real(scheduler_output)  # the worker ran (and sampled), but the step is lost
        raise RuntimeError("device fell over")

    monkeypatch.setattr(executor, method, execute_model)
    with pytest.raises(RuntimeError, match="fell over"):
        engine.step()
    monkeypatch.undo()
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert token_ids([finished["0"], finished["1"]]) == expected
    assert_no_leaks(llm)


def test_progress_bar_can_be_disabled(llm, capfd) -> None:
    llm.generate(PROMPT, greedy(2), use_tqdm=False)
    assert "Processed prompts" not in capfd.readouterr().err
    llm.generate(PROMPT, greedy(2), use_tqdm=True)
    assert "Processed prompts" in capfd.readouterr().err


def test_reset_prefix_cache_makes_the_next_prompt_computed_whole(tiny_llama: Path) -> None:
    """``LLM.reset_prefix_cache``: refused (False) while a request holds blocks; once idle, the
    same prompt finds nothing cached and generates the same tokens."""
    llm = make_llm(tiny_llama, enable_prefix_caching=True)
    prompt = list(range(3, 3 + 40))  # two full 16-token blocks and a partial one
    engine = llm.llm_engine
    first = token_ids(llm.generate({"prompt_token_ids": prompt}, greedy(8), use_tqdm=False))
    hits = engine.stats().prefix_cache_hits
    assert token_ids(llm.generate({"prompt_token_ids": prompt}, greedy(8),
                                  use_tqdm=False)) == first
    assert engine.stats().prefix_cache_hits == hits + 32

    engine.add_request("running", {"prompt_token_ids": prompt}, greedy(8))
    engine.step()
    assert llm.reset_prefix_cache() is False  # a request holds blocks: nothing forgotten
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache() is True
    hits = engine.stats().prefix_cache_hits
    assert token_ids(llm.generate({"prompt_token_ids": prompt}, greedy(8),
                                  use_tqdm=False)) == first
    assert engine.stats().prefix_cache_hits == hits
    assert_no_leaks(llm)
    engine.shutdown()
