"""Octavo's backend conformance kit: the tests every backend must pass, as a pytest plugin.

A backend author checks an installed backend with::

    pytest --octavo-backend NAME --pyargs octavo.testing.conformance

(the option comes from ``octavo.testing.plugin``, registered as a ``pytest11`` entry point of
``octavo-core``), or from their own tests with ``run_conformance(NAME)``, which runs the same
command in a fresh process and returns a ``ConformanceReport``.

Modules: ``plugin`` (option, fixtures), ``plan`` (what is checked, from the backend's
capabilities), ``conformance`` (the tests), ``paged_steps`` (kernel workloads), ``compare``
(tolerances), ``hf_reference`` (transformers as the reference), ``engines`` and
``engine_checks`` (engines of the backend under test, the no-leak invariant),
``tiny_models`` (tiny random-weight checkpoints), ``device_memory``, ``runner``.
"""

from octavo.testing.runner import CaseResult, ConformanceReport, run_conformance

__all__ = ["CaseResult", "ConformanceReport", "run_conformance"]
