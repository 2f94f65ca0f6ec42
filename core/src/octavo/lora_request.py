"""``LoRARequest``: which LoRA adapter a request runs with (vLLM's class and field names).

A leaf message (msgspec, so it crosses process boundaries inside ``EngineCoreRequest`` and
``SchedulerOutput``): the engine identifies an adapter by ``lora_int_id``, which keys its
device slot and its prefix-cache blocks; ``lora_path`` is where its PEFT files are read from.
"""

from __future__ import annotations

import msgspec

from octavo.errors import InvalidRequestError


class LoRARequest(msgspec.Struct, frozen=True):
    """One adapter: ``LoRARequest("sql", 1, "/adapters/sql")``.

    Two requests with the same ``lora_int_id`` share the adapter's device slot and cached
    prefix blocks, so an id must always name the same weights (the server gives every adapter
    it loads a fresh id).
    """

    # Name a user knows it by (the server's ``model`` value).
    lora_name: str
    # Positive id, unique per adapter for the engine's life.
    lora_int_id: int
    # Folder holding adapter_config.json and adapter_model.safetensors (PEFT format).
    lora_path: str = ""
    # The base model it was trained on (shown as ``parent`` in /v1/models; informational).
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError("lora_name must be a non-empty string", param="lora_name")
        if (isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int)
                or self.lora_int_id < 1):
            raise InvalidRequestError(
                f"lora_int_id must be a positive integer, got {self.lora_int_id!r}",
                param="lora_int_id")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidRequestError(
                f"LoRA adapter {self.lora_name!r}: lora_path must name the adapter's folder",
                param="lora_path")
