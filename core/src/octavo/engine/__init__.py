"""The front end, above the engine core (``octavo.engine_core``): requests in, outputs out.

Holds what runs in the front-end process: the one request validator (``processor``), output
processing with incremental detokenization and stop strings (``output_processor``,
``detokenizer``), ``EngineArgs``, and the two engines users drive: ``LLMEngine`` (the engine
core in the same process, behind ``octavo.LLM``) and ``AsyncLLM`` (the engine core in its own
process, behind the OpenAI server).
"""
