"""Load an EAGLE-1 head (``octavo.model_executor.models.llama_eagle``) or an EAGLE-3 head
(``octavo.model_executor.models.llama_eagle3``) from its folder and check it against the
target: the projection is there and the sizes agree, else one error line."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from octavo.attention.base import AttentionBackend
from octavo.config import ModelConfig
from octavo.model_executor.loader.safetensors_loader import iterate_safetensors_weights
from octavo.model_executor.models import llama_eagle3 as eagle3
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


def check_eagle3_head(head_config: Any, target_config: Any,
                      shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """``ValueError`` (one line, what to do next) unless the EAGLE-3 head at ``where`` fits
    the target: ``fc.weight`` of ``[hidden, 3 * target hidden]``, the target's vocabulary, a
    draft vocabulary no larger with its ``lm_head.weight`` and ``d2t``, the target's hidden
    size when it shares the target's embedding, and three auxiliary layers of the target."""
    hidden, target_hidden = head_config.hidden_size, target_config.hidden_size
    if FC_WEIGHT not in shapes:
        raise ValueError(f"speculative_config: {where} has no {FC_WEIGHT!r}, so it is not an "
                         "EAGLE-3 head; give the folder of an EAGLE-3 head (config.json plus "
                         "safetensors with fc.weight, midlayer.*, lm_head.weight and d2t)")
    declared = getattr(head_config, "target_hidden_size", None)
    if declared is not None and declared != target_hidden:
        raise ValueError(f"speculative_config: the EAGLE-3 head at {where} was trained on "
                         f"target hidden size {declared}, the target has {target_hidden}; "
                         "use the head trained for this target")
    if shapes[FC_WEIGHT] != (hidden, 3 * target_hidden):
        raise ValueError(f"speculative_config: {FC_WEIGHT} of the EAGLE-3 head at {where} has "
                         f"shape {list(shapes[FC_WEIGHT])}, expected [{hidden}, "
                         f"{3 * target_hidden}] (three target hidden states of {target_hidden}); "
                         "use the head trained for this target")
    if EMBED_WEIGHT not in shapes and hidden != target_hidden:
        raise ValueError(f"speculative_config: the EAGLE-3 head at {where} has hidden size "
                         f"{hidden} and no embed_tokens.weight, so it needs the target's "
                         f"embedding, of size {target_hidden}; use the head trained for this "
                         "target")
    vocab = getattr(head_config, "vocab_size", None)
    if vocab != target_config.vocab_size:
        raise ValueError(f"speculative_config: the EAGLE-3 head at {where} has a vocabulary of "
                         f"{vocab} tokens, the target {target_config.vocab_size}; use the head "
                         "trained for this target")
    draft_vocab = eagle3.draft_vocab_size(head_config)
    if draft_vocab > vocab:
        raise ValueError(f"speculative_config: the EAGLE-3 head at {where} has a draft "
                         f"vocabulary of {draft_vocab} tokens, more than the target's {vocab}; "
                         "fix draft_vocab_size in its config.json")
    lm_head = shapes.get(eagle3.LM_HEAD_WEIGHT)
    if lm_head != (draft_vocab, hidden):
        raise ValueError(f"speculative_config: {eagle3.LM_HEAD_WEIGHT} of the EAGLE-3 head at "
                         f"{where} has shape {list(lm_head) if lm_head else None}, expected "
                         f"[{draft_vocab}, {hidden}] (draft_vocab_size, hidden_size); use the "
                         "complete checkpoint")
    if draft_vocab < vocab and eagle3.D2T not in shapes:
        raise ValueError(f"speculative_config: the EAGLE-3 head at {where} has a "
                         f"{draft_vocab}-token draft vocabulary but no 'd2t' tensor mapping it "
                         "to the target's; use the complete checkpoint")
    if eagle3.D2T in shapes and shapes[eagle3.D2T] != (draft_vocab,):
        raise ValueError(f"speculative_config: 'd2t' of the EAGLE-3 head at {where} has shape "
                         f"{list(shapes[eagle3.D2T])}, expected [{draft_vocab}] "
                         "(draft_vocab_size); use the complete checkpoint")
    eagle3.aux_hidden_state_layers(head_config, target_config.num_hidden_layers)


