"""Reading LoRA adapters in PEFT's format, with every check a request needs up front.

A PEFT LoRA adapter is a folder with ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``, ...) and ``adapter_model.safetensors`` whose tensors are
named ``base_model.model.<module>.lora_A.weight`` (``[r, in_features]``) and
``...lora_B.weight`` (``[out_features, r]``). The adapted layer computes
``y = x W^T + scale * (x A^T) B^T`` with ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)``
with ``use_rslora``).

``inspect_adapter`` reads only the config and the safetensors header (cheap enough for the
front end to run on every new adapter) and raises ``InvalidRequestError`` saying what is wrong;
``load_adapter_weights`` then reads the tensors (on the workers).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from octavo.errors import InvalidRequestError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections LoRA may adapt (Llama-style decoder layers).
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CODE_INVALID_LORA = "invalid_lora_adapter"

_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """What ``inspect_adapter`` learnt about an adapter."""

    # The adapter's folder.
    path: Path
    # Its rank (r) and the factor its product is scaled by.
    rank: int
    scale: float
    # Adapted modules by their Hugging Face names ("model.layers.0.self_attn.q_proj").
    modules: tuple[str, ...]


def _fail(name: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {name!r}: {message}", param="lora_path",
                               code=CODE_INVALID_LORA)


def _read_config(path: Path, name: str) -> dict[str, Any]:
    if not path.is_dir():
        raise _fail(name, f"no such folder {str(path)!r} (lora_path must be a local folder "
                          "holding a PEFT adapter)")
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise _fail(name, f"{str(path)!r} has no {CONFIG_FILE} (not a PEFT adapter folder)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _fail(name, f"cannot read {config_file}: {exc}") from None
    if not isinstance(config, dict):
        raise _fail(name, f"{config_file} does not hold a JSON object")
    return config


def _check_config(config: dict[str, Any], name: str, max_rank: int) -> tuple[int, float]:
    """(rank, scale) of a PEFT LoRA config; refuses what the engine cannot run."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _fail(name, f"peft_type is {peft_type!r}; only LORA adapters are supported")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _fail(name, f"adapter_config.json has no positive integer r (got {rank!r})")
    if rank > max_rank:
        raise _fail(name, f"rank {rank} is over the engine's max_lora_rank {max_rank} "
                          f"(start it with --max-lora-rank {rank} or more)")
    unsupported = []
    if config.get("use_dora"):
        unsupported.append("use_dora")
    if config.get("bias", "none") not in (None, "none"):
        unsupported.append(f"bias={config['bias']!r}")
    if config.get("modules_to_save"):
        unsupported.append(f"modules_to_save={config['modules_to_save']!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            unsupported.append(key)
    if config.get("fan_in_fan_out"):
        unsupported.append("fan_in_fan_out")
    if unsupported:
        raise _fail(name, f"uses {', '.join(unsupported)}, which the engine does not support")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        bad = sorted(str(t) for t in targets if str(t).rsplit(".", 1)[-1] not in SUPPORTED_MODULES)
        if bad:
            raise _fail(name, f"target_modules {bad} are not supported (supported: "
                              f"{', '.join(SUPPORTED_MODULES)})")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _fail(name, f"lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def expected_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each adaptable projection of a Llama-style config."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return {
        "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }


def inspect_adapter(name: str, path: str | Path, max_rank: int,
                    hf_config: Any | None = None) -> AdapterInfo:
    """Check the adapter at ``path`` without reading its weights; ``hf_config`` (the base
    model's) also checks every tensor's shape and layer index against the model.

    :raises InvalidRequestError: (``param="lora_path"``) saying what is wrong.
    """
    from safetensors import safe_open

    folder = Path(path).expanduser()
    config = _read_config(folder, name)
    rank, scale = _check_config(config, name, max_rank)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        extra = " (adapter_model.bin is not read: save it with safe_serialization=True)" if (
            folder / "adapter_model.bin").is_file() else ""
        raise _fail(name, f"{str(folder)!r} has no {WEIGHTS_FILE}{extra}")
    try:
        with safe_open(str(weights), framework="pt") as handle:
            shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except Exception as exc:  # safetensors raises its own error types
        raise _fail(name, f"cannot read {weights}: {exc}") from None
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    unknown = []
    for key, shape in shapes.items():
        match = _KEY.match(key)
        if match is None:
            unknown.append(key)
            continue
        pairs.setdefault(match["module"], {})[match["which"]] = shape
    if unknown:
        raise _fail(name, f"tensors {sorted(unknown)[:5]} are not LoRA A/B weights of a "
                          f"supported module ({', '.join(SUPPORTED_MODULES)})")
    if not pairs:
        raise _fail(name, f"{WEIGHTS_FILE} holds no LoRA weights")
    unsupported = sorted({m.rsplit(".", 1)[-1] for m in pairs} - set(SUPPORTED_MODULES))
    if unsupported:
        raise _fail(name, f"adapts modules {unsupported}, which are not supported (supported: "
                          f"{', '.join(SUPPORTED_MODULES)})")
    expected = expected_shapes(hf_config) if hf_config is not None else None
    num_layers = getattr(hf_config, "num_hidden_layers", None)
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise _fail(name, f"{module} has lora_{'A' if 'A' in ab else 'B'} but not the other")
        a, b = ab["A"], ab["B"]
        if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
            raise _fail(name, f"{module}: lora_A {list(a)} / lora_B {list(b)} do not have "
                              f"rank {rank}")
        if expected is not None:
            parts = module.split(".")
            if num_layers is not None and (len(parts) < 3 or not parts[2].isdigit()
                                           or int(parts[2]) >= num_layers):
                raise _fail(name, f"{module} is not a decoder layer of the base model "
                                  f"({num_layers} layers)")
            want_in, want_out = expected[parts[-1]]
            if (a[1], b[0]) != (want_in, want_out):
                raise _fail(name, f"{module} maps {a[1]} -> {b[0]} features but the base "
                                  f"model's maps {want_in} -> {want_out} (an adapter of "
                                  "another model?)")
    return AdapterInfo(folder, rank, scale, tuple(sorted(pairs)))


@dataclass(slots=True)
class AdapterWeights:
    """An adapter's tensors in host memory, by Hugging Face module name."""

    info: AdapterInfo
    # module -> (A [r, in_features], B [out_features, r]).
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


def load_adapter_weights(name: str, path: str | Path, max_rank: int,
                         hf_config: Any | None = None) -> AdapterWeights:
    """Check (``inspect_adapter``) and read an adapter's tensors onto the host."""
    from safetensors.torch import load_file

    info = inspect_adapter(name, path, max_rank, hf_config)
    tensors = load_file(str(info.path / WEIGHTS_FILE))
    modules: dict[str, list[torch.Tensor | None]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        assert match is not None, "checked by inspect_adapter"
        slot = modules.setdefault(match["module"], [None, None])
        slot[0 if match["which"] == "A" else 1] = tensor
    return AdapterWeights(info, {m: (ab[0], ab[1]) for m, ab in modules.items()})
