"""Errors about a user's request, typed so every front end reports them the same way.

``InvalidRequestError`` is what the one request validator (``octavo.engine.processor``) and
``SamplingParams`` raise for bad input. It carries the name of the offending field (``param``,
the engine's name, e.g. ``"top_p"``, ``"prompt"``, ``"max_tokens"``) and a machine-readable
``code``; the OpenAI server turns it into a 400 error object without parsing the message, and
``LLM.generate`` lets it through as the ``ValueError`` it is.

A leaf module: it imports nothing from Octavo, so every layer can raise these.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request (prompt or sampling settings) that the engine will not run.

    :param message: what is wrong and, where there is one, what to do instead.
    :param param: the engine-side field at fault (``None``: the request as a whole).
    :param code: a stable identifier for the kind of problem (OpenAI's ``error.code``).
    """

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestTypeError(InvalidRequestError, TypeError):
    """An ``InvalidRequestError`` about a value of the wrong type (also a ``TypeError``)."""


# ``code`` values used across the engine, in one place.
CODE_INVALID_VALUE = "invalid_value"
CODE_EMPTY_PROMPT = "empty_prompt"
CODE_CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
CODE_KV_CACHE_TOO_SMALL = "kv_cache_too_small"
CODE_UNSUPPORTED_BY_BACKEND = "unsupported_by_backend"
CODE_TOO_MANY = "too_many"
CODE_INVALID_TEXT = "invalid_text"
