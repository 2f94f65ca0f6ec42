"""Iteration-level scheduling: which requests run how many tokens in the next step."""
