"""Structured outputs: constrained decoding with a grammar engine (llguidance).

- ``grammar``: a request's ``StructuredOutputsParams`` as a grammar, validated in the front end;
- ``manager``: the engine core's grammars: compiled off the engine loop, one matcher per
  request, the token bitmask of every constrained request of a step, advanced with each
  sampled token. The bitmask is applied by the core's sampler (``octavo.sample``) on the
  device, whatever the backend;
- ``process``: ``GrammarProcess``, the manager's interface with the manager in a process of
  its own (the default under async scheduling, so its work does not share the engine
  thread's GIL);
- ``tokenizer``: ``GrammarTokenizer``, the model's tokenizer as grammars use it, as data (what
  the grammar process receives);
- ``reasoning_gate``: with a reasoning parser, where a constrained request is in its output
  (its grammar starts after the thinking).
"""
