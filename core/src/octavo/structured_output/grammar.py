"""From ``StructuredOutputsParams`` to a grammar the engine compiles, and its validation.

The grammar engine is llguidance (chosen over xgrammar by measurement on the default model's
tokenizer; docs/benchmarks.md, "Grammar engines"): a constraint becomes an llguidance grammar
text here, which ``octavo.structured_output.manager`` compiles against the tokenizer in the
engine core. ``validate`` runs in the front end on every request before it is queued, without
a tokenizer, so a schema, regex or grammar that does not compile is a 400 with the parser's own
message, and never reaches the engine.
"""

from __future__ import annotations

import functools
import json

from octavo.errors import InvalidRequestError
from octavo.sampling_params import StructuredOutputsParams

# llguidance's own limits, tightened where a request could make compilation slow: a
# grammar of at most this many symbols (the default is far larger).
_MAX_GRAMMAR_SIZE = 500_000


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``params`` (raises ``InvalidRequestError`` when the constraint
    cannot be turned into one; a grammar that converts but does not compile is caught by
    ``validate``)."""
    kind, text = params.key()
    return _grammar_text(kind, text, params.disable_any_whitespace)


@functools.lru_cache(maxsize=512)
def _grammar_text(kind: str, text: str, disable_any_whitespace: bool) -> str:
    import llguidance

    matcher = llguidance.LLMatcher
    param = f"structured_outputs.{kind}"
    try:
        if kind in ("json", "json_object"):
            schema = text if kind == "json" else '{"type": "object"}'
            # Whitespace is free between JSON tokens unless the request turns it off, or the
            # schema does through llguidance's own "x-guidance" options.
            options = {"whitespace_flexible": False} if disable_any_whitespace else None
            return matcher.grammar_from_json_schema(schema, overrides=options)
        if kind == "regex":
            return matcher.grammar_from_regex(text)
        if kind == "choice":
            return llguidance.grammar_from("choice", text)
        # "grammar": Lark, or GBNF (llama.cpp's EBNF dialect, the one vLLM users write).
        return llguidance.grammar_from("grammar", text)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"{param} is invalid: {_first_line(exc)}", param=param) from None


def validate(params: StructuredOutputsParams) -> None:
    """Raise ``InvalidRequestError`` (``param`` naming the field) when the constraint does not
    compile; its message is the parser's, e.g. ``regex parse error: unclosed group``."""
    kind, text = params.key()
    if kind == "json":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(
                f"structured_outputs.json is not valid JSON: {exc}",
                param="structured_outputs.json") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(
                "structured_outputs.json must be a JSON schema (an object), got "
                f"{type(schema).__name__}", param="structured_outputs.json")
    message = _check(kind, text, params.disable_any_whitespace)
    if message:
        raise InvalidRequestError(f"structured_outputs.{kind} is invalid: {message}",
                                  param=f"structured_outputs.{kind}")


@functools.lru_cache(maxsize=512)
def _check(kind: str, text: str, disable_any_whitespace: bool) -> str:
    """The compiler's error for this constraint ('' when it compiles)."""
    import llguidance

    grammar = _grammar_text(kind, text, disable_any_whitespace)
    limits = llguidance.LLParserLimits(max_grammar_size=_MAX_GRAMMAR_SIZE)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, None, limits=limits)
    if not is_error:
        return ""
    return _first_lines(messages[0] if messages else "the grammar does not compile")


def parser_limits():  # -> llguidance.LLParserLimits
    import llguidance

    return llguidance.LLParserLimits(max_grammar_size=_MAX_GRAMMAR_SIZE)


def _first_line(exc: BaseException) -> str:
    return _first_lines(str(exc))


def _first_lines(message: str, max_chars: int = 400) -> str:
    """The parser's message on one line (llguidance adds a caret diagram below it)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    text = " ".join(line for line in lines if set(line) - {"^", " "})
    return text[:max_chars]
