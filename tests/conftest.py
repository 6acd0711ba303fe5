from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import transformers  # noqa: F401 - imported before the pool starts, so that its fork server preloads it
from hypothesis import HealthCheck, settings

from autopar.core.shared_dir import SOLVED_DIR
from autopar.runtime import launch
from autopar.runtime.launch import WorkerPool

# what the tests' rank jobs import, imported once by the rank workers' fork server rather than by each worker
# on its first job (each a second or so of every worker's start): the Hugging Face code of the models, the
# export's tracer (torch imports it on the first export), and pytest and the models of the tests, which a worker
# imports with the first function of a test module it runs
launch.PRELOAD = (*launch.PRELOAD, "transformers.modeling_utils", "transformers.models.gpt2.modeling_gpt2",
                  "transformers.models.llama.modeling_llama", "transformers.models.bert.modeling_bert",
                  "torch.export._trace", "pytest", "models")

settings.register_profile("default", max_examples=6, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("slow", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("slow" if os.environ.get("AUTOPAR_SLOW") else "default")


def pytest_configure(config: pytest.Config) -> None:
    """``-m slow`` runs the property tests with the slow profile's examples too. The run's processes (pytest's
    workers and their ranks) share one directory of sharding solutions (``AUTOPAR_SOLVED_DIR``,
    passes/sharding_program.py): a program that the ranks of a job, or another test, solve alike is solved once."""
    expr = config.getoption("markexpr") or ""
    if "slow" in expr and "not slow" not in expr:
        settings.load_profile("slow")
    if hasattr(config.option, "loadscopereorder"):  # (pytest-xdist: keep the order of the files below)
        config.option.loadscopereorder = False
    if not os.environ.get(SOLVED_DIR):  # (pytest-xdist's workers inherit the first process's)
        os.environ[SOLVED_DIR] = config._autopar_solved = tempfile.mkdtemp(prefix="autopar-solved-")


# Files whose few tests run long (interpreters started, eight ranks, long training; 12-140 s each in a loaded
# two-process run): pytest-xdist hands files out in order, so these start first and no process is left running
# one of them alone at the end while the other has finished.
LONG_FILES = ("test_launch.py", "test_3d.py", "test_recompute_memory.py", "test_train_lm.py",
              "test_planner_bound.py")


@pytest.hookimpl(trylast=True)  # (after -m has deselected)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long files first (longest first), then the others by their number of tests, most first (what
    pytest-xdist's ``--loadscope-reorder`` does, turned off in ``pytest_configure`` so that this order holds)."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1
    def order(item: pytest.Item) -> tuple:
        name = item.path.name
        return (LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES), -counts[name], name)
    items.sort(key=order)


def pytest_unconfigure(config: pytest.Config) -> None:
    if getattr(config, "_autopar_solved", None):
        shutil.rmtree(config._autopar_solved, ignore_errors=True)
        del os.environ[SOLVED_DIR]

POOL_SIZE = 8
# the tests run their ranks on the CPU (over gloo) on any machine; benchmarks/gpu_check.py runs the CUDA path
os.environ.setdefault("AUTOPAR_DEVICE", "cpu")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # compile=True: no pool of compile workers per rank
os.environ.setdefault("AUTOPAR_CHECK_PASSES", "1")  # each compiler pass's invariant checked (autopar/compiler/driver.py)
os.environ.setdefault("AUTOPAR_DESYNC_CHECK_S", "1")  # ranks out of step looked for after 1 s (runtime/progress.py)


@pytest.fixture(scope="session")
def pool() -> WorkerPool:
    """Worker processes that live for the whole test session; each test job rendezvous anew."""
    with WorkerPool(POOL_SIZE) as p:
        yield p


@pytest.fixture(scope="session")
def launcher(pool: WorkerPool):
    return pool.launch
