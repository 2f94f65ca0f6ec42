"""Benchmark helpers shared by `octavo bench` (peers to compare against)."""
