"""Octavo's version; backends pin the core to exactly this."""

__version__ = "0.1.0"
