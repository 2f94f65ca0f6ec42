"""A launched step whose sampled tokens are still on the device.

With async scheduling the engine schedules and launches step N+1 before it reads step N's
tokens back, so the host work of one step overlaps the device work of the other. The pieces
here keep that safe:

- ``octavo.transfer.DeviceToHostCopy`` starts the copies of a step's results into pinned host
  memory as soon as they are enqueued; reading them waits for those copies only, never for
  later work queued on the stream (a plain ``.tolist()`` would wait for step N+1 too).
- ``PendingStepOutput`` turns those host copies into a ``ModelRunnerOutput`` once, appending
  each sampled token to the runner's per-request state. Steps resolve strictly in launch
  order (each resolves the one before it first), so tokens are appended in order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from octavo.messages import ModelRunnerOutput
from octavo.transfer import DeviceToHostCopy


class PendingStepOutput:
    """One launched step's output; ``result()`` waits for its copies and records its tokens.

    ``finalize`` receives the host copies and returns the step's ``ModelRunnerOutput``; it
    runs once, after the previous step's ``finalize``.
    """

    def __init__(
        self,
        copies: DeviceToHostCopy | None,
        finalize: Callable[[list[torch.Tensor]], ModelRunnerOutput],
        previous: StepOutput | None,
        sampled_token_ids: torch.Tensor | None,
    ) -> None:
        self._copies = copies
        self._finalize: Callable[[list[torch.Tensor]], ModelRunnerOutput] | None = finalize
        self._previous = previous
        self._output: ModelRunnerOutput | None = None
        # [num sampling requests] on the device: where the next step reads the inputs of
        # requests whose token is not on the host yet.
        self.sampled_token_ids = sampled_token_ids

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> PendingStepOutput:
        """An output that needs no device work (an empty step)."""
        pending = cls(None, lambda _: output, None, None)
        pending.result()
        return pending

    @property
    def is_resolved(self) -> bool:
        return self._output is not None

    def wait_previous(self) -> None:
        """Resolve every step launched before this one."""
        if self._previous is not None:
            self._previous.result()
            self._previous = None

    def result(self) -> ModelRunnerOutput:
        """Wait for this step (and resolve earlier ones first); idempotent."""
        if self._output is None:
            self.wait_previous()
            assert self._finalize is not None
            host = self._copies.wait() if self._copies is not None else []
            self._output = self._finalize(host)
            self._finalize = None
            self._copies = None
        return self._output


class _LaterStepOutput:
    """A step output that stands for another one, attached later (``attach``)."""

    # Why nothing was attached, for the error when the output is read anyway.
    _never = "the step was never launched"

    def __init__(self) -> None:
        self._inner: StepOutput | None = None

    def attach(self, inner: StepOutput) -> None:
        self._inner = inner

    def _attached(self) -> StepOutput:
        if self._inner is None:
            raise RuntimeError(self._never)
        return self._inner

    @property
    def sampled_token_ids(self) -> torch.Tensor | None:
        return self._attached().sampled_token_ids

    @property
    def is_resolved(self) -> bool:
        return self._inner is not None and self._inner.is_resolved

    def wait_previous(self) -> None:
        self._attached().wait_previous()

    def result(self) -> ModelRunnerOutput:
        return self._attached().result()


class DeferredStepOutput(_LaterStepOutput):
    """A launched step whose sampling is launched later (``ModelRunner.sample_tokens``), once
    the engine core has its grammar bitmasks; it stands for the ``PendingStepOutput`` attached
    then."""

    _never = "the step's sampling was never launched (sample_tokens)"

    def __init__(self, previous: StepOutput | None) -> None:
        super().__init__()
        # The step launched before this one (its sampling resolves it first).
        self.previous = previous

    def attach(self, inner: StepOutput) -> None:
        super().attach(inner)
        self.previous = None

    def wait_previous(self) -> None:
        if self._inner is not None:
            self._inner.wait_previous()
        elif self.previous is not None:
            self.previous.result()


class PreparedStepOutput(_LaterStepOutput):
    """A step prepared while the sampling of the step before it waits for its grammar masks
    (``ModelRunner.execute_model_async`` then, ``sample_tokens`` launches both): it stands
    for the step output its launch gives."""

    _never = "the step was prepared but never launched (sample_tokens)"


# What ModelRunner.execute_model_async returns.
StepOutput = PendingStepOutput | DeferredStepOutput | PreparedStepOutput
