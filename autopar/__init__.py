"""autopar: a compiler for distributed training of unmodified PyTorch models.

Layers: ``autopar.core`` (mesh, graph IR, ``autopar::*`` ops, layouts, schedules)
is imported by ``autopar.passes`` (graph rewrites) and ``autopar.runtime``
(execution), which never import each other; the rest of ``autopar`` composes
them. The entry points are imported on first use.

The repository keeps ``passes/`` and ``runtime/`` beside ``autopar/``;
installed, they are ``autopar/passes`` and ``autopar/runtime`` (pyproject's
``package-dir``). Imported straight from a source checkout (the repository root
on ``sys.path``, nothing installed), ``_adopt_checkout_subpackages`` maps them
to the same names.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

SUBPACKAGES = ("passes", "runtime")  # top-level folders of the repository, installed as autopar.<name>


def _adopt_checkout_subpackages() -> None:
    """In a source checkout (``pyproject.toml`` beside this package), import ``../<name>`` as ``autopar.<name>``."""
    here = Path(__file__).resolve().parent
    root = here.parent
    if not (root / "pyproject.toml").is_file():
        return  # installed: autopar/passes and autopar/runtime are ordinary subpackages
    for name in SUBPACKAGES:
        qualified, init = f"{__name__}.{name}", root / name / "__init__.py"
        if qualified in sys.modules or (here / name).exists() or not init.is_file():
            continue
        spec = importlib.util.spec_from_file_location(qualified, init, submodule_search_locations=[str(init.parent)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        spec.loader.exec_module(module)
        globals()[name] = module


_adopt_checkout_subpackages()

from autopar.core.errors import CaptureError, RankError, UnsupportedError  # noqa: E402
from autopar.core.mesh import Mesh  # noqa: E402

_LAZY = {
    "parallelize": "autopar.parallel",
    "ParallelModel": "autopar.parallel",
    "launch": "autopar.runtime.launch",
    "WorkerPool": "autopar.runtime.launch",
    "testing": "autopar.testing",
    "plan": "autopar.planner",
    "Cluster": "autopar.planner.cluster",
}

__all__ = ["CaptureError", "Mesh", "RankError", "UnsupportedError", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    return module if name == "testing" else getattr(module, name)
