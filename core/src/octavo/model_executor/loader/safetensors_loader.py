"""Stream the weights of a Hugging Face-format checkpoint folder stored as safetensors.

Three layouts are understood, tried in this order:

1. sharded: ``model.safetensors.index.json`` whose ``weight_map`` names the shard of each weight;
2. single file: ``model.safetensors``;
3. anything else: every ``*.safetensors`` in the folder, by file name.

PyTorch pickles (``pytorch_model.bin``) are not read: they can run arbitrary code on load.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Files to read, each with the weight names to take from it (None: every weight in the file).
_Plan = list[tuple[Path, list[str] | None]]

_CONVERT_HINT = (
    "convert it once with transformers: "
    "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder, safe_serialization=True)"
)


class SafetensorsSlice:
    """A tensor of an open safetensors file, read only when (and as much as) asked: a
    ``CheckpointTensor`` (``octavo.model_executor.layers.weights``). Valid while the
    iteration that yielded it has not moved on (the file stays open until then)."""

    __slots__ = ("_slice", "shape")

    def __init__(self, handle, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def load(self) -> torch.Tensor:
        return self._slice[tuple(slice(None) for _ in self.shape)]


def iterate_safetensors_weights(
    folder: str | Path, lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | SafetensorsSlice]]:
    """Yield ``(name, tensor)`` for every weight stored in the checkpoint folder ``folder``.

    With ``lazy``, each tensor is a ``SafetensorsSlice``: nothing is read until the consumer
    narrows or loads it (a rank of a split model reads only its part).

    Names are the Hugging Face parameter names as saved (``model.layers.0.self_attn.q_proj.weight``;
    a tied ``lm_head.weight`` is usually absent). Tensors keep their stored dtype, on CPU; the
    caller casts and places them. Each tensor is read when it is yielded, so memory stays at one
    tensor plus what the caller keeps.

    The folder and its files are checked when this function is called, before the first
    tensor: ``FileNotFoundError`` if the folder, a shard named by the index, or any safetensors
    file is missing; ``ValueError`` if the index has no ``weight_map``.
    """
    return _iterate(_plan(Path(folder)), lazy)


def _iterate(plan: _Plan, lazy: bool) -> Iterator[tuple[str, torch.Tensor | SafetensorsSlice]]:
    for file, names in plan:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in names if names is not None else handle.keys():
                yield name, SafetensorsSlice(handle, name) if lazy else handle.get_tensor(name)


def _plan(folder: Path) -> _Plan:
    """Check ``folder`` and decide which files to read (see the module docstring)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {str(folder)!r} does not exist or is not a folder")
    index = folder / INDEX_FILE
    if index.is_file():
        return _plan_from_index(folder, index)
    if (folder / SINGLE_FILE).is_file():
        return [(folder / SINGLE_FILE, None)]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        logger.debug("no %s or %s in %s; reading %d safetensors files", INDEX_FILE, SINGLE_FILE,
                     folder, len(files))
        return [(file, None) for file in files]
    pickles = sorted(p.name for pattern in ("*.bin", "*.pt") for p in folder.glob(pattern))
    found = f" (found {', '.join(pickles)})" if pickles else ""
    raise FileNotFoundError(
        f"no safetensors weights in {str(folder)!r}{found}: expected {SINGLE_FILE} or "
        f"{INDEX_FILE} with its shards. PyTorch .bin/.pt checkpoints are not supported; "
        f"{_CONVERT_HINT}"
    )


def _plan_from_index(folder: Path, index: Path) -> _Plan:
    try:
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(
            f"{str(index)!r} is not a valid safetensors index (needs a 'weight_map' object): "
            f"{error}; re-save the model with save_pretrained"
        ) from error
    names_by_file: dict[str, list[str]] = {}
    for name, file_name in weight_map.items():
        names_by_file.setdefault(file_name, []).append(name)
    plan: _Plan = []
    for file_name in sorted(names_by_file):
        file = folder / file_name
        if not file.is_file():
            raise FileNotFoundError(
                f"shard {file_name!r} listed in {str(index)!r} is missing from {str(folder)!r}; "
                "download the complete checkpoint"
            )
        plan.append((file, names_by_file[file_name]))
    return plan
