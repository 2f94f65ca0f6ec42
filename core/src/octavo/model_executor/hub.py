"""Model names from the Hugging Face hub: ``org/name`` (or ``org/name:QUANT`` for a GGUF file)
to a folder of ``huggingface_hub``'s cache.

``resolve_hub_model`` looks in the cache first (``HF_HUB_CACHE``, or ``--download-dir``): when
the snapshot of the revision asked for (``--revision``; default ``main``) already holds every
file the model needs, nothing touches the network. Otherwise, unless ``HF_HUB_OFFLINE=1``, it
lists the repository's files and downloads only what Octavo reads, with ``huggingface_hub``'s
progress bars: the top-level config, tokenizer and generation files, then the safetensors
weights (the shards ``model.safetensors.index.json`` names, else every top-level
``*.safetensors``), or the one GGUF file chosen. Files are placed by ``huggingface_hub`` itself
(``models--org--name/{blobs,refs,snapshots}``), so other tools share the downloads.

GGUF files inside a repository: ``org/name:Q4_K_M`` picks the ``.gguf`` file whose name holds
``Q4_K_M`` as a whole token (case-insensitive), ``--gguf-file NAME`` names the file; a repository
with no ``config.json`` and a single ``.gguf`` file uses it.

Every failure is a ``ModelNotFoundError`` whose one line says what was looked for, where, and
what to do next.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from octavo.model_executor.model_files import ModelNotFoundError

logger = logging.getLogger(__name__)

# [org/]name, as huggingface_hub validates repo ids, then an optional ":QUANT".
_NAME = re.compile(r"^(?P<repo>(?:[A-Za-z0-9][\w.-]*/)?[\w.-]+)(?::(?P<quant>[\w.-]+))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
INDEX_FILE = "model.safetensors.index.json"
# Top-level files (besides weights) that configs, tokenizers and chat templates are read from.
_METADATA_SUFFIXES = (".json", ".model", ".txt", ".tiktoken", ".jinja")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_MAX_LISTED = 8


@dataclass(frozen=True, slots=True)
class HubName:
    """A parsed ``[org/]name[:QUANT]``."""

    # The repository id, e.g. "Qwen/Qwen2.5-0.5B-Instruct".
    repo_id: str
    # The GGUF quantization asked for after ":" (e.g. "Q4_K_M"), None without one.
    quant: str | None = None


@dataclass(frozen=True, slots=True)
class HubRequest:
    """What to fetch from a repository, and from where."""

    name: HubName
    # Branch, tag or commit hash (None: "main").
    revision: str | None = None
    # huggingface_hub cache folder (None: its default, HF_HUB_CACHE).
    cache_dir: Path | None = None
    # A GGUF file of the repository to use (--gguf-file).
    gguf_file: str | None = None
    # False: config and tokenizer only (--load-format dummy, or a tokenizer alone).
    need_weights: bool = True
    # Also fetch the repository's *.py files (custom config/tokenizer code).
    trust_remote_code: bool = False
    # Only the tokenizer's files (--tokenizer NAME).
    tokenizer_only: bool = False
    # The model's own tokenizer files are needed (False when --tokenizer names another).
    need_tokenizer: bool = True


@dataclass(frozen=True, slots=True)
class HubModel:
    """A resolved repository: the snapshot folder and the GGUF file in it, if one."""

    folder: Path
    gguf_file: Path | None


class _Unavailable(Exception):
    """The files at hand do not hold what was asked for (the message says what is missing)."""


def parse_hub_name(model: str) -> HubName | None:
    """``HubName`` when ``model`` is shaped like ``[org/]name[:QUANT]``, else ``None``."""
    match = _NAME.match(model)
    if (match is None or ".." in match["repo"] or match["repo"].endswith((".", "-"))
            or match["repo"].endswith((".gguf", ".safetensors"))):  # a file name, mistyped
        return None
    return HubName(match["repo"], match["quant"])


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) forbids network access; read when
    called, so a value set after ``huggingface_hub`` was imported counts too."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.HF_HUB_OFFLINE) or value.upper() in ("1", "ON", "YES", "TRUE")


def cache_root(cache_dir: Path | None) -> Path:
    """The cache folder searched: ``cache_dir``, else huggingface_hub's (``HF_HUB_CACHE``)."""
    from huggingface_hub import constants

    return Path(cache_dir or constants.HF_HUB_CACHE).expanduser()


