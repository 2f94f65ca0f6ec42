"""Octavo: an LLM inference engine with pluggable hardware backends.

    import octavo
    llm = octavo.LLM()                      # default model, best available backend
    print(llm.generate("Hello", octavo.SamplingParams(max_tokens=20))[0].outputs[0].text)
"""

from octavo.lora_request import LoRARequest
from octavo.outputs import CompletionOutput, Logprob, RequestOutput
from octavo.sampling_params import SamplingParams, StructuredOutputsParams
from octavo.version import __version__

__all__ = ["LLM", "LLMEngine", "CompletionOutput", "Logprob", "LoRARequest", "RequestOutput", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str):
    # Heavy modules (torch, transformers) load only when the engine is asked for.
    if name == "LLM":
        from octavo.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from octavo.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'octavo' has no attribute {name!r}")
