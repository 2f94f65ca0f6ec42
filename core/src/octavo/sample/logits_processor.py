"""Logits processors that plugins register and requests select by name.

A plugin registers a ``LogitsProcessor`` subclass through the ``octavo_register_logits_processors``
hook; a request names it in ``SamplingParams.logits_processors`` (a name, or a name with keyword
arguments). The front end checks names and arguments at admission (``LogitsProcessorRegistry``);
each worker makes one instance per processor on first use and, every step, calls ``apply`` once
per processor with all the rows that selected it: one batched call on the device, never a
Python loop over the vocabulary.

A row that selects several processors gets them in its order: the sampler applies every row's
first processor, then every row's second, and so on (rows are grouped by processor within
each round).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy
import torch

from octavo.errors import InvalidRequestError
from octavo.sampling_params import LogitsProcessorSpec
from octavo.transfer import host_to_device

if TYPE_CHECKING:
    from octavo.sample.metadata import SamplingRow


@dataclass(slots=True)
class LogitsProcessorRow:
    """What a processor sees of one row of the batch."""

    # The request's keyword arguments for this processor (checked by validate_kwargs).
    kwargs: dict[str, Any]
    # The prompt's token ids, and the tokens generated so far (before the one sampled now).
    prompt_token_ids: list[int]
    output_token_ids: list[int]


class LogitsProcessor(ABC):
    """A batched transformation of logits; subclass it and register it by name.

    Contract: one instance per worker, built with ``(vocab_size, device)``; ``apply`` gets the
    float32 logits of the rows that selected it (a copy: it may change them in place) and
    returns the processed logits of the same shape. It runs before the penalties, temperature
    and filtering, for greedy and sampled rows alike; logprobs are unaffected (they describe
    the model's own distribution). The rows carry their generated tokens on the host: the
    engine waits for tokens still in flight before a step that uses a processor.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    @classmethod
    def validate_kwargs(cls, kwargs: dict[str, Any]) -> None:
        """Raise ``ValueError`` saying what is wrong with a request's arguments (at admission,
        in the front end). The default accepts none."""
        if kwargs:
            raise ValueError(f"takes no arguments, got {sorted(kwargs)}")

    @abstractmethod
    def apply(self, logits: torch.Tensor, rows: list[LogitsProcessorRow]) -> torch.Tensor:
        """``logits``: ``[len(rows), vocab]`` float32 on the device; return the processed
        ``[len(rows), vocab]``."""


def registered_logits_processors(pm: pluggy.PluginManager) -> dict[str, type[LogitsProcessor]]:
    """Every processor the plugins register, by name (a name registered twice is an error)."""
    found: dict[str, type[LogitsProcessor]] = {}

    def register(name: str, cls: type[LogitsProcessor]) -> None:
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise TypeError(f"logits processor {name!r}: {cls!r} is not a LogitsProcessor subclass")
        if name in found:
            raise ValueError(f"logits processor {name!r} is registered twice "
                             f"({found[name].__module__} and {cls.__module__})")
        found[name] = cls

    pm.hook.octavo_register_logits_processors(register=register)
    return found


class LogitsProcessorRegistry:
    """The registered processors: checks requests (front end), makes instances (worker)."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.classes = registered_logits_processors(pm)
        self._instances: dict[str, LogitsProcessor] = {}

    def validate(self, specs: list[LogitsProcessorSpec]) -> None:
        """Raise ``InvalidRequestError`` (param ``logits_processors``) for an unknown name or
        arguments its processor refuses."""
        for spec in specs:
            cls = self.classes.get(spec.name)
            if cls is None:
                known = ", ".join(sorted(self.classes)) or "none"
                raise InvalidRequestError(
                    f"unknown logits processor {spec.name!r}; registered: {known}",
                    param="logits_processors")
            try:
                cls.validate_kwargs(dict(spec.kwargs))
            except (TypeError, ValueError) as exc:
                raise InvalidRequestError(f"logits processor {spec.name!r}: {exc}",
                                          param="logits_processors") from None

    def instance(self, name: str, vocab_size: int, device: torch.device) -> LogitsProcessor:
        processor = self._instances.get(name)
        if processor is None:
            processor = self.classes[name](vocab_size, device)
            self._instances[name] = processor
        return processor


@dataclass(slots=True)
class LogitsProcessorBatch:
    """One step's processor calls: per round, per processor, its rows."""

    # [(processor, rows of the batch (on the device), what it sees of each row)] in order.
    calls: list[tuple[LogitsProcessor, torch.Tensor, list[LogitsProcessorRow]]]

    @classmethod
    def from_rows(cls, rows: list[SamplingRow], registry: LogitsProcessorRegistry,
                  vocab_size: int, device: torch.device | str) -> LogitsProcessorBatch | None:
        """The calls for ``rows`` (``None`` when no row selects a processor)."""
        specs = [row.params.logits_processors or [] for row in rows]
        num_rounds = max((len(s) for s in specs), default=0)
        if num_rounds == 0:
            return None
        device = torch.device(device)
        calls = []
        for round_index in range(num_rounds):
            by_name: dict[str, list[int]] = {}
            for i, row_specs in enumerate(specs):
                if round_index < len(row_specs):
                    by_name.setdefault(row_specs[round_index].name, []).append(i)
            for name, indices in by_name.items():
                processor = registry.instance(name, vocab_size, device)
                infos = [LogitsProcessorRow(dict(specs[i][round_index].kwargs),
                                            rows[i].prompt_token_ids, rows[i].output_token_ids)
                         for i in indices]
                index = host_to_device(torch.tensor(indices, dtype=torch.long), device)
                calls.append((processor, index, infos))
        return cls(calls)


def apply_logits_processors(logits: torch.Tensor, batch: LogitsProcessorBatch | None) -> None:
    """Run the step's processor calls on ``logits`` [batch, vocab] float32, in place."""
    if batch is None:
        return
    for processor, index, infos in batch.calls:
        processed = processor.apply(logits.index_select(0, index), infos)
        if processed.shape != (len(infos), logits.shape[1]):
            raise RuntimeError(
                f"logits processor {type(processor).__name__} returned shape "
                f"{tuple(processed.shape)}, expected {(len(infos), logits.shape[1])}")
        logits.index_copy_(0, index, processed.to(logits.dtype))