def resolve_hub_model(request: HubRequest) -> HubModel:
    """The local snapshot of ``request``'s repository holding every file it needs: from the
    cache when complete there, else downloaded (see the module doc). ``ModelNotFoundError``
    says what is missing and what to do."""
    name = request.name
    shown = name.repo_id + (f" (revision {request.revision})" if request.revision else "")
    root = cache_root(request.cache_dir)
    folder = cached_snapshot(root, name.repo_id, request.revision)
    cache_problem = (f"it is no local path, and as a Hugging Face hub name it is not in the "
                     f"cache {str(root)!r}")
    if folder is not None:
        try:
            return _complete(request, folder, _local_files(folder))
        except _Unavailable as exc:
            cache_problem = (f"it is no local path, and as a Hugging Face hub name its cached "
                             f"snapshot {str(folder)!r} is incomplete ({exc})")
    if hub_offline():
        raise ModelNotFoundError(
            f"Model {shown!r}: {cache_problem}, and HF_HUB_OFFLINE=1 forbids downloading it. "
            "Download it with network access first (`hf download "
            f"{name.repo_id}`, or run once without HF_HUB_OFFLINE), point --download-dir or "
            "HF_HUB_CACHE at a cache that holds it, or pass a local folder or .gguf file.")
    return _download(request, shown, cache_problem)


def cached_snapshot(root: Path, repo_id: str, revision: str | None) -> Path | None:
    """The snapshot folder of ``repo_id`` at ``revision`` in the cache ``root``, if present.

    Reads huggingface_hub's cache layout: ``models--{org}--{name}/refs/{revision}`` holds the
    commit hash of a branch or tag, ``snapshots/{commit}/`` the files (links into ``blobs/``).
    """
    storage = root / ("models--" + repo_id.replace("/", "--"))
    revision = revision or "main"
    commit = revision if _COMMIT.match(revision) else None
    if commit is None:
        ref = storage / "refs" / revision
        if not ref.is_file():
            return None
        commit = ref.read_text().strip()
    folder = storage / "snapshots" / commit
    return folder if folder.is_dir() else None


def _local_files(folder: Path) -> list[str]:
    """Relative paths of the files present under a snapshot folder (links that resolve)."""
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())


def _complete(request: HubRequest, folder: Path, files: list[str]) -> HubModel:
    """``HubModel`` when ``files`` (present in ``folder``) are all the request needs."""
    gguf = pick_gguf(files, request.name.quant, request.gguf_file, request.tokenizer_only)
    if gguf is not None:
        return HubModel(folder, folder / gguf)
    if (request.tokenizer_only or request.need_tokenizer) and not any(
            name in files for name in _TOKENIZER_FILES):
        raise _Unavailable(f"no tokenizer file ({', '.join(_TOKENIZER_FILES)}); a model "
                           "without one needs --tokenizer")
    if request.tokenizer_only:
        return HubModel(folder, None)
    if "config.json" not in files:
        raise _Unavailable("no config.json")
    if request.need_weights:
        missing = [f for f in weight_files(files, folder) if f not in files]
        if missing:
            raise _Unavailable(f"missing weight files {_listing(missing)}")
    return HubModel(folder, None)


def _download(request: HubRequest, shown: str, cache_problem: str) -> HubModel:
    """List the repository's files, then download what ``request`` needs into the cache."""
    files = _remote_files(request, shown, cache_problem)
    try:
        gguf = pick_gguf(files, request.name.quant, request.gguf_file, request.tokenizer_only)
        if gguf is not None:
            folder = _snapshot_download(request, [gguf], shown)
            return HubModel(folder, folder / gguf)
        metadata = metadata_files(files, request.trust_remote_code)
        if not request.tokenizer_only and "config.json" not in metadata:
            raise _Unavailable("no config.json (nor a .gguf file)")
        folder = _snapshot_download(request, metadata, shown)
        if request.need_weights and not request.tokenizer_only:
            weights = weight_files(files, folder)
            _snapshot_download(request, weights, shown)
        return _complete(request, folder, _local_files(folder))
    except _Unavailable as exc:
        raise ModelNotFoundError(
            f"Model {shown!r} on the Hugging Face hub cannot be served: {exc}.") from None


