"""``octavo.structured_output.grammar``: constraints validated in the front end, with the
parser's own message and ``param`` naming the field."""

from __future__ import annotations

import jsonschema
import pytest

from octavo.errors import InvalidRequestError
from octavo.sampling_params import MAX_STRUCTURED_OUTPUT_CHARS, StructuredOutputsParams
from octavo.structured_output.grammar import grammar_text, validate
from octavo.testing.json_schemas import SCHEMA_CASES


@pytest.mark.parametrize("case", SCHEMA_CASES, ids=[c.name for c in SCHEMA_CASES])
def test_every_shared_schema_compiles_and_its_instance_is_valid(case) -> None:
    jsonschema.validate(case.instance, case.schema)
    validate(StructuredOutputsParams(json=case.schema))


@pytest.mark.parametrize(
    ("params", "param", "says"),
    [
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "strin"}}}),
         "structured_outputs.json", "strin"),
        (StructuredOutputsParams(json={"type": "object", "properties": 3}),
         "structured_outputs.json", "properties"),
        (StructuredOutputsParams(json="{not json"), "structured_outputs.json", "not valid JSON"),
        (StructuredOutputsParams(json="[1, 2]"), "structured_outputs.json", "JSON schema"),
        (StructuredOutputsParams(regex="(unclosed"), "structured_outputs.regex", "unclosed"),
        (StructuredOutputsParams(grammar='root ::= "a" | missing'), "structured_outputs.grammar",
         "missing"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar",
         "undefined_rule"),
    ],
)
def test_a_constraint_that_does_not_compile_names_its_field(params, param, says) -> None:
    with pytest.raises(InvalidRequestError) as info:
        validate(params)
    assert info.value.param == param
    assert says in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputsParams(regex=r"\d{3}-\d{4}"),
        StructuredOutputsParams(choice=["yes", "no", "it depends"]),
        StructuredOutputsParams(grammar='root ::= "yes" | "no"'),  # GBNF
        StructuredOutputsParams(grammar='start: "yes" | "no"'),  # Lark
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(json='{"type": "string", "enum": ["a", "b"]}'),
    ],
)
def test_valid_constraints_compile(params) -> None:
    validate(params)
    assert grammar_text(params)


def test_the_constraint_is_exactly_one_kind_and_bounded() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError, match="non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutputsParams(regex="a" * (MAX_STRUCTURED_OUTPUT_CHARS + 1))
    assert info.value.param == "structured_outputs.regex"


def test_equal_schemas_share_one_key_whatever_their_key_order() -> None:
    a = StructuredOutputsParams(json={"type": "object", "required": ["x"],
                                      "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputsParams(json={"properties": {"x": {"type": "integer"}},
                                      "type": "object", "required": ["x"]})
    assert a.key() == b.key()
