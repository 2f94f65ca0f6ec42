"""A pytest plugin for runs of the conformance kit with the FlexAttention plugin switched on.

Loaded with ``-p tests.plugins.flex_call_counter`` into the kit's own pytest process (see
``test_flex_attention.py``): it counts ``FlexAttentionImpl.forward`` calls and prints
``flex-attention forward calls: N`` in the terminal summary, so the caller can tell the kit
really ran the plugin's kernels and not the cpu backend's.
"""

from __future__ import annotations

import pytest

_num_calls = 0


def pytest_configure(config: pytest.Config) -> None:
    from octavo_flex_attention.attention import FlexAttentionImpl

    original = FlexAttentionImpl.forward

    def counting_forward(self, *args, **kwargs):
        global _num_calls
        _num_calls += 1
        return original(self, *args, **kwargs)

    FlexAttentionImpl.forward = counting_forward


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(f"flex-attention forward calls: {_num_calls}")
