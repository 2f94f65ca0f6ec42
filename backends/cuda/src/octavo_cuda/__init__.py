"""Octavo's CUDA backend (NVIDIA GPUs)."""
