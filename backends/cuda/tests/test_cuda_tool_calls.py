"""Tool calling and reasoning output on an NVIDIA GPU (run through the device tool; skipped in CI).

The trained tiny tool model (``tests/helpers/tool_model.py``) on the CUDA backend: greedy
answers equal the ones it learned (so the parsers read the same calls as on the CPU), forced
tool choices (structured outputs, async scheduling) give calls that validate, and the server
answers with tool_calls and reasoning_content.
"""

from __future__ import annotations

import json
import os
import signal

import jsonschema
import pytest
import torch
from octavo import LLM, SamplingParams
from octavo.entrypoints.openai.protocol import ChatCompletionRequest
from octavo.entrypoints.openai.tool_calling import plan_tool_calls
from octavo.entrypoints.openai.tool_parsers import get_tool_parser

from tests.helpers.tool_model import CASES, TOOLS, _template_messages, make_tool_model

DEVICE = os.environ.get("OCTAVO_TEST_TOOL_DEVICE", "cuda")  # "cpu": a dry run of this file

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cuda" and (not torch.cuda.is_available()
                              or getattr(torch.version, "hip", None) is not None),
        reason="needs an NVIDIA GPU and a CUDA build of torch",
    ),
]

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    # Head size 64: the smallest the Triton attention kernels take.
    return make_tool_model(tmp_path_factory.mktemp("tool-model"), hidden_size=256,
                           intermediate_size=512)


@pytest.fixture(scope="module")
def llm(tool_model):
    engine = LLM(str(tool_model), device=DEVICE, dtype="float32", num_gpu_blocks_override=256)
    yield engine
    engine.llm_engine.shutdown()


def test_learned_answers_and_their_calls(llm):
    params = SamplingParams(temperature=0.0, max_tokens=80)
    hermes = get_tool_parser("hermes")
    for name in ("paris", "tokyo", "berlin", "hello"):
        case = CASES[name]
        out = llm.chat(_template_messages(case.messages), params, tools=case.tools,
                       use_tqdm=False)[0].outputs[0]
        assert out.text == case.answer, name
    calls = hermes.extract(CASES["tokyo"].answer).tool_calls
    assert [c.name for c in calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_forced_choices_validate(llm, choice):
    messages = [{"role": "user", "content": "Say hello."}]
    request = ChatCompletionRequest(model="m", messages=messages, tools=TOOLS, tool_choice=choice)
    plan = plan_tool_calls(request, None, False)
    params = plan.constrain(SamplingParams(temperature=0.0, max_tokens=120))
    outs = llm.chat([messages] * 8, params, tools=plan.tools, use_tqdm=False)
    for out in outs:
        extracted = plan.parser_cls.extract(out.outputs[0].text)
        assert extracted.tool_calls, out.outputs[0].text
        for call in extracted.tool_calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_forced_choice_starts_after_the_thinking(tool_model):
    """With the qwen3 reasoning parser (async scheduling on CUDA), the model's learned
    thinking comes out unchanged and the required call after it validates."""
    request = ChatCompletionRequest(model="m", messages=CASES["berlin"].messages, tools=TOOLS,
                                    tool_choice="required")
    plan = plan_tool_calls(request, None, False)
    params = plan.constrain(SamplingParams(temperature=0.0, max_tokens=120))
    engine = LLM(str(tool_model), device=DEVICE, dtype="float32", num_gpu_blocks_override=256,
                 reasoning_parser="qwen3")
    try:
        outs = engine.chat([_template_messages(CASES["berlin"].messages)] * 4, params,
                           tools=plan.tools, use_tqdm=False)
    finally:
        engine.llm_engine.shutdown()
    for out in outs:
        thinking, _, answer = out.outputs[0].text.partition("</think>")
        assert thinking == "<think>\nI should call get_weather.\n", out.outputs[0].text
        extracted = plan.parser_cls.extract(answer)
        assert extracted.tool_calls, answer
        for call in extracted.tool_calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_server_tool_calls_and_reasoning(tool_model):
    import openai

    from tests.entrypoints.openai.conftest import API_KEY, SERVED_NAME, ServerProcess

    srv = ServerProcess(tool_model, "--device", DEVICE, "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    try:
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0) as c:
            resp = c.chat.completions.create(model=SERVED_NAME, messages=CASES["berlin"].messages,
                                             tools=TOOLS, temperature=0.0, max_tokens=80)
            message = resp.choices[0].message
            assert message.reasoning_content == "I should call get_weather."
            assert [(t.function.name, json.loads(t.function.arguments))
                    for t in message.tool_calls] == [
                        ("get_weather", {"city": "Berlin", "unit": "celsius"})]
            assert resp.choices[0].finish_reason == "tool_calls"
    finally:
        assert srv.stop(signal.SIGINT) == 0
