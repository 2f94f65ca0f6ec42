"""Plugins for subprocesses, installed the way pip installs them: a ``*.dist-info`` with an
``entry_points.txt`` in a folder that goes on the subprocess's ``PYTHONPATH``, where
``importlib.metadata`` finds it (registering a plugin in the test's own process would not reach
``octavo serve`` or its engine core)."""

from __future__ import annotations

from pathlib import Path


def write_dist_info(folder: Path, name: str, entry_points: dict[str, str]) -> Path:
    """Write the dist-info of a distribution ``name`` whose ``octavo`` entry points are
    ``entry_points`` (entry name -> ``module`` or ``module:attribute``) into ``folder``;
    returns ``folder``."""
    dist_info = Path(folder) / f"{name.replace('-', '_')}-0.0.0.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.0\n")
    lines = "".join(f"{entry} = {target}\n" for entry, target in entry_points.items())
    (dist_info / "entry_points.txt").write_text(f"[octavo]\n{lines}")
    return Path(folder)
