"""Fixtures for the out-of-tree plugins in ``plugins/`` (installed separately, found by entry point).

Every plugin test needs its plugin *installed* (``pip install --no-deps -e plugins/NAME``, as the
Makefile's install-dev target does): ``installed_plugin`` fails, never skips, when it is not.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import octavo.plugins
import pytest
import torch
from octavo.plugins import ENTRY_POINT_GROUP

from tests.helpers.tiny import VOCAB_SIZE, train_tokenizer


def installed_entry_point(name: str, distribution: str) -> importlib.metadata.EntryPoint:
    """The entry point ``name`` of group ``octavo``; fails with the install line when absent."""
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep
    folder = distribution.removeprefix("octavo-plugin-")
    pytest.fail(f"{distribution} is not installed: pip install --no-deps -e plugins/{folder}")


@pytest.fixture
def fresh_plugin_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the engine build a new process-wide plugin manager, so ``OCTAVO_PLUGINS`` /
    ``OCTAVO_DISABLE_PLUGINS`` set by the test are read; the old manager comes back afterwards."""
    monkeypatch.setattr(octavo.plugins, "_default_pm", None)


def make_tiny_gpt2(folder: Path, seed: int = 0) -> Path:
    """A random-weight GPT-2 (n_embd 64, 2 layers, 4 heads) plus the tiny tokenizer in ``folder``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB_SIZE, n_embd=64, n_layer=2, n_head=4, n_positions=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    model = GPT2LMHeadModel(config)
    # Larger-than-init weights spread the logits out, so greedy ties are unlikely.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".ln_" not in name:
                param.normal_(0.0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    train_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the tiny GPT-2 checkpoint, made once per session."""
    return make_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2") / "model")
