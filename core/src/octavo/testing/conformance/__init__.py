"""The backend conformance suite: run ``pytest --octavo-backend NAME --pyargs octavo.testing.conformance``.

One module per area: ``test_attention`` (kernels against the reference), ``test_memory``
(KV-cache sizing), ``test_worker`` (worker lifecycle), ``test_hf_equivalence`` (greedy ids and
logprobs against Hugging Face transformers), ``test_engine_equivalence`` (prefix caching,
chunked prefill, preemption), ``test_abort`` (no leaked blocks) and ``test_parallel`` (two
ranks equal one, where the backend can have two here).
"""
