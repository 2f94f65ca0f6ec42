"""Octavo's CPU backend: torch paged attention, KV sizing from host memory, CPU worker."""
