"""Structured outputs through the server: ``response_format``, ``structured_outputs`` and the
older ``guided_*`` fields, with the official ``openai`` client.

The shared server runs with async scheduling, so a constrained row there samples after its
grammar has seen the previous token (deferred sampling); the offline engine runs one step at a
time. Greedy outputs must be identical, and every output must satisfy its constraint.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from octavo.sampling_params import (
    MAX_STRUCTURED_OUTPUT_CHARS,
    SamplingParams,
    StructuredOutputsParams,
)
from octavo.testing.json_schemas import SCHEMA_CASES, bounded, without_whitespace

from tests.entrypoints.openai.conftest import SERVED_NAME, wait_idle
from tests.entrypoints.openai.test_errors import assert_error, completion

PROMPT = "The answer is"
MESSAGES = [{"role": "user", "content": "Describe an item as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["a", "bb"]},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "kind", "ok"],
    "additionalProperties": False,
    # No whitespace between JSON tokens (llguidance's schema option; a random model would
    # otherwise fill max_tokens with spaces, as real models sometimes do).
    "x-guidance": {"whitespace_flexible": False},
}
REGEX = r"[a-z]{2,4}-\d{3}"
CHOICES = ["Paris", "Tokyo", "neither of them"]
GRAMMAR = 'root ::= "(" term ("+" term)? ")"\nterm ::= [0-9]'
MAX_TOKENS = 48

# kind -> (the request's structured_outputs field, the engine's params, a check of the text)
CONSTRAINTS = {
    "json": (
        {"json": SCHEMA, "disable_any_whitespace": True},
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        lambda text: jsonschema.validate(json.loads(text), SCHEMA),
    ),
    "regex": (
        {"regex": REGEX},
        StructuredOutputsParams(regex=REGEX),
        lambda text: re.fullmatch(REGEX, text) or pytest.fail(text),
    ),
    "choice": (
        {"choice": CHOICES},
        StructuredOutputsParams(choice=CHOICES),
        lambda text: text in CHOICES or pytest.fail(text),
    ),
    "grammar": (
        {"grammar": GRAMMAR},
        StructuredOutputsParams(grammar=GRAMMAR),
        lambda text: re.fullmatch(r"\([0-9](\+[0-9])?\)", text) or pytest.fail(text),
    ),
}


def offline_params(structured: StructuredOutputsParams) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=structured)


@pytest.fixture(autouse=True)
def nothing_left(server):
    """After every test: no request left running and every KV block free."""
    yield
    m = wait_idle(server)
    assert m["octavo:kv_cache_usage_perc"] == 0 and m["octavo:num_requests_running"] == 0


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_completions_match_offline_and_satisfy(client, offline_llm, kind: str) -> None:
    field, structured, check = CONSTRAINTS[kind]
    expected = offline_llm.generate(PROMPT, offline_params(structured), use_tqdm=False)[0].outputs[
        0
    ]
    resp = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPT,
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        extra_body={"structured_outputs": field},
    )
    text = resp.choices[0].text
    check(text)
    assert text == expected.text
    assert resp.choices[0].finish_reason == "stop"
    # The older vLLM field name gives the same request.
    legacy = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPT,
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        extra_body={f"guided_{kind}": next(iter(field.values()))},
    )
    assert legacy.choices[0].text == text


def test_chat_response_format_json_schema_stream_and_not(client, offline_llm) -> None:
    expected = (
        offline_llm.chat(
            MESSAGES, offline_params(StructuredOutputsParams(json=SCHEMA)), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "item", "schema": SCHEMA, "strict": True},
    }
    resp = client.chat.completions.create(
        model=SERVED_NAME,
        messages=MESSAGES,
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        response_format=response_format,
    )
    content = resp.choices[0].message.content
    jsonschema.validate(json.loads(content), SCHEMA)
    assert content == expected
    stream = client.chat.completions.create(
        model=SERVED_NAME,
        messages=MESSAGES,
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        response_format=response_format,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == content


def test_every_shared_schema_through_response_format(server) -> None:
    # The twelve schemas applications send (nested objects, arrays, enums, bounded numbers,
    # anyOf, optional fields, $defs, patterns), made finite for random weights, all in flight
    # at once; each output parses and validates against the original schema.
    import asyncio

    async def one(c: httpx.AsyncClient, schema: dict) -> str:
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": "case", "schema": without_whitespace(bounded(schema))},
        }
        body = {
            "model": SERVED_NAME,
            "messages": MESSAGES,
            "temperature": 0.0,
            "max_tokens": 400,
            "response_format": response_format,
        }
        resp = await c.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        return choice["message"]["content"]

    async def run() -> list[str]:
        async with httpx.AsyncClient(
            base_url=server.url, headers=server.headers(), timeout=300
        ) as c:
            return await asyncio.gather(*(one(c, case.schema) for case in SCHEMA_CASES))

    assert len(SCHEMA_CASES) >= 10
    for case, content in zip(SCHEMA_CASES, asyncio.run(run())):
        jsonschema.validate(json.loads(content), case.schema)


def test_sampled_n_all_satisfy(client) -> None:
    resp = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPT,
        n=4,
        temperature=1.0,
        seed=3,
        max_tokens=MAX_TOKENS,
        extra_body={"structured_outputs": {"regex": REGEX}},
    )
    assert len(resp.choices) == 4
    for choice in resp.choices:
        assert re.fullmatch(REGEX, choice.text), choice.text


def test_json_object_is_an_object(client, offline_llm) -> None:
    # A random model would ramble inside the object (whitespace is free between JSON tokens);
    # a bias towards '"', ':' and '}' makes it close every string and the object as soon as
    # the grammar allows. The bias is applied on top of the mask, so a biased token is never
    # picked where the grammar forbids it: the output is exactly {"":""}.
    tokenizer = offline_llm.get_tokenizer()
    bias = {str(tokenizer.convert_tokens_to_ids(t)): 100 for t in ('"', ":", "}")}
    resp = client.chat.completions.create(
        model=SERVED_NAME,
        messages=MESSAGES,
        temperature=0.0,
        max_tokens=64,
        response_format={"type": "json_object"},
        logit_bias=bias,
    )
    assert resp.choices[0].finish_reason == "stop"
    assert json.loads(resp.choices[0].message.content) == {"": ""}


def test_response_format_text_is_unconstrained(client, offline_llm) -> None:
    expected = (
        offline_llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    resp = client.chat.completions.create(
        model=SERVED_NAME,
        messages=MESSAGES,
        temperature=0.0,
        max_tokens=8,
        response_format={"type": "text"},
    )
    assert resp.choices[0].message.content == expected


def chat(**fields):
    return {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 4, **fields}


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/completions",
            completion(structured_outputs={"regex": "(unclosed"}),
            "structured_outputs.regex",
        ),
        (
            "/v1/completions",
            completion(structured_outputs={"json": {"type": "frobnicate"}}),
            "structured_outputs.json",
        ),
        (
            "/v1/completions",
            completion(structured_outputs={"json": "{not json"}),
            "structured_outputs.json",
        ),
        (
            "/v1/completions",
            completion(structured_outputs={"grammar": "root ::= undefined_rule"}),
            "structured_outputs.grammar",
        ),
        (
            "/v1/completions",
            completion(structured_outputs={"choice": []}),
            "structured_outputs.choice",
        ),
        (
            "/v1/completions",
            completion(structured_outputs={"regex": "a", "choice": ["b"]}),
            "structured_outputs",
        ),
        ("/v1/completions", completion(structured_outputs={}), "structured_outputs"),
        (
            "/v1/completions",
            completion(structured_outputs={"regex": "a" * (MAX_STRUCTURED_OUTPUT_CHARS + 1)}),
            "structured_outputs.regex",
        ),
        (
            "/v1/completions",
            completion(structured_outputs={"regex": "a"}, guided_regex="b"),
            "guided_regex",
        ),
        ("/v1/completions", completion(guided_json={"type": "frobnicate"}), "guided_json"),
        (
            "/v1/completions",
            completion(structured_outputs={"regex": "a", "frobnicate": 1}),
            "structured_outputs.frobnicate",
        ),
        (
            "/v1/chat/completions",
            chat(response_format={"type": "json_schema"}),
            "response_format.json_schema",
        ),
        (
            "/v1/chat/completions",
            chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 3}},
                }
            ),
            "response_format.json_schema.schema",
        ),
        ("/v1/chat/completions", chat(response_format={"type": "yaml"}), "response_format.type"),
        (
            "/v1/chat/completions",
            chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
            "structured_outputs",
        ),
    ],
)
def test_bad_constraints_are_400_and_the_server_goes_on(http, path, body, param) -> None:
    assert_error(http.post(path, json=body), 400, param=param)
    resp = http.post(
        "/v1/completions", json=completion(structured_outputs={"choice": ["yes", "no"]})
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] in ("yes", "no")


def test_many_distinct_grammars_at_once(server) -> None:
    # Thirty different regexes in flight: each compiles once, none waits on another's result.
    import asyncio

    async def one(c: httpx.AsyncClient, i: int) -> str:
        body = completion(
            max_tokens=16, temperature=0.0, structured_outputs={"regex": rf"item{i}-[a-c]{{1,3}}"}
        )
        resp = await c.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        text = resp.json()["choices"][0]["text"]
        assert re.fullmatch(rf"item{i}-[a-c]{{1,3}}", text), text
        return text

    async def run() -> list[str]:
        async with httpx.AsyncClient(
            base_url=server.url, headers=server.headers(), timeout=120
        ) as c:
            return await asyncio.gather(*(one(c, i) for i in range(30)))

    assert len(asyncio.run(run())) == 30
