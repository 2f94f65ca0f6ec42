"""A Hugging Face hub cache written offline, in the layout ``huggingface_hub`` itself reads.

``add_to_hub_cache(cache, "org/name", files)`` writes, under ``cache``::

    models--org--name/
      blobs/<sha256 of the content>            the file contents
      snapshots/<commit>/<path>                relative links to ../../blobs/<sha256>
      refs/<revision>                          the commit hash of a branch or tag

which is what ``huggingface_hub``'s downloads leave behind (its cache-management docs); the
tests check that ``huggingface_hub.scan_cache_dir`` and ``try_to_load_from_cache`` read it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_to_hub_cache(
    cache: Path,
    repo_id: str,
    files: dict[str, bytes | Path],
    revision: str = "main",
    commit: str | None = None,
) -> Path:
    """Add ``files`` (repository path -> content, or a local file to copy) as one commit of
    ``repo_id`` and point ``revision`` at it; return the snapshot folder.

    ``commit`` defaults to a hash of the contents (40 hex digits, like a git commit).
    """
    storage = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    contents = {path: data.read_bytes() if isinstance(data, Path) else data
                for path, data in files.items()}
    if commit is None:
        digest = hashlib.sha1()
        for path in sorted(contents):
            digest.update(path.encode() + b"\0" + contents[path])
        commit = digest.hexdigest()
    snapshot = storage / "snapshots" / commit
    for path, data in contents.items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / path
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    ref = storage / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)
    return snapshot


def folder_files(folder: Path) -> dict[str, Path]:
    """Every file under ``folder`` by its relative path (to copy a model into the cache)."""
    return {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*")) if p.is_file()}
