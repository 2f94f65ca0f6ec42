"""Executors run a model's workers for the engine core (see ``octavo.executor.base``).

``uniproc``: one worker in the engine core's own process.
"""

from octavo.executor.base import Executor, PendingOutput
from octavo.executor.uniproc import UniprocExecutor

__all__ = ["Executor", "PendingOutput", "UniprocExecutor"]
