"""Scheduler features through ``/v1/completions``: ``use_beam_search`` (the offline
``LLM.beam_search``), ``best_of`` > n (the offline engine's), and ``priority`` (refused
unless the server runs ``--scheduling-policy priority``)."""

from __future__ import annotations

import openai
import pytest
from octavo.sampling_params import BeamSearchParams, SamplingParams

from tests.entrypoints.openai.conftest import SERVED_NAME

PROMPT = "Hello world! hello"


def test_use_beam_search_matches_offline(client, offline_llm) -> None:
    want = offline_llm.beam_search(PROMPT, BeamSearchParams(beam_width=3, max_tokens=8))[0]
    resp = client.completions.create(model=SERVED_NAME, prompt=PROMPT, n=3, max_tokens=8,
                                     temperature=0.0, extra_body={"use_beam_search": True})
    prompt_len = len(offline_llm.get_tokenizer()(PROMPT).input_ids)
    tokenizer = offline_llm.get_tokenizer()
    assert [c.text for c in resp.choices] == [
        tokenizer.decode(s.tokens[prompt_len:], skip_special_tokens=True) for s in want.sequences]
    assert [c.index for c in resp.choices] == [0, 1, 2]


def test_best_of_matches_offline(client, offline_llm) -> None:
    params = SamplingParams(n=2, best_of=4, temperature=1.0, seed=5, max_tokens=8,
                            ignore_eos=True)
    want = offline_llm.generate(PROMPT, params, use_tqdm=False)[0]
    resp = client.completions.create(model=SERVED_NAME, prompt=PROMPT, n=2, best_of=4,
                                     temperature=1.0, seed=5, max_tokens=8,
                                     extra_body={"ignore_eos": True})
    assert [c.text for c in resp.choices] == [c.text for c in want.outputs]
    assert [c.index for c in resp.choices] == [0, 1]


@pytest.mark.parametrize(("body", "param"), [
    ({"priority": 3}, "priority"),
    ({"use_beam_search": True, "logprobs": 2}, "logprobs"),
    ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
    ({"best_of": 1, "n": 2}, "best_of"),
])
def test_refused_with_the_field_named(client, body, param) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=4,
                                  extra_body=body)
    assert info.value.body["param"] == param
