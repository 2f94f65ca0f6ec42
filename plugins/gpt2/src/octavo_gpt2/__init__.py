"""Octavo model plugin: GPT-2. The hooks are in ``octavo_gpt2.plugin``, the model in ``octavo_gpt2.model``."""
