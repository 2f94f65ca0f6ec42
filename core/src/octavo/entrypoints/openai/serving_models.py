"""The names a server answers to: the base model's and its LoRA adapters' (vLLM's
``OpenAIServingModels``).

A request picks an adapter by giving its name as ``model``; ``/v1/models`` lists the base
names and every adapter (``parent``: the base model). Adapters come from ``--lora-modules``
(``name=path`` or vLLM's JSON ``{"name": ..., "path": ..., "base_model_name": ...}``) and,
with ``OCTAVO_ALLOW_RUNTIME_LORA_UPDATING=1``, from ``POST /v1/load_lora_adapter``; each one
gets a fresh ``lora_int_id``, so a name loaded again after an unload never reuses the old
adapter's device slot or cached prefix blocks.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from octavo.entrypoints.openai.errors import OpenAIError
from octavo.errors import InvalidRequestError
from octavo.lora_request import LoRARequest


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str]) -> list[LoRAModulePath]:
    """``--lora-modules`` values: ``name=path`` or a JSON object with ``name`` and ``path``
    (and optionally ``base_model_name``). ``ValueError`` names a bad entry."""
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                data = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"--lora-modules {value!r}: not valid JSON ({exc})") from None
            if (not isinstance(data, dict) or not isinstance(data.get("name"), str)
                    or not isinstance(data.get("path"), str)):
                raise ValueError(f"--lora-modules {value!r}: a JSON entry needs string 'name' "
                                 "and 'path' fields")
            base = data.get("base_model_name")
            modules.append(LoRAModulePath(data["name"], data["path"],
                                          base if isinstance(base, str) else None))
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: expected name=path or a JSON object "
                             '{"name": ..., "path": ...}')
        modules.append(LoRAModulePath(name, path))
    names = [m.name for m in modules]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"--lora-modules names {duplicates} more than once")
    return modules


class ServingModels:
    """Base model names and LoRA adapters by the name clients use.

    :param check_adapter: checks a new adapter (``Processor.check_lora``: raises
        ``InvalidRequestError``); ``None`` when the engine runs without LoRA.
    """

    def __init__(self, base_model_names: list[str], check_adapter=None) -> None:
        self.base_model_names = list(base_model_names)
        self.check_adapter = check_adapter
        self.lora_requests: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    @property
    def lora_enabled(self) -> bool:
        return self.check_adapter is not None

    def resolve(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """(name to answer with, adapter or None) of a request's ``model``; 404 if unknown."""
        if model is None:
            return self.base_model_names[0], None
        if model in self.base_model_names:
            return model, None
        lora = self.lora_requests.get(model)
        if lora is not None:
            return model, lora
        served = self.base_model_names + sorted(self.lora_requests)
        raise OpenAIError(f"the model {model!r} does not exist; this server serves {served}",
                          404, param="model", code="model_not_found")

    def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check and register an adapter; ``OpenAIError`` 400 when LoRA is off, the name is
        taken or the adapter is bad."""
        if self.check_adapter is None:
            raise OpenAIError("this server runs without LoRA: start it with --enable-lora", 400,
                              param="lora_name", code="lora_disabled")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise OpenAIError("lora_name and lora_path must be non-empty strings", 400,
                              param="lora_name" if not name else "lora_path")
        if name in self.lora_requests or name in self.base_model_names:
            raise OpenAIError(f"the LoRA adapter {name!r} has already been loaded", 400,
                              param="lora_name", code="lora_already_loaded")
        lora = LoRARequest(name, next(self._ids), path,
                           base_model_name or self.base_model_names[0])
        try:
            self.check_adapter(lora)
        except InvalidRequestError as exc:
            raise OpenAIError(exc.message, 400, param="lora_path", code=exc.code) from None
        self.lora_requests[name] = lora
        return lora

    def remove_lora(self, name: str) -> None:
        """Forget an adapter (requests running with it finish with it); 404 if unknown."""
        if name not in self.lora_requests:
            raise OpenAIError(f"the LoRA adapter {name!r} is not loaded", 404,
                              param="lora_name", code="lora_not_found")
        del self.lora_requests[name]