def _remote_files(request: HubRequest, shown: str, cache_problem: str) -> list[str]:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo_id = request.name.repo_id
    try:
        return sorted(HfApi().list_repo_files(repo_id, revision=request.revision))
    except GatedRepoError:
        raise ModelNotFoundError(
            f"Model {shown!r} is gated on the Hugging Face hub: accept its terms on "
            f"https://huggingface.co/{repo_id} and log in (`hf auth login`, or set HF_TOKEN)."
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(
            f"Model {repo_id!r} has no revision {request.revision!r} on the Hugging Face hub: "
            "pass an existing branch, tag or commit hash to --revision.") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"Model {shown!r} was not found: no local folder or file of that name, and no "
            f"repository {repo_id!r} on the Hugging Face hub (a private one needs "
            "`hf auth login` or HF_TOKEN). Check the name, or pass a local folder or .gguf "
            "file.") from None
    except Exception as exc:  # noqa: BLE001 - the transport's errors (httpx/requests) vary
        raise ModelNotFoundError(
            f"Model {shown!r}: {cache_problem}, and the Hugging Face hub could not be reached "
            f"({type(exc).__name__}: {exc}). Connect to the network, point --download-dir or "
            "HF_HUB_CACHE at a cache that holds it, or pass a local folder or .gguf file."
        ) from None


def _snapshot_download(request: HubRequest, files: list[str], shown: str) -> Path:
    """Download ``files`` (exact names) of the request's revision; return the snapshot folder."""
    from huggingface_hub import snapshot_download

    logger.info("downloading %d file(s) of %s into %s: %s", len(files), shown,
                cache_root(request.cache_dir), _listing(files))
    folder = snapshot_download(
        request.name.repo_id, revision=request.revision,
        cache_dir=str(request.cache_dir) if request.cache_dir else None,
        allow_patterns=[_literal_pattern(f) for f in files])
    return Path(folder)


def _literal_pattern(name: str) -> str:
    """An fnmatch pattern matching exactly ``name`` (``[``, ``*``, ``?`` escaped)."""
    return re.sub(r"([\[\]*?])", r"[\1]", name)


def metadata_files(files: list[str], trust_remote_code: bool) -> list[str]:
    """The top-level config, tokenizer, generation-config and chat-template files (plus the
    ``*.py`` files of custom code when ``trust_remote_code``)."""
    suffixes = _METADATA_SUFFIXES + ((".py",) if trust_remote_code else ())
    return [f for f in files if "/" not in f and f.endswith(suffixes)]


def weight_files(files: list[str], folder: Path | None) -> list[str]:
    """The safetensors files the model's weights are in: the shards the index in ``folder``
    names, else every top-level ``*.safetensors`` (``_Unavailable`` when there are none)."""
    if INDEX_FILE in files and folder is not None and (folder / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
            return sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError):
            raise _Unavailable(f"{INDEX_FILE} has no valid weight_map") from None
    weights = [f for f in files if "/" not in f and f.endswith(".safetensors")]
    if not weights:
        pickles = [f for f in files if f.endswith((".bin", ".pt", ".pth"))]
        raise _Unavailable(
            "no *.safetensors weights" + (f" (only PyTorch pickles such as {pickles[0]!r}: "
                                          "Octavo reads safetensors or GGUF)" if pickles else ""))
    return weights


def pick_gguf(files: list[str], quant: str | None, gguf_file: str | None,
              tokenizer_only: bool = False) -> str | None:
    """The GGUF file to load among ``files``, or ``None`` for a Hugging Face-format model.

    ``gguf_file`` names it; else ``quant`` picks the one ``.gguf`` whose file name holds it as
    a whole token; else a repository without ``config.json`` holding a single ``.gguf`` file
    uses it. ``_Unavailable`` when the named file or quantization is absent, or several match.
    """
    ggufs = [f for f in files if f.endswith(".gguf")]
    if gguf_file is not None:
        if gguf_file not in files:
            raise _Unavailable(f"no file {gguf_file!r} (GGUF files: {_listing(ggufs) or 'none'})")
        return gguf_file
    if quant is not None:
        token = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
        matches = [f for f in ggufs if token.search(f.rpartition("/")[2])]
        if not matches:
            raise _Unavailable(f"no .gguf file with {quant!r} in its name (GGUF files: "
                               f"{_listing(ggufs) or 'none'})")
        if len(matches) > 1:
            raise _Unavailable(f"several .gguf files match {quant!r}: {_listing(matches)}; name "
                               "one with --gguf-file")
        return matches[0]
    if tokenizer_only or "config.json" in files or not ggufs:
        return None
    if len(ggufs) > 1:
        raise _Unavailable(f"no config.json and several .gguf files ({_listing(ggufs)}): pick one "
                           "with NAME:QUANT (e.g. org/name:Q4_K_M) or --gguf-file")
    return ggufs[0]


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f" ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED
                    else "")
