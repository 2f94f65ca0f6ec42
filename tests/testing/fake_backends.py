"""Backends that exist only to test the conformance kit itself.

Both reuse the CPU backend's worker and KV-cache sizing under another name:

- ``cpu16``: the CPU kernels, declaring only ``bfloat16``, so the suite takes its 16-bit path
  (tolerances instead of exact greedy ids);
- ``prefix-blind``: a kernel with a realistic bug: a prefill chunk that follows a cached
  prefix attends only to its own tokens. Fresh prompts and decodes are right.

A conformance run reaches them in its own process as installed plugins:
``write_entry_points(folder)`` writes a ``*.dist-info`` into ``folder``, which then goes on
``PYTHONPATH`` together with the repository root.
"""

from __future__ import annotations

from pathlib import Path

import torch.nn.functional as F
from octavo.attention.reference import gather_context
from octavo.backends.backend import Availability, Backend, BackendCapabilities
from octavo.hookspecs import hookimpl
from octavo_cpu.attention import CPUAttentionBackend, CPUAttentionImpl

from tests.helpers.entry_points import write_dist_info


class PrefixBlindImpl(CPUAttentionImpl):
    def _prefill(self, query, kv_cache, metadata, row, out):
        start, end = metadata.query_start_loc_cpu[row], metadata.query_start_loc_cpu[row + 1]
        keys, values = gather_context(kv_cache, metadata.block_tables[row],
                                      metadata.seq_lens_cpu[row])
        # The bug: the cached prefix (everything before this chunk) is dropped.
        keys, values = keys[-(end - start):], values[-(end - start):]
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, query_len, dim]
        k = keys.transpose(0, 1).unsqueeze(0).to(q.dtype)
        v = values.transpose(0, 1).unsqueeze(0).to(q.dtype)
        result = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                enable_gqa=self.num_heads != self.num_kv_heads)
        out[start:end] = result.squeeze(0).transpose(0, 1)


class PrefixBlindBackend(CPUAttentionBackend):
    name = "prefix-blind"

    def make_impl(self, num_heads, num_kv_heads, head_dim, scale):
        return PrefixBlindImpl(num_heads, num_kv_heads, head_dim, scale)


class CPUBackendUnderAnotherName:
    """Hook implementations: the CPU backend's pieces as backend ``name``."""

    def __init__(self, name: str, dtypes: tuple[str, ...], attention: type) -> None:
        self.name = name
        self.dtypes = dtypes
        self.attention = attention

    @hookimpl
    def octavo_register_backends(self, register):
        register(Backend(
            name=self.name, device_type="cpu", priority=-100,
            is_available=lambda: Availability(True, "conformance-kit test backend"),
            package="octavo-test-fake-backends",
            capabilities=BackendCapabilities(dtypes=self.dtypes, block_sizes=None),
        ))

    @hookimpl
    def octavo_attention_backend(self, backend, model_config, cache_config):
        return self.attention() if backend == self.name else None

    @hookimpl
    def octavo_available_kv_cache_memory(self, backend, worker, cache_config):
        if backend != self.name:
            return None
        from octavo_cpu.memory import available_kv_cache_memory

        return available_kv_cache_memory(worker, cache_config)

    @hookimpl
    def octavo_worker_class(self, backend, parallel_config):
        if backend != self.name:
            return None
        from octavo_cpu.worker import CPUWorker

        return CPUWorker


CPU16 = CPUBackendUnderAnotherName("cpu16", ("bfloat16",), CPUAttentionBackend)
PREFIX_BLIND = CPUBackendUnderAnotherName("prefix-blind", ("float32",), PrefixBlindBackend)


def write_entry_points(folder: Path) -> Path:
    """Make ``CPU16`` and ``PREFIX_BLIND`` installed ``octavo`` plugins for processes with
    ``folder`` and the repository root on ``PYTHONPATH``; returns ``folder``."""
    return write_dist_info(folder, "octavo-test-fake-backends",
                           {"cpu16": f"{__name__}:CPU16",
                            "prefix-blind": f"{__name__}:PREFIX_BLIND"})
