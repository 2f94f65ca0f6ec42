"""Batched sampling: logits of one step in, one token per sequence (and logprobs) out."""

from octavo.sample.logprobs import LogprobsTensors, compute_logprobs
from octavo.sample.metadata import (
    DeviceGrammarMasks,
    GrammarRows,
    SamplingMetadata,
    SamplingRow,
    step_seed,
)
from octavo.sample.sampler import Sampler, SamplerOutput

__all__ = [
    "DeviceGrammarMasks",
    "GrammarRows",
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRow",
    "compute_logprobs",
    "step_seed",
]
