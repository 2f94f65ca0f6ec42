"""A backend plugin with tight, declared limits, for capability-negotiation tests.

``restricted`` runs on the host with the core's plain-torch reference attention and the base
``Worker``, and declares in ``BackendCapabilities`` what a small accelerator might: float32
only, the tiny models' head size, 16-token blocks, at most 8 sequences per step and 128 tokens
per sequence, no prompt logprobs, at most 2 top logprobs. Tests register this module on a
plugin manager in process, or expose it to a subprocess (``octavo serve``) through a real entry
point: ``write_entry_point(folder)`` writes a ``*.dist-info`` into ``folder``, which then goes
on ``PYTHONPATH``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from octavo.backends.backend import Availability, Backend, BackendCapabilities
from octavo.hookspecs import hookimpl

from tests.helpers.entry_points import write_dist_info

BACKEND_NAME = "restricted"
# The tiny test models' head size (hidden_size 64 / 4 heads; tests/helpers/tiny.py).
TINY_HEAD_DIM = 16
CAPABILITIES = BackendCapabilities(
    dtypes=("float32",),
    head_dims=(TINY_HEAD_DIM, 64),
    block_sizes=(16,),
    cuda_graphs=False,
    max_num_seqs=8,
    max_model_len=128,
    prompt_logprobs=False,
    max_logprobs=2,
)
REASON = "restricted test backend emulated on the host"


@hookimpl
def octavo_register_backends(register: Callable[[Backend], None]) -> None:
    register(Backend(
        name=BACKEND_NAME,
        device_type="cpu",
        priority=-10,  # never the default: tests name it with --device / device=
        is_available=lambda: Availability(True, REASON),
        package="octavo-test-restricted",
        capabilities=CAPABILITIES,
        description="test backend with tight declared limits",
    ))


@hookimpl
def octavo_attention_backend(backend, model_config, cache_config):
    if backend != BACKEND_NAME:
        return None
    from octavo.attention.reference import ReferenceAttentionBackend

    return ReferenceAttentionBackend()


@hookimpl
def octavo_available_kv_cache_memory(backend, worker, cache_config):
    if backend != BACKEND_NAME:
        return None
    return cache_config.kv_cache_memory_bytes or 8 * 2**20


@hookimpl
def octavo_worker_class(backend, parallel_config):
    if backend != BACKEND_NAME:
        return None
    from octavo.worker.worker import Worker

    return Worker  # the base class runs on torch.device("cpu")


def write_entry_point(folder: Path) -> Path:
    """Make this module an installed ``octavo`` plugin for processes with ``folder`` on
    ``PYTHONPATH`` (importlib.metadata finds the dist-info there); returns ``folder``."""
    return write_dist_info(folder, "octavo-test-restricted", {BACKEND_NAME: __name__})
