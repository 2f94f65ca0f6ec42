"""The conformance kit itself (``octavo.testing``): its plan, its usage errors, its 16-bit
path, and that it catches a broken kernel.

Conformance runs go through ``run_conformance`` (a fresh pytest process each); the backends
under test that are not installed packages come from ``tests/testing/fake_backends.py``
through a written entry point.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from octavo.backends.backend import Availability, Backend, BackendCapabilities
from octavo.testing import run_conformance
from octavo.testing.plan import plan_for
from octavo.testing.plugin import SUITE

from tests.testing.fake_backends import write_entry_points

REPO = Path(__file__).resolve().parents[2]


def _backend(capabilities, name="dev") -> Backend:
    return Backend(name=name, device_type="cpu", priority=0,
                   is_available=lambda: Availability(True, "test"), package="test",
                   capabilities=capabilities)


# ---- the plan -----------------------------------------------------------------------------------


def test_plan_of_a_backend_that_accepts_anything():
    plan = plan_for(_backend(BackendCapabilities(dtypes=("float32", "bfloat16", "float16"))))
    assert plan.kernel_dtypes == ("float32", "bfloat16", "float16")
    assert plan.kernel_head_dims == (64, 128) and plan.model_head_dim == 64
    assert plan.kernel_block_sizes == (4, 16)
    assert (plan.block_size, plan.small_block_size) == (16, 4)
    assert plan.model_dtype == "float32" and plan.exact
    assert plan.max_num_seqs == 16 and plan.prompt_logprobs and plan.num_logprobs == 5


def test_plan_follows_declared_sizes_and_limits():
    caps = SimpleNamespace(  # the fields another version of the core may declare
        dtypes=("bfloat16", "float16"), head_dims=(16, 80, 128, 256), block_sizes=(8, 32, 64),
        max_num_seqs=4, max_model_len=96, prompt_logprobs=False, max_logprobs=2,
    )
    plan = plan_for(_backend(caps))
    assert plan.kernel_dtypes == ("bfloat16", "float16")
    assert plan.model_dtype == "bfloat16" and not plan.exact
    assert plan.kernel_head_dims == (16, 128) and plan.model_head_dim == 16
    assert plan.kernel_block_sizes == (8,) and (plan.block_size, plan.small_block_size) == (8, 8)
    assert (plan.max_num_seqs, plan.max_model_len) == (4, 96)
    assert not plan.prompt_logprobs and plan.num_logprobs == 2


def test_plan_reads_capabilities_of_an_older_core_defensively():
    plan = plan_for(_backend(SimpleNamespace(dtypes=("float32",))))  # no other field at all
    assert plan.kernel_head_dims == (64, 128) and plan.kernel_block_sizes == (4, 16)
    assert plan.max_num_seqs == 16 and plan.prompt_logprobs


def test_plan_refuses_a_backend_without_a_dtype_the_kit_knows():
    with pytest.raises(ValueError, match="float8"):
        plan_for(_backend(SimpleNamespace(dtypes=("float8",))))


# ---- usage errors -------------------------------------------------------------------------------


def test_the_suite_without_a_backend_asks_for_one(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", SUITE, "--collect-only", "-q",
         "-p", "no:cacheprovider"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode != 0
    assert "needs the backend to check: pytest --octavo-backend NAME" in done.stdout + done.stderr


def test_an_unknown_backend_is_a_usage_error_not_a_run():
    report = run_conformance("no-such-backend", timeout_s=300)
    assert report.returncode == pytest.ExitCode.USAGE_ERROR and report.cases == ()
    assert not report.ok
    assert "--octavo-backend no-such-backend" in report.output
    assert "not installed" in report.output


# ---- runs on fake backends ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def fake_backends_env(tmp_path_factory) -> dict[str, str]:
    folder = write_entry_points(tmp_path_factory.mktemp("fake-backends"))
    paths = [str(folder), str(REPO), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def test_a_16_bit_only_backend_is_checked_with_tolerances(fake_backends_env):
    # The kernel module runs in bfloat16 for the cpu backend too; the engine-level modules are
    # the ones with a separate 16-bit path.
    report = run_conformance("cpu16", "-k", "not test_attention", env=fake_backends_env,
                             timeout_s=600)
    assert report.ok, report.summary()
    assert "bfloat16 (with tolerance)" in report.output  # the run's header
    assert report.modules >= {"test_worker", "test_hf_equivalence", "test_engine_equivalence",
                              "test_abort"}
    assert not report.with_outcome("skipped"), report.summary()


def test_a_kernel_that_drops_the_cached_prefix_fails_the_suite(fake_backends_env):
    report = run_conformance(
        "prefix-blind", "-k", "paged_attention and float32 or greedy_ids or tiny_token_budget",
        env=fake_backends_env, timeout_s=600)
    assert not report.ok
    failed = {case.test_id for case in report.with_outcome("failed")}
    passed = {case.test_id for case in report.with_outcome("passed")}
    # Every workload with a chunk after a cached prefix fails, in every configuration ...
    for case in ("chunked-prefill", "mixed", "shared-prefix"):
        hits = [t for t in failed if t.endswith(f"-{case}]")]
        assert len(hits) == 4, (case, sorted(failed))
    # ... while fresh prompts followed by decodes are right, and pass.
    assert len([t for t in passed if t.endswith("-prefill-then-decode]")]) == 4
    # End to end: whole prompts at the default token budget match Hugging Face, but chunked
    # prefill under a tiny budget changes the output.
    assert len([t for t in passed if "greedy_ids" in t]) == 2, report.summary()
    assert [t for t in failed if "tiny_token_budget" in t], report.summary()
