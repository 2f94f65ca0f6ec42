"""Attention interface between the device-agnostic models and a backend's kernels."""

from octavo.attention.base import AttentionBackend, AttentionImpl, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionImpl", "AttentionMetadata"]
