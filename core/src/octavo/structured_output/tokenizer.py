"""``GrammarTokenizer``: the tokenizer grammars compile against, as plain data.

What the grammar side reads of the model's tokenizer is small: llguidance builds its token
trie from the ``tokenizers`` JSON (the Rust tokenizer that a ``transformers`` fast tokenizer
wraps, added tokens included) and the EOS ids; the reasoning gate encodes its tags and decodes
a request's last tokens. None of it needs ``transformers``, whose import alone costs seconds
(it imports torch). So the engine core loads the ``transformers`` tokenizer once, as everywhere
else (a model folder, ``--tokenizer``, or GGUF metadata: ``load_grammar_tokenizer``), and the
grammars get this: a ``msgspec.Struct`` that the grammar process
(``octavo.structured_output.process``) receives in a message, and that rebuilds the tokenizer
there from ``tokenizers`` alone.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import msgspec


class GrammarTokenizer(msgspec.Struct, frozen=True):
    """The model's tokenizer as grammars use it (see the module docstring)."""

    # The ``tokenizers`` JSON of the fast tokenizer (padding and truncation off).
    tokenizer_json: str
    # Every id that ends generation: each grammar's end may be any of them.
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_transformers(cls, tokenizer: Any, eos_token_ids: set[int]) -> GrammarTokenizer:
        """From a ``transformers`` fast tokenizer; ``ValueError`` for a slow one (llguidance
        reads the Rust tokenizer)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"structured outputs need a fast tokenizer (a tokenizer.json); "
                             f"this model's is a {type(tokenizer).__name__}")
        backend = copy.copy(backend)  # the model's own keeps its settings
        backend.no_padding()
        backend.no_truncation()
        return cls(backend.to_str(), tuple(sorted(eos_token_ids)))

    def llguidance_tokenizer(self, vocab_size: int) -> Any:
        """The llguidance tokenizer for logits ``vocab_size`` wide (which may exceed the
        tokenizer's vocabulary); about a second for a 150k-token vocabulary."""
        import llguidance

        return llguidance.LLTokenizer(self.tokenizer_json, n_vocab=vocab_size,
                                      eos_token=list(self.eos_token_ids) or None)

    def text_codec(self) -> TokenizerCodec:
        """``encode``/``decode`` on this tokenizer, for the reasoning gate."""
        return TokenizerCodec(self.tokenizer_json)


class TokenizerCodec:
    """The two calls the reasoning parsers make of a tokenizer, ``encode`` (to a list of ids)
    and ``decode``, made on the ``tokenizers`` tokenizer itself, as a ``transformers`` fast
    tokenizer makes them (its decode's optional clean-up of spaces before punctuation aside,
    which no think tag has)."""

    def __init__(self, tokenizer_json: str) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_str(tokenizer_json)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def load_grammar_tokenizer(model_config: Any) -> GrammarTokenizer:
    """The model's tokenizer (``octavo.transformers_utils.tokenizer``: a folder,
    ``--tokenizer`` or GGUF metadata) and its EOS ids, for grammars."""
    from octavo.transformers_utils.tokenizer import eos_token_ids, load_tokenizer

    tokenizer = load_tokenizer(model_config)
    return GrammarTokenizer.from_transformers(tokenizer, eos_token_ids(model_config, tokenizer))

