"""The engine layer, above ``EngineCore``: turning requests into outputs for users.

Holds what runs in the front-end process: incremental detokenization and stop strings
(``detokenizer``), output processing and the ``LLMEngine`` facade.
"""
