"""autopar: a compiler for distributed training of unmodified PyTorch models."""
from __future__ import annotations

from autopar.errors import CaptureError, RankError
from autopar.mesh import Mesh
from autopar.parallel import ParallelModel, parallelize
from runtime.launch import WorkerPool, launch

__all__ = ["CaptureError", "Mesh", "ParallelModel", "RankError", "WorkerPool", "launch", "parallelize"]
