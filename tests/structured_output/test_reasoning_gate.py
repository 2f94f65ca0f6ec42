"""With a reasoning parser, a constraint shapes the answer only: ``ReasoningGate`` phases, the
manager's masks while a request thinks, and the engine end to end (sync and async)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from octavo.reasoning import get_reasoning_parser
from octavo.sampling_params import SamplingParams, StructuredOutputsParams
from octavo.structured_output.manager import StructuredOutputManager
from octavo.structured_output.reasoning_gate import Phase, ReasoningGate

from tests.helpers.engine import assert_no_leaks, grammar_process, grammar_tokenizer, make_llm
from tests.helpers.tool_model import CASES, WEATHER_TOOL, render

SCHEMA = WEATHER_TOOL["function"]["parameters"]


@pytest.fixture(scope="module")
def tokenizer(tool_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tool_model)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def gate_of(name: str, tokenizer) -> ReasoningGate:
    return ReasoningGate(get_reasoning_parser(name)(tokenizer), tokenizer)


# ---- the gate ---------------------------------------------------------------------------------


@pytest.mark.parametrize("parser, prompt_end, phase", [
    ("qwen3", "<|im_start|>assistant\n", Phase.MAY_THINK),
    ("qwen3", "<|im_start|>assistant\n<think>\n", Phase.THINKING),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", Phase.ANSWERING),
    # An earlier turn's closed block is not the end of the prompt: the new turn may think.
    ("qwen3", "<think>\nx\n</think>\n\nhi<|im_end|>\n<|im_start|>assistant\n", Phase.MAY_THINK),
    ("deepseek_r1", "<|im_start|>assistant\n", Phase.THINKING),
    ("deepseek_r1", "<|im_start|>assistant\n<think>\n\n</think>\n\n", Phase.ANSWERING),
])
def test_the_prompt_decides_the_first_phase(tokenizer, parser, prompt_end, phase) -> None:
    prompt = ids(tokenizer, "<|im_start|>user\nWhy?<|im_end|>\n" + prompt_end)
    assert gate_of(parser, tokenizer).initial_state(prompt).phase is phase


def test_tokens_after_the_end_tag_go_to_the_grammar(tokenizer) -> None:
    gate = gate_of("qwen3", tokenizer)
    start, end = gate.start_token_id, gate.end_token_id
    thought, answer = ids(tokenizer, "\nBlue light.\n"), ids(tokenizer, '{"city"')
    state = gate.initial_state([])
    assert gate.advance(state, [start]) == [] and state.phase is Phase.THINKING
    assert gate.advance(state, thought) == [] and state.phase is Phase.THINKING
    assert gate.advance(state, [end, *answer]) == answer and state.phase is Phase.ANSWERING
    assert gate.advance(state, [start, end]) == [start, end]  # answering: everything counts
    # A request that may think and answers at once: its first token is the grammar's.
    state = gate.initial_state([])
    assert gate.advance(state, answer) == answer and state.phase is Phase.ANSWERING


def test_tags_of_several_tokens_are_read_by_decoding(tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert len(ids(tokenizer, "</think>")) > 1
    gate = gate_of("deepseek_r1", tokenizer)
    state = gate.initial_state(ids(tokenizer, "hello"))
    assert state.phase is Phase.THINKING
    tokens = ids(tokenizer, "so it is </think>yes")
    # The grammar gets what follows the token that completed the tag.
    fed = []
    for token in tokens:
        fed += gate.advance(state, [token])
    assert state.phase is Phase.ANSWERING
    assert tokenizer.decode(fed).strip() in {"yes", "s", "es"} and fed == tokens[-len(fed):]
    # With tags of several tokens and no open block, the answer starts at once.
    assert gate_of("qwen3", tokenizer).initial_state(ids(tokenizer, "hi")).phase is Phase.ANSWERING


# ---- the manager's masks ----------------------------------------------------------------------


def allowed_rows(bitmask) -> list[set[int]]:
    rows = np.frombuffer(bitmask.data, dtype="<u4").reshape(len(bitmask.req_ids),
                                                             bitmask.num_words)
    return [{w * 32 + b for w, word in enumerate(row) for b in range(32) if word >> b & 1}
            for row in rows]


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("where", ["thread", "process"])
def test_masks_while_thinking_and_after(tokenizer, tool_model: Path, use_async: bool,
                                        where: str) -> None:
    vocab = len(tokenizer)
    if where == "thread":
        manager = StructuredOutputManager(lambda: grammar_tokenizer(tokenizer), vocab,
                                          reasoning_parser=get_reasoning_parser("qwen3"))
    else:  # the phases needs_mask reads come back from the grammar process with each step
        manager = grammar_process(tool_model, vocab, max_rows=4, reasoning_parser="qwen3")
    try:
        params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        prompt = ids(tokenizer, "<|im_start|>assistant\n")
        manager.submit("r", params, prompt)
        manager.submit("off", params, prompt + ids(tokenizer, "<think>\n\n</think>\n\n"))
        deadline = time.monotonic() + 60
        ready = []
        while len(ready) < 2 and time.monotonic() < deadline:
            manager.wait(1.0)
            ready += manager.take_ready()
        assert all(r.error is None for r in ready) and len(ready) == 2
        start = tokenizer.convert_tokens_to_ids("<think>")
        end = tokenizer.convert_tokens_to_ids("</think>")

        def step(sampled: dict[str, list[int]]) -> list[set[int]]:
            if use_async:
                done = manager.accept_and_bitmask_async(list(sampled), list(sampled.values()),
                                                        ["r", "off"]).result()
                assert done.errors == {}
                return allowed_rows(done.bitmask)
            assert manager.accept_step(sampled) == {}
            return allowed_rows(manager.bitmask(["r", "off"]))

        first, off = allowed_rows(manager.bitmask(["r", "off"]))
        grammar_first = first - {start}
        assert start in first and end not in first and grammar_first
        assert off == first - {start}  # thinking switched off: the grammar alone
        assert manager.needs_mask("r", token_in_flight=False)
        thinking, _ = step({"r": [start]})
        assert len(thinking) == 32 * manager.num_words  # anything while thinking
        assert not manager.needs_mask("r", token_in_flight=False)
        assert manager.needs_mask("r", token_in_flight=True)  # the token in flight may end it
        step({"r": ids(tokenizer, "\nhm\n")})
        answer, _ = step({"r": [end]})
        assert answer == first - {start}  # the grammar, from its start
        assert manager.needs_mask("r", token_in_flight=False)
        opening = min(grammar_first)  # the grammar consumes what comes now
        after, _ = step({"r": [opening]})
        assert after and after != grammar_first
    finally:
        manager.shutdown()


# ---- end to end -------------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling, in_process", [
    (False, "0"), (True, "0"), (True, "1")])
def test_the_model_thinks_then_writes_the_constrained_answer(
        tool_model: Path, tokenizer, monkeypatch, async_scheduling: bool,
        in_process: str) -> None:
    """The tool model learned to think before calling a tool ("berlin"): with the reasoning
    parser its thinking is untouched and the JSON after the end tag follows the schema;
    without it, the schema shapes the output from its first token (the grammars on the
    engine core's threads or in their own process)."""
    monkeypatch.setenv("OCTAVO_GRAMMAR_PROCESS", in_process)
    prompt = render(tokenizer, CASES["berlin"])
    params = SamplingParams(temperature=0.0, max_tokens=100, skip_special_tokens=False,
                            structured_outputs=StructuredOutputsParams(
                                json=SCHEMA, disable_any_whitespace=True))
    llm = make_llm(tool_model, reasoning_parser="qwen3", async_scheduling=async_scheduling)
    try:
        text = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
        thinking, _, answer = text.partition("</think>")
        assert thinking == "<think>\nI should call get_weather.\n"
        jsonschema.validate(json.loads(answer.removesuffix("<|im_end|>")), SCHEMA)
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()
    llm = make_llm(tool_model, async_scheduling=async_scheduling)
    try:
        text = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
        jsonschema.validate(json.loads(text.removesuffix("<|im_end|>")), SCHEMA)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("in_process", ["0", "1"])
def test_a_step_prepared_ahead_with_the_reasoning_parser_gives_the_same_outputs(
        tool_model: Path, tokenizer, monkeypatch, in_process: str) -> None:
    """Under async scheduling with a reasoning parser the next step is prepared while the
    grammars finish the one before (their work moves the gates' phases, which are then not
    read): thinking and constrained answers, beside free requests and requests joining
    mid-run, are exactly those of the step prepared after that sampling."""
    from tests.distributed.test_equivalence import launches_ahead

    monkeypatch.setenv("OCTAVO_GRAMMAR_PROCESS", in_process)
    json_params = SamplingParams(temperature=0.0, max_tokens=100, skip_special_tokens=False,
                                 structured_outputs=StructuredOutputsParams(
                                     json=SCHEMA, disable_any_whitespace=True))
    free = SamplingParams(temperature=0.0, max_tokens=40, skip_special_tokens=False)
    cases = ["berlin", "paris", "sky", "berlin", "tokyo"]
    prompts = [render(tokenizer, CASES[name]) for name in cases]
    params = [json_params, json_params, free, json_params, free]

    def outputs(prepare_ahead: str) -> tuple[list[str], list[bool]]:
        monkeypatch.setenv("OCTAVO_PREPARE_AHEAD", prepare_ahead)
        # A small token budget: the prompts' chunks run beside the others' decodes, so
        # constrained requests start sampling at different steps.
        llm = make_llm(tool_model, reasoning_parser="qwen3", async_scheduling=True,
                       max_num_batched_tokens=48)
        try:
            ahead = launches_ahead(llm)
            texts = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
            assert_no_leaks(llm)
            return texts, ahead
        finally:
            llm.llm_engine.shutdown()

    texts, ahead = outputs("1")
    want, none_ahead = outputs("0")
    assert any(ahead) and not any(none_ahead)
    assert texts == want
    for text, case in zip(texts, cases):
        if case == "berlin":
            thinking, _, answer = text.partition("</think>")
            assert thinking == "<think>\nI should call get_weather.\n"
            jsonschema.validate(json.loads(answer.removesuffix("<|im_end|>")), SCHEMA)
