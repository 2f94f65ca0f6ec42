"""Building blocks shared by the model definitions: norms, rotary embedding, activations, attention."""

from octavo.model_executor.layers.activation import GeluAndMul, SiluAndMul
from octavo.model_executor.layers.attention import Attention
from octavo.model_executor.layers.rmsnorm import GemmaRMSNorm, RMSNorm
from octavo.model_executor.layers.rotary import (
    SUPPORTED_ROPE_TYPES,
    RopeParameters,
    RotaryEmbedding,
    get_rope,
    rope_parameters_from_config,
)

__all__ = [
    "SUPPORTED_ROPE_TYPES",
    "Attention",
    "GeluAndMul",
    "GemmaRMSNorm",
    "RMSNorm",
    "RopeParameters",
    "RotaryEmbedding",
    "SiluAndMul",
    "get_rope",
    "rope_parameters_from_config",
]
