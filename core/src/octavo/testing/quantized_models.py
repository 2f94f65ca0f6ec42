"""Quantized checkpoints made from a dense Hugging Face folder, in the exact formats the
quantization tools write: for tests and benchmarks (no download, no calibration).

Each ``write_*`` reads ``source`` (config.json + safetensors), quantizes every linear weight of
the decoder layers (the embedding and LM head stay dense, as the tools leave them) by
round-to-nearest, and writes ``target`` with the quantized tensors, the ``quantization_config``
in config.json and the tokenizer files. It also returns a dense state dict holding the
*dequantized* weights: the model the quantized checkpoint stands for, which a reference
(transformers) runs for comparison.

- ``write_fp8``: ``quant_method: "fp8"``; ``scheme`` ``"tensor"`` (``weight_scale`` scalars,
  vLLM/llm-compressor naming), ``"tensor-inv"`` (``weight_scale_inv`` scalars: transformers'
  FineGrainedFP8 without blocks) or ``"block"`` (``weight_scale_inv`` per 128x128 block).
- ``write_compressed_tensors_fp8``: compressed-tensors ``float-quantized``, per-channel or
  per-tensor ``weight_scale``, dynamic per-token activations.
- ``write_gptq``: ``qweight``/``qzeros``/``scales``/``g_idx``, v1 zeros, optional act-order.
- ``write_awq``: AutoAWQ GEMM layout.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from octavo.kernels.fp8 import (
    dequantize_fp8,
    quantize_fp8_block,
    quantize_fp8_per_channel,
    quantize_fp8_per_tensor,
)
from octavo.kernels.int4 import dequantize_int4, pack_awq, pack_cols, pack_rows, quantize_int4

# (Phi-3 stores q/k/v and gate/up fused: qkv_proj, gate_up_proj.)
_LINEAR_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                 "qkv_proj", "gate_up_proj")
# Projections of one input, quantized with one act-order permutation (merged by Octavo).
_SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                 "up_proj": "gate_up"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json", "chat_template.jinja")

Dense = dict[str, torch.Tensor]


def _is_linear(name: str) -> bool:
    parts = name.split(".")
    return name.endswith(".weight") and len(parts) >= 2 and parts[-2] in _LINEAR_PARTS


def _read(source: Path) -> tuple[dict, Dense]:
    source = Path(source)
    config = json.loads((source / "config.json").read_text())
    tensors: Dense = {}
    for file in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return config, tensors


def _write(source: Path, target: Path, config: dict, quant_config: dict,
           tensors: Dense) -> None:
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    config = dict(config, quantization_config=quant_config)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(target / "model.safetensors"))
    for name in _TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copy(Path(source) / name, target / name)


def write_fp8(source: Path, target: Path, scheme: str = "tensor",
              block: tuple[int, int] = (128, 128)) -> Dense:
    """An fp8 checkpoint (see the module docstring for ``scheme``); returns the dequantized
    dense weights."""
    config, tensors = _read(source)
    out: Dense = {}
    dense: Dense = {}
    for name, tensor in tensors.items():
        if not _is_linear(name):
            out[name] = dense[name] = tensor
            continue
        stem = name.removesuffix(".weight")
        if scheme == "block":
            weight, scale = quantize_fp8_block(tensor, block)
            out[f"{stem}.weight_scale_inv"] = scale
            dense[name] = dequantize_fp8(weight, scale, tensor.dtype, block)
        else:
            weight, scale = quantize_fp8_per_tensor(tensor)
            key = "weight_scale_inv" if scheme == "tensor-inv" else "weight_scale"
            out[f"{stem}.{key}"] = scale.reshape(())
            dense[name] = dequantize_fp8(weight, scale, tensor.dtype)
        out[name] = weight
    quant_config = {"quant_method": "fp8", "activation_scheme": "dynamic",
                    "weight_block_size": list(block) if scheme == "block" else None}
    if scheme == "block":
        quant_config["modules_to_not_convert"] = ["lm_head"]
    _write(source, target, config, quant_config, out)
    return dense


def write_compressed_tensors_fp8(source: Path, target: Path, per_channel: bool = True) -> Dense:
    """A compressed-tensors FP8 checkpoint (W8A8, dynamic per-token activations)."""
    config, tensors = _read(source)
    out: Dense = {}
    dense: Dense = {}
    for name, tensor in tensors.items():
        if not _is_linear(name):
            out[name] = dense[name] = tensor
            continue
        stem = name.removesuffix(".weight")
        if per_channel:
            weight, scale = quantize_fp8_per_channel(tensor)
            out[f"{stem}.weight_scale"] = scale[:, None]
        else:
            weight, scale = quantize_fp8_per_tensor(tensor)
            out[f"{stem}.weight_scale"] = scale.reshape(1)
        out[name] = weight
        dense[name] = dequantize_fp8(weight, scale, tensor.dtype)
    quant_config = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                        "strategy": "channel" if per_channel else "tensor"},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                  "dynamic": True, "strategy": "token"},
        }},
    }
    _write(source, target, config, quant_config, out)
    return dense


def write_gptq(source: Path, target: Path, group_size: int = 32, desc_act: bool = False,
               sym: bool = True, seed: int = 0) -> Dense:
    """A GPTQ checkpoint (v1 zeros); with ``desc_act`` every layer gets a random act-order
    permutation of its groups (the q/k/v and gate/up projections of a layer share theirs, as
    GPTQ's shared input statistics give them)."""
    config, tensors = _read(source)
    out: Dense = {}
    dense: Dense = {}
    generator = torch.Generator().manual_seed(seed)
    perms: dict[tuple[str, int], torch.Tensor] = {}  # (shared input, k) -> permutation
    for name, tensor in tensors.items():
        if not _is_linear(name):
            out[name] = dense[name] = tensor
            continue
        stem = name.removesuffix(".weight")
        n, k = tensor.shape
        g_idx = torch.arange(k, dtype=torch.int32) // group_size
        if desc_act:
            parent, proj = stem.rsplit(".", 1)
            key = (f"{parent}.{_SHARED_INPUT.get(proj, proj)}", k)
            if key not in perms:
                perms[key] = torch.randperm(k, generator=generator)
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[perms[key]] = torch.arange(k, dtype=torch.int32) // group_size
        values, scales, zeros = quantize_int4(tensor, group_size, sym, g_idx)
        out[f"{stem}.qweight"] = pack_rows(values)
        out[f"{stem}.qzeros"] = pack_cols((zeros - 1) & 0xF)  # v1: zero - 1
        out[f"{stem}.scales"] = scales
        out[f"{stem}.g_idx"] = g_idx
        dense[name] = dequantize_int4(pack_rows(values), scales, zeros.half(), group_size,
                                      g_idx, tensor.dtype)
    quant_config = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                    "desc_act": desc_act, "sym": sym, "checkpoint_format": "gptq",
                    "damp_percent": 0.01, "true_sequential": True}
    _write(source, target, config, quant_config, out)
    return dense


