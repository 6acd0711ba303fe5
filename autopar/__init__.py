"""autopar: a compiler for distributed training of unmodified PyTorch models.

``runtime`` and ``passes`` import autopar's core types, so the entry points
that need them are imported on first use; any import order works.
"""
from __future__ import annotations

import importlib
from typing import Any

from autopar.errors import CaptureError, RankError
from autopar.mesh import Mesh

_LAZY = {
    "parallelize": "autopar.parallel",
    "ParallelModel": "autopar.parallel",
    "launch": "runtime.launch",
    "WorkerPool": "runtime.launch",
    "testing": "autopar.testing",
    "plan": "autopar.planner",
    "Cluster": "autopar.planner.cluster",
}

__all__ = ["CaptureError", "Mesh", "RankError", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    return module if name == "testing" else getattr(module, name)
