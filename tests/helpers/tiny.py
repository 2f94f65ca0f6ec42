"""Tiny random-weight models for the tests: a re-export of ``octavo.testing.tiny_models``.

The builder ships with the core so the backend conformance suite can use it; the tests keep
importing it from here.
"""

from __future__ import annotations

from octavo.testing.tiny_models import (  # noqa: F401  (re-exported)
    ARCHITECTURES,
    VOCAB_SIZE,
    make_tiny_model,
    tiny_config,
    train_tokenizer,
    write_generation_config,
)

# The name older tests use for ``tiny_config``.
_config = tiny_config
