"""Process groups per mesh axis, bound to the running job.

``join(mesh)`` joins (or starts, under torchrun's ``env://``) the default
process group, checks the world size against the mesh, and creates one group
per axis group. ``torch.distributed.new_group`` must be called by every rank
for every group in the same order, so all groups are created on all ranks and
each rank keeps its own.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.core.mesh import AXES, Mesh

TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("AUTOPAR_TIMEOUT_S", "300")))


@dataclass(frozen=True)
class Groups:
    """The process groups of one rank: ``groups[axis]`` (None for an axis of size 1)."""

    mesh: Mesh
    rank: int
    by_axis: dict[str, dist.ProcessGroup | None]
    device: torch.device

    def __getitem__(self, axis: str) -> dist.ProcessGroup | None:
        return self.by_axis[axis]

    def coord(self, axis: str) -> int:
        return self.mesh.coords(self.rank)[axis]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def ensure_initialized() -> None:
    """Joins the job: no-op when a process group exists, ``env://`` under torchrun, else a clear error."""
    if dist.is_available() and dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(default_backend(), timeout=TIMEOUT)
        return
    raise RuntimeError(
        "no process group: running a parallel model needs a launched job; start the script with "
        "torchrun --nproc-per-node=N or call it through autopar.launch(fn, nprocs=N). "
        "Compile-time inspection (pm.plan, pm.graph(rank)) needs neither."
    )


def join(mesh: Mesh) -> Groups:
    ensure_initialized()
    mesh.check_world_size(dist.get_world_size())
    rank = dist.get_rank()
    by_axis: dict[str, dist.ProcessGroup | None] = dict.fromkeys(AXES)
    for axis in mesh.names:
        if mesh[axis] == 1:
            continue
        for ranks in mesh.groups(axis):
            group = dist.new_group(ranks) if len(ranks) < mesh.size else dist.group.WORLD
            if rank in ranks:
                by_axis[axis] = group
    if dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    return Groups(mesh=mesh, rank=rank, by_axis=by_axis, device=device)