def check_eagle_folder(head_config: ModelConfig, target_config: ModelConfig,
                       method: str = "eagle") -> None:
    """At start-up, before any worker: the head's folder holds an EAGLE-1 (``method``
    "eagle") or EAGLE-3 ("eagle3") head that fits the target (``check_eagle_head``,
    ``check_eagle3_head``), for a target whose architecture shares its embedding (and LM
    head, EAGLE-1) and hidden states the Llama way. ``ValueError`` (one line) otherwise."""
    architectures = list(getattr(target_config.hf_config, "architectures", None) or [])
    if not any(a in EAGLE_TARGET_ARCHITECTURES for a in architectures):
        raise ValueError(f"speculative_config: method {method!r} runs with Llama-architecture "
                         f"targets ({', '.join(EAGLE_TARGET_ARCHITECTURES)}), not "
                         f"{architectures}; use method 'draft_model' or 'ngram'")
    check = check_eagle3_head if method == "eagle3" else check_eagle_head
    if head_config.load_format != "dummy":
        check(head_config.hf_config, target_config.hf_config, _shapes(head_config.model_dir),
              str(head_config.model_dir))
    elif method == "eagle3":
        eagle3.aux_hidden_state_layers(head_config.hf_config,
                                       target_config.hf_config.num_hidden_layers)


def _build_head(head_config: ModelConfig, target: torch.nn.Module, device: torch.device,
                check: Callable[[Any, Any, dict[str, tuple[int, ...]], str], None],
                make: Callable[[dict[str, tuple[int, ...]]], torch.nn.Module]
                ) -> torch.nn.Module:
    """The loading both head kinds share: check the folder's tensors (``check(head hf config,
    target hf config, shapes, folder)``), build ``make(shapes)`` in the head's dtype on
    ``device``, fill it from the folder (random weights under ``load_format="dummy"``) and
    let it share the target's tensors."""
    folder = head_config.model_dir
    dummy = head_config.load_format == "dummy"
    shapes = {} if dummy else _shapes(folder)
    if not dummy:
        check(head_config.hf_config, target.config, shapes, str(folder))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(head_config.dtype)
    try:
        with torch.device(device):
            head = make(shapes)
    finally:
        torch.set_default_dtype(previous)
    if dummy:
        from octavo.model_executor.model_loader import fill_dummy_weights

        fill_dummy_weights(head, seed=head_config.seed)
    else:
        head.load_weights(iterate_safetensors_weights(folder, lazy=True))
    head.share_target(target)
    head.eval()
    return head


def load_eagle_head(head_config: ModelConfig, target: torch.nn.Module,
                    attn_backend: AttentionBackend, device: torch.device
                    ) -> EagleLlamaForCausalLM:
    """Build the head in the target's dtype on ``device``, fill it from ``head_config``'s
    folder (or with random weights under ``load_format="dummy"``), and share the target's LM
    head (and embedding, when the checkpoint has none)."""
    start = time.perf_counter()
    head = _build_head(head_config, target, device, check_eagle_head, lambda shapes:
                       EagleLlamaForCausalLM(head_config.hf_config, attn_backend,
                                             has_embedding=EMBED_WEIGHT in shapes,
                                             has_fc_bias=FC_BIAS in shapes,
                                             max_model_len=head_config.max_model_len))
    logger.info("speculative decoding: EAGLE head %s loaded (%s embedding) in %.2f s",
                head_config.model, "own" if head.embed_tokens is not None else "the target's",
                time.perf_counter() - start)
    return head


def load_eagle3_head(head_config: ModelConfig, target: torch.nn.Module,
                     attn_backend: AttentionBackend, device: torch.device
                     ) -> eagle3.Eagle3LlamaForCausalLM:
    """Build the EAGLE-3 head in the target's dtype on ``device``, fill it from
    ``head_config``'s folder (or with random weights under ``load_format="dummy"``), and
    share the target's embedding when the checkpoint has none."""
    start = time.perf_counter()
    head = _build_head(head_config, target, device, check_eagle3_head, lambda shapes:
                       eagle3.Eagle3LlamaForCausalLM(head_config.hf_config, attn_backend,
                                                     has_embedding=EMBED_WEIGHT in shapes,
                                                     max_model_len=head_config.max_model_len))
    logger.info("speculative decoding: EAGLE-3 head %s loaded (%d-token draft vocabulary, "
                "%s embedding) in %.2f s", head_config.model, head.draft_vocab_size,
                "own" if head.embed_tokens is not None else "the target's",
                time.perf_counter() - start)
    return head
