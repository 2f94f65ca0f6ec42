"""``LoRAManager``: a worker's adapter slots, filled on demand and evicted least recently used.

At load the manager gives every adaptable linear layer of the model (the q/k/v/o and
gate/up/down projections, found by their Hugging Face names) a ``LoRALinear`` of
``max_loras`` slots. Before each step the model runner calls ``prepare`` with the step's
requests: every adapter the step needs is put in a slot (read from its PEFT folder, or from
the host cache of the ``max_cpu_loras`` adapters read last), evicting the least recently used
adapter that no request the runner holds still uses, and the step's ``LoRAMapping`` is set.

The scheduler never runs more than ``max_loras`` different adapters at once
(``octavo.scheduler``), so an evictable slot always exists; every rank of a split model makes
the same choices from the same step messages.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from octavo.config import LoRAConfig
from octavo.lora.layers import LoRABatch, LoRALinear, LoRAMapping
from octavo.lora.peft import SUPPORTED_MODULES, AdapterWeights, load_adapter_weights
from octavo.lora_request import LoRARequest
from octavo.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

logger = logging.getLogger(__name__)


def attach_lora(model: nn.Module, batch: LoRABatch, config: LoRAConfig, dtype: torch.dtype,
                device: torch.device) -> dict[str, tuple[LoRALinear, int]]:
    """Give every adaptable projection of ``model`` its LoRA slots; return them by Hugging
    Face module name (``model.layers.0.self_attn.q_proj`` -> (slots, shard index))."""
    targets: dict[str, tuple[LoRALinear, int]] = {}
    for path, module in model.named_modules():
        parent, _, own = path.rpartition(".")
        if isinstance(module, ColumnParallelLinear):
            names = [s.name or own for s in module.shards]
            if not all(name in SUPPORTED_MODULES for name in names):
                continue
            offsets, offset = [], 0
            for shard in module.shards:
                offsets.append((offset, shard.size, shard.start))
                offset += shard.size
            lora = LoRALinear(batch, config.max_loras, config.max_lora_rank, module.input_size,
                              offsets, None, dtype, device)
        elif isinstance(module, RowParallelLinear) and own in SUPPORTED_MODULES:
            names = [own]
            lora = LoRALinear(batch, config.max_loras, config.max_lora_rank,
                              module.local_input_size, [(0, module.output_size, 0)],
                              (module.input_start, module.local_input_size), dtype, device)
        else:
            continue
        module.lora = lora
        for index, name in enumerate(names):
            targets[f"{parent}.{name}" if parent else name] = (lora, index)
    if not targets:
        raise ValueError(f"{type(model).__name__} has no projection LoRA can adapt "
                         f"({', '.join(SUPPORTED_MODULES)}): start without --enable-lora")
    return targets


class LoRAManager:
    """The adapters in one worker's device slots."""

    def __init__(self, model: nn.Module, config: LoRAConfig, hf_config: Any,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.hf_config = hf_config
        self.device = device
        self.batch = LoRABatch(use_kernels=device.type == "cuda")
        self.targets = attach_lora(model, self.batch, config, dtype, device)
        # Adapter id -> slot, least recently used first.
        self.slot_of: OrderedDict[int, int] = OrderedDict()
        # Adapters read from disk, least recently used first (at most max_cpu_loras).
        self.host_cache: OrderedDict[int, AdapterWeights] = OrderedDict()
        num_layers = len({id(lora) for lora, _ in self.targets.values()})
        logger.info("LoRA: %d adapted layers, %d slots of rank %d", num_layers,
                    config.max_loras, config.max_lora_rank)

    @property
    def loaded_ids(self) -> list[int]:
        """Adapter ids in device slots, least recently used first."""
        return list(self.slot_of)

    def prepare(self, requests: Sequence[LoRARequest | None], num_tokens: Sequence[int],
                in_use: set[int]) -> None:
        """Set the step's mapping: ``requests[i]`` (``None``: no adapter) takes
        ``num_tokens[i]`` rows, in batch order. ``in_use``: the adapter ids of every request
        the runner holds (their slots are never evicted)."""
        slots = [-1 if r is None else self._slot_for(r, in_use) for r in requests]
        self.batch.mapping = LoRAMapping.from_requests(slots, num_tokens, self.device)

    def finish_step(self) -> None:
        """Clear the mapping: layers add nothing outside a LoRA step."""
        self.batch.mapping = None

    @property
    def active(self) -> bool:
        """Whether the prepared step has rows with an adapter."""
        return self.batch.mapping is not None

    def _slot_for(self, request: LoRARequest, in_use: set[int]) -> int:
        lora_id = request.lora_int_id
        if lora_id in self.slot_of:
            self.slot_of.move_to_end(lora_id)
            return self.slot_of[lora_id]
        if len(self.slot_of) < self.config.max_loras:
            slot = min(set(range(self.config.max_loras)) - set(self.slot_of.values()))
        else:
            victim = next((i for i in self.slot_of if i not in in_use), None)
            assert victim is not None, (
                f"adapter {request.lora_name!r} needs a slot but all {self.config.max_loras} "
                "hold adapters of running requests (the scheduler admits at most max_loras)")
            slot = self.slot_of.pop(victim)
            logger.debug("LoRA: adapter %d leaves slot %d", victim, slot)
        self._load_into(slot, self._read(request))
        self.slot_of[lora_id] = slot
        logger.debug("LoRA: adapter %r (%d) in slot %d", request.lora_name, lora_id, slot)
        return slot

    def _read(self, request: LoRARequest) -> AdapterWeights:
        lora_id = request.lora_int_id
        weights = self.host_cache.get(lora_id)
        if weights is None:
            weights = load_adapter_weights(request.lora_name, request.lora_path,
                                           self.config.max_lora_rank, self.hf_config)
            self.host_cache[lora_id] = weights
            while len(self.host_cache) > (self.config.max_cpu_loras or 1):
                self.host_cache.popitem(last=False)
        self.host_cache.move_to_end(lora_id)
        return weights

    def _load_into(self, slot: int, weights: AdapterWeights) -> None:
        layers = {id(lora): lora for lora, _ in self.targets.values()}
        for lora in layers.values():
            lora.clear_slot(slot)
        on_other_stage = getattr(self.model, "_on_other_stage", None)
        for module, (a, b) in weights.modules.items():
            target = self.targets.get(module)
            if target is None:
                if on_other_stage is not None and on_other_stage(f"{module}.weight"):
                    continue  # another pipeline stage's layer
                raise ValueError(f"LoRA adapter at {weights.info.path}: the model has no "
                                 f"adaptable layer {module!r}")
            lora, shard = target
            lora.set_shard(slot, shard, a.to(self.device), b.to(self.device),
                           weights.info.scale)
