"""Root of the repository's test tree (``tests/`` and each ``backends/<dev>/tests/``).

Its only job: pytest puts this folder on ``sys.path`` when it loads this file, so the backend
packages' tests import the shared helpers (``tests.helpers``, ``tests.kernels.conftest``)
however pytest is started. Fixtures live in ``tests/conftest.py``.
"""
