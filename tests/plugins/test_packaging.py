"""The out-of-tree plugins of ``plugins/`` are packaged like third-party ones.

Each is its own setuptools distribution with an exact pin on the core, announced only by an
entry point in group ``octavo``, installed (the Makefile's install-dev target), and cheap to
discover: loading the entry point imports none of its heavy modules.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from octavo.version import __version__

from tests.plugins.conftest import installed_entry_point

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"

# folder -> (distribution, entry-point name, plugin module, modules discovery must not import)
OURS = {
    "gpt2": ("octavo-plugin-gpt2", "gpt2", "octavo_gpt2.plugin", ["octavo_gpt2.model"]),
    "flex-attention": (
        "octavo-plugin-flex-attention", "flex-attention", "octavo_flex_attention.plugin",
        ["octavo_flex_attention.attention", "octavo_flex_attention.block_mask",
         "torch.nn.attention.flex_attention"],
    ),
    "template-accelerator": (
        "octavo-plugin-template-accelerator", "template", "octavo_template_accel.plugin:plugin",
        ["octavo_template_accel.attention", "octavo_template_accel.memory",
         "octavo_template_accel.worker"],
    ),
}


@pytest.mark.parametrize("folder", sorted(OURS))
def test_own_distribution_pinned_to_the_core_with_one_entry_point(folder):
    distribution, ep_name, module, _ = OURS[folder]
    project = tomllib.loads((PLUGINS / folder / "pyproject.toml").read_text())
    assert project["build-system"]["build-backend"] == "setuptools.build_meta"
    assert project["project"]["name"] == distribution
    assert project["project"]["dependencies"][0] == f"octavo-core=={__version__}"
    assert project["project"]["entry-points"] == {"octavo": {ep_name: module}}
    entry_point = installed_entry_point(ep_name, distribution)
    assert entry_point.value == module and entry_point.dist.name == distribution


def test_discovery_imports_no_heavy_module():
    heavy = sorted(m for *_, modules in OURS.values() for m in modules)
    code = (
        "import sys, octavo.plugins\n"
        "pm = octavo.plugins.build_plugin_manager()\n"
        f"print([m for m in {heavy!r} if m in sys.modules])\n"
        f"print(sorted(name for name in {[ep for _, ep, _, _ in OURS.values()]!r}"
        " if pm.get_plugin(name) is not None))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    imported, loaded = done.stdout.strip().splitlines()
    assert imported == "[]"
    assert loaded == str(sorted(ep for _, ep, _, _ in OURS.values()))
