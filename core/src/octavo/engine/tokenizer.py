"""The front end's tokenizer helpers (defined in ``octavo.transformers_utils.tokenizer``, which
the engine core also uses for structured outputs)."""

from octavo.transformers_utils.tokenizer import eos_token_ids, load_tokenizer

__all__ = ["eos_token_ids", "load_tokenizer"]
