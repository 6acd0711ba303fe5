"""autopar: a compiler for distributed training of unmodified PyTorch models.

Layers: ``autopar.core`` (mesh, graph IR, ``autopar::*`` ops, layouts, schedules)
is imported by ``autopar.passes`` (graph rewrites) and ``autopar.runtime``
(execution), which never import each other; the rest of ``autopar`` composes
them. The entry points are imported on first use.

The repository keeps ``passes/`` and ``runtime/`` beside ``autopar/``;
installed, they are ``autopar/passes`` and ``autopar/runtime`` (pyproject's
``package-dir``). Imported straight from a source checkout (``pyproject.toml``
beside this package: the repository root on ``sys.path``, nothing installed, or
another checkout installed), the checkout's root is one more place this
package's submodules are found, so ``autopar.passes`` is the ``passes/`` of the
checkout ``autopar`` itself came from; nothing is imported for it.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

if (Path(__file__).resolve().parent.parent / "pyproject.toml").is_file():  # a source checkout (module doc)
    __path__.append(str(Path(__file__).resolve().parent.parent))

from autopar.core.errors import CaptureError, RankError, UnsupportedError  # noqa: E402
from autopar.core.mesh import Mesh  # noqa: E402

_LAZY = {
    "parallelize": "autopar.parallel",
    "ParallelModel": "autopar.parallel",
    "Parallelism": "autopar.options",
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
