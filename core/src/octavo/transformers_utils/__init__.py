"""Loading what ``transformers`` provides for a model besides its weights (the tokenizer)."""
