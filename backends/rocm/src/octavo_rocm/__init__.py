"""Octavo's ROCm backend (AMD GPUs through HIP)."""
