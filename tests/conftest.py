from __future__ import annotations

import os

import pytest
import transformers  # noqa: F401 - imported before the pool starts, so that its fork server preloads it
from hypothesis import HealthCheck, settings

from autopar.runtime.launch import WorkerPool

settings.register_profile("default", max_examples=6, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("slow", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("slow" if os.environ.get("AUTOPAR_SLOW") else "default")


def pytest_configure(config: pytest.Config) -> None:
    """``-m slow`` runs the property tests with the slow profile's examples too."""
    expr = config.getoption("markexpr") or ""
    if "slow" in expr and "not slow" not in expr:
        settings.load_profile("slow")

POOL_SIZE = 8
# the tests run their ranks on the CPU (over gloo) on any machine; benchmarks/gpu_check.py runs the CUDA path
os.environ.setdefault("AUTOPAR_DEVICE", "cpu")
os.environ.setdefault("AUTOPAR_CHECK_PASSES", "1")  # each compiler pass's invariant checked (autopar/compiler.py)
os.environ.setdefault("AUTOPAR_DESYNC_CHECK_S", "1")  # ranks out of step looked for after 1 s (runtime/progress.py)


@pytest.fixture(scope="session")
def pool() -> WorkerPool:
    """Worker processes that live for the whole test session; each test job rendezvous anew."""
    with WorkerPool(POOL_SIZE) as p:
        yield p


@pytest.fixture(scope="session")
def launcher(pool: WorkerPool):
    return pool.launch