def write_awq(source: Path, target: Path, group_size: int = 32) -> Dense:
    """An AutoAWQ (GEMM) checkpoint with zero points."""
    config, tensors = _read(source)
    out: Dense = {}
    dense: Dense = {}
    for name, tensor in tensors.items():
        if not _is_linear(name):
            out[name] = dense[name] = tensor
            continue
        stem = name.removesuffix(".weight")
        values, scales, zeros = quantize_int4(tensor, group_size, symmetric=False)
        out[f"{stem}.qweight"] = pack_awq(values)
        out[f"{stem}.qzeros"] = pack_awq(zeros)
        out[f"{stem}.scales"] = scales
        dense[name] = dequantize_int4(pack_rows(values), scales, zeros.half(), group_size,
                                      None, tensor.dtype)
    quant_config = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                    "zero_point": True, "version": "gemm"}
    _write(source, target, config, quant_config, out)
    return dense


def write_dense(source: Path, target: Path, weights: Dense) -> Path:
    """A dense checkpoint of ``source``'s config and tokenizer with ``weights`` (the reference
    model a quantized checkpoint stands for)."""
    config, _ = _read(source)
    config.pop("quantization_config", None)
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(target / "model.safetensors"))
    for name in _TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copy(Path(source) / name, target / name)
    return target
