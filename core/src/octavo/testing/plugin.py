"""pytest plugin of Octavo's backend conformance kit.

Installed with the core as the ``pytest11`` entry point ``octavo``, so in any environment
with ``octavo-core``::

    pytest --octavo-backend NAME --pyargs octavo.testing.conformance

runs the suite every backend must pass against the installed backend ``NAME`` (see
``octavo backends``). The option is resolved at start-up: a backend that is not installed or
not available here is a usage error, not a run of skipped tests. Without the option the plugin
does nothing (collecting the suite then fails, asking for it).

What the suite checks is derived from the backend's declared ``BackendCapabilities``
(``octavo.testing.plan``); the header of the run prints it. Importing this module is cheap:
pytest loads it in every session of the environment.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

    from octavo.testing.plan import ConformancePlan

#: The package holding the conformance tests (``--pyargs`` takes it).
SUITE = "octavo.testing.conformance"

_PLAN_KEY = pytest.StashKey["ConformancePlan"]()

# Test arguments parametrized from the plan: name -> (plan attribute, id prefix).
_PLAN_PARAMETERS = {
    "octavo_kernel_dtype": ("kernel_dtypes", ""),
    "octavo_kernel_head_dim": ("kernel_head_dims", "d"),
    "octavo_kernel_block_size": ("kernel_block_sizes", "bs"),
    "octavo_tensor_parallel_size": ("tensor_parallel_sizes", "tp"),
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("octavo", "Octavo backend conformance (octavo.testing)")
    group.addoption(
        "--octavo-backend", metavar="NAME", default=None,
        help="installed Octavo backend the conformance suite checks; run it with "
        f"`pytest --octavo-backend NAME --pyargs {SUITE}`",
    )


@pytest.hookimpl(trylast=True)  # after plugins that may register backends in process
def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("octavo_backend", None) is not None:
        conformance_plan(config)  # a wrong name stops the run before collection


def pytest_report_header(config: pytest.Config) -> list[str]:
    if config.getoption("octavo_backend", None) is None:
        return []
    plan = conformance_plan(config)
    return [
        f"octavo conformance: backend {plan.backend} (device type {plan.device_type})",
        (f"  kernels: dtypes {', '.join(plan.kernel_dtypes)}; head dims "
         f"{', '.join(map(str, plan.kernel_head_dims))}; block sizes "
         f"{', '.join(map(str, plan.kernel_block_sizes))}"),
        (f"  engines: {plan.model_dtype} "
         f"({'exact greedy ids' if plan.exact else 'with tolerance'}), "
         f"head dim {plan.model_head_dim}, block size {plan.block_size}"),
        (f"  tensor parallelism: {', '.join(map(str, plan.tensor_parallel_sizes))} ranks"
         if plan.tensor_parallel_sizes else
         "  tensor parallelism: not checked (fewer than two devices here)"),
    ]


def conformance_plan(config: pytest.Config) -> ConformancePlan:
    """The plan of the backend named by ``--octavo-backend`` (resolved once per session).

    Raises ``pytest.UsageError`` when the option is missing, or the backend is not installed,
    not available here, or declares nothing the suite can check.
    """
    if _PLAN_KEY in config.stash:
        return config.stash[_PLAN_KEY]
    name = config.getoption("octavo_backend", None)
    if name is None:
        raise pytest.UsageError(
            "the Octavo conformance suite needs the backend to check: "
            f"pytest --octavo-backend NAME --pyargs {SUITE} (`octavo backends` lists them)"
        )
    from octavo.backends.selection import BackendNotAvailableError, select_backend
    from octavo.plugins import get_plugin_manager
    from octavo.testing.plan import plan_for

    try:
        plan = plan_for(select_backend(get_plugin_manager(), name))
    except (BackendNotAvailableError, ValueError) as exc:
        raise pytest.UsageError(f"--octavo-backend {name}: {exc}") from exc
    config.stash[_PLAN_KEY] = plan
    return plan


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Checks the plan has no configuration for (e.g. tensor parallelism with one device) are
    deselected, not skipped: the header says they were not run."""
    if config.getoption("octavo_backend", None) is None:
        return
    plan = conformance_plan(config)
    dropped = []
    for name, (attribute, _) in _PLAN_PARAMETERS.items():
        if not getattr(plan, attribute):
            dropped += [item for item in items if name in getattr(item, "fixturenames", ())]
    if dropped:
        items[:] = [item for item in items if item not in dropped]
        config.hook.pytest_deselected(items=dropped)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize the kernel tests with the dtypes, head dims and block sizes of the plan."""
    wanted = [name for name in _PLAN_PARAMETERS if name in metafunc.fixturenames]
    if not wanted:
        return
    plan = conformance_plan(metafunc.config)
    for name in wanted:
        attribute, prefix = _PLAN_PARAMETERS[name]
        values = getattr(plan, attribute) or [None]  # None: deselected at collection
        metafunc.parametrize(name, values, ids=[f"{prefix}{v}" for v in values])


@pytest.fixture(scope="session")
def octavo_plan(request: pytest.FixtureRequest) -> ConformancePlan:
    """What the suite checks for the backend under test."""
    return conformance_plan(request.config)


@pytest.fixture(scope="session")
def octavo_pm():
    """The process-wide plugin manager (the one engines use) with the backend under test."""
    from octavo.plugins import get_plugin_manager

    return get_plugin_manager()


@pytest.fixture(scope="session")
def octavo_tiny_model(
    octavo_plan: ConformancePlan, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """``get(arch)`` -> folder of a tiny random-weight ``arch`` checkpoint (float32 weights,
    hidden size 64, 2 layers, 4 query / 2 KV heads of the plan's head size), made once."""
    from octavo.testing.tiny_models import make_tiny_model

    folders: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in folders:
            folder = tmp_path_factory.mktemp(f"octavo-tiny-{arch}")
            folders[arch] = make_tiny_model(folder, arch, head_dim=octavo_plan.model_head_dim)
        return folders[arch]

    return get


@pytest.fixture(scope="session")
def octavo_tiny_llama(octavo_tiny_model: Callable[[str], Path]) -> Path:
    """Folder of the tiny Llama checkpoint the engine-level checks run on."""
    return octavo_tiny_model("llama")


@pytest.fixture(scope="session")
def octavo_device(octavo_plan: ConformancePlan, octavo_pm, octavo_tiny_model) -> torch.device:
    """The device the backend's worker picks in ``init_device`` (kernel tests run there)."""
    from octavo.testing.engines import engine_config, make_worker

    worker = make_worker(octavo_pm, engine_config(octavo_plan, octavo_tiny_model("llama")))
    worker.init_device()
    device = worker.device
    worker.shutdown()
    return device
