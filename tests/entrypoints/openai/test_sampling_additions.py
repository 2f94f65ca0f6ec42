"""vLLM's sampling extensions through the server (``bad_words``, ``allowed_token_ids``,
``truncate_prompt_tokens``, ``logits_processors``): the same output as the offline engine."""

from __future__ import annotations

import openai
import pytest
from octavo.sampling_params import SamplingParams

from tests.entrypoints.openai.conftest import SERVED_NAME

PROMPT = "Hello world! hello"

FIELDS = [
    {"allowed_token_ids": [20, 21, 30, 40, 50]},
    {"bad_words": ["hello", "world"]},
    {"truncate_prompt_tokens": 3},
    {"logits_processors": [{"qualname": "no_repeat_ngram", "kwargs": {"ngram_size": 2}}]},
]


@pytest.mark.parametrize("fields", FIELDS, ids=lambda f: next(iter(f)))
def test_completions_and_chat_match_offline(client, offline_llm, fields) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, **fields)
    expected = offline_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    resp = client.completions.create(model=SERVED_NAME, prompt=PROMPT, temperature=0.0,
                                     max_tokens=10, extra_body={"ignore_eos": True, **fields})
    assert resp.choices[0].text == expected.text
    messages = [{"role": "user", "content": PROMPT}]
    chat_expected = offline_llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    chat = client.chat.completions.create(model=SERVED_NAME, messages=messages, temperature=0.0,
                                          max_tokens=10, extra_body={"ignore_eos": True, **fields})
    assert chat.choices[0].message.content == chat_expected.text


@pytest.mark.parametrize(("fields", "param"), [
    ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ({"logits_processors": ["nope"]}, "logits_processors"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_bad_values_are_a_400_naming_the_field(client, fields, param) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=2,
                                  extra_body=fields)
    assert info.value.body["param"] == param
