"""Load an EAGLE-1 head (``octavo.model_executor.models.llama_eagle``) from its folder and check
it against the target: the projection is there and the sizes agree, else one error line."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from octavo.attention.base import AttentionBackend
from octavo.config import ModelConfig
from octavo.model_executor.loader.safetensors_loader import iterate_safetensors_weights
from octavo.model_executor.models.llama_eagle import (
    EMBED_WEIGHT,
    FC_BIAS,
    FC_WEIGHT,
    EagleLlamaForCausalLM,
)

logger = logging.getLogger(__name__)

# Targets an EAGLE-1 head runs with: the Llama decoder body (octavo.model_executor.models.llama)
# whose hidden states, embedding and LM head the head shares.
EAGLE_TARGET_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


def _shapes(folder: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor's name (without a leading ``model.``) and shape, reading no data."""
    return {name.removeprefix("model."): tuple(tensor.shape)
            for name, tensor in iterate_safetensors_weights(folder, lazy=True)}


def check_eagle_head(head_config: Any, target_config: Any,
                     shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """``ValueError`` (one line, what to do next) unless the head at ``where`` fits the target:
    ``fc.weight`` of ``[hidden, 2 * hidden]``, the target's hidden size and vocabulary, one
    decoder layer."""
    hidden = target_config.hidden_size
    if FC_WEIGHT not in shapes:
        raise ValueError(f"speculative_config: {where} has no {FC_WEIGHT!r}, so it is not an "
                         "EAGLE-1 head; give the folder of an EAGLE head (config.json plus "
                         "safetensors with fc.weight and layers.0.*)")
    if head_config.hidden_size != hidden:
        raise ValueError(f"speculative_config: the EAGLE head at {where} has hidden size "
                         f"{head_config.hidden_size}, the target {hidden}; use the head "
                         "trained for this target")
    if shapes[FC_WEIGHT] != (hidden, 2 * hidden):
        raise ValueError(f"speculative_config: {FC_WEIGHT} of the EAGLE head at {where} has "
                         f"shape {list(shapes[FC_WEIGHT])}, expected [{hidden}, {2 * hidden}] "
                         "for this target; use the head trained for this target")
    vocab = getattr(head_config, "vocab_size", None)
    if vocab != target_config.vocab_size:
        raise ValueError(f"speculative_config: the EAGLE head at {where} has a vocabulary of "
                         f"{vocab} tokens, the target {target_config.vocab_size}; use the head "
                         "trained for this target")
    layers = getattr(head_config, "num_hidden_layers", None)
    if layers != 1:
        raise ValueError(f"speculative_config: the EAGLE head at {where} declares {layers} "
                         "decoder layers; an EAGLE-1 head has one (num_hidden_layers: 1)")


def check_eagle_folder(head_config: ModelConfig, target_config: ModelConfig) -> None:
    """At start-up, before any worker: the head's folder holds an EAGLE-1 head that fits the
    target (``check_eagle_head``), for a target whose architecture shares its embedding and
    LM head the Llama way. ``ValueError`` (one line) otherwise."""
    architectures = list(getattr(target_config.hf_config, "architectures", None) or [])
    if not any(a in EAGLE_TARGET_ARCHITECTURES for a in architectures):
        raise ValueError(f"speculative_config: method 'eagle' runs with Llama-architecture "
                         f"targets ({', '.join(EAGLE_TARGET_ARCHITECTURES)}), not "
                         f"{architectures}; use method 'draft_model' or 'ngram'")
    if head_config.load_format != "dummy":
        check_eagle_head(head_config.hf_config, target_config.hf_config,
                         _shapes(head_config.model_dir), str(head_config.model_dir))


def load_eagle_head(head_config: ModelConfig, target: torch.nn.Module,
                    attn_backend: AttentionBackend, device: torch.device
                    ) -> EagleLlamaForCausalLM:
    """Build the head in the target's dtype on ``device``, fill it from ``head_config``'s
    folder (or with random weights under ``load_format="dummy"``), and share the target's LM
    head (and embedding, when the checkpoint has none)."""
    start = time.perf_counter()
    folder = head_config.model_dir
    dummy = head_config.load_format == "dummy"
    shapes = {} if dummy else _shapes(folder)
    if not dummy:
        check_eagle_head(head_config.hf_config, target.config, shapes, str(folder))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(head_config.dtype)
    try:
        with torch.device(device):
            head = EagleLlamaForCausalLM(
                head_config.hf_config, attn_backend, has_embedding=EMBED_WEIGHT in shapes,
                has_fc_bias=FC_BIAS in shapes, max_model_len=head_config.max_model_len)
    finally:
        torch.set_default_dtype(previous)
    if dummy:
        from octavo.model_executor.model_loader import fill_dummy_weights

        fill_dummy_weights(head, seed=head_config.seed)
    else:
        head.load_weights(iterate_safetensors_weights(folder, lazy=True))
    head.share_target(target)
    head.eval()
    logger.info("speculative decoding: EAGLE head %s loaded (%s embedding) in %.2f s",
                head_config.model, "own" if head.embed_tokens is not None else "the target's",
                time.perf_counter() - start)
    return head
