"""Process groups per mesh axis, bound to the running job, and the device each rank computes on.

``join(mesh)`` joins (or starts, under torchrun's ``env://``) the default
process group, checks the world size against the mesh, and creates one group
per axis group (under hybrid sharding also per ``dp_replicate`` and ``dp_shard``
group, under expert parallelism per ``ep`` and ``ep_replicate`` group, under context parallelism per
``dp_cp`` group, and per ``cp_ring`` and ``cp_a2a`` group under ``Mesh(cp=(ring, a2a))``).
``torch.distributed.new_group`` must be called by every rank
for every group in the same order, so all groups are created on all ranks and
each rank keeps its own.

Where a rank computes is decided here and nowhere else (``rank_device``): the
job's choice (``AUTOPAR_DEVICE``: "cpu" or "cuda"; ``autopar.launch(..., device=)``
sets it), else CUDA under NCCL and the CPU under other backends. NCCL needs a
GPU per rank; gloo also carries CUDA tensors, so ranks can share one GPU over
gloo. gloo's send and receive read host memory only: pipeline messages between
ranks on CUDA travel through the CPU there (``message_device``).
"""
from __future__ import annotations

import datetime
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autopar.core.mesh import AXES, CP_SUBAXES, DP_CP, DP_SHARD_CP, DP_SUBAXES, EP_SUBAXES, Coords, Mesh

TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("AUTOPAR_TIMEOUT_S", "300")))
DEVICE_ENV = "AUTOPAR_DEVICE"
DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class Groups:
    """The process groups of one rank: ``groups[axis]`` (None for an axis or dp sub-axis of size 1)."""

    mesh: Mesh
    rank: int
    by_axis: dict[str, dist.ProcessGroup | None]
    device: torch.device  # where this rank computes
    wire: torch.device  # where its pipeline messages travel (``message_device``)

    def __getitem__(self, axis: str) -> dist.ProcessGroup | None:
        return self.by_axis[axis]

    @property
    def coords(self) -> Coords:
        """This rank's index on every mesh axis."""
        return self.mesh.coords(self.rank)

    def coord(self, axis: str) -> int:
        """This rank's index on ``axis`` or dp sub-axis (a variable; ``coords.pp`` where it is not)."""
        return self.mesh.coord(self.rank, axis)


def requested_device() -> str | None:
    """The job's choice of device type (``AUTOPAR_DEVICE``), or None to follow the backend."""
    value = os.environ.get(DEVICE_ENV, "").strip().lower() or None
    if value is not None and value not in DEVICE_TYPES:
        raise ValueError(f"{DEVICE_ENV}={value!r}: the ranks compute on 'cpu' or 'cuda'; unset it to use CUDA "
                         "under NCCL and the CPU under gloo")
    return value


def default_backend(device: str | None = None) -> str:
    """NCCL where the ranks compute on CUDA and NCCL is built in, else gloo."""
    cuda = torch.cuda.is_available() if device is None else device == "cuda"
    return "nccl" if cuda and torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def rank_device(backend: str, local_rank: int, device: str | None = None) -> torch.device:
    """The device a rank of a ``backend`` job computes on: ``device`` ("cpu" or "cuda") when given, else CUDA
    under NCCL and the CPU otherwise. A CUDA rank takes GPU ``local_rank`` modulo the GPUs it sees: under
    gloo, ranks beyond the GPU count share GPUs; NCCL needs one GPU per rank."""
    nccl = "nccl" in backend
    kind = device or ("cuda" if nccl else "cpu")
    if kind not in DEVICE_TYPES:
        raise ValueError(f"device={kind!r}: the ranks compute on 'cpu' or 'cuda'")
    if kind == "cpu":
        if nccl:
            raise ValueError(f"backend {backend!r} communicates CUDA tensors only, and the ranks were asked to "
                             "compute on the CPU; use backend='gloo' for CPU ranks")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"the ranks were asked to compute on CUDA ({backend}), and this machine has no usable GPU "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); use device='cpu' with gloo")
    count = torch.cuda.device_count()
    if nccl and local_rank >= count:
        raise ValueError(f"NCCL needs one GPU per rank: local rank {local_rank} of this machine, and it has {count} "
                         f"GPU{'s' if count != 1 else ''}; start at most {count} ranks per machine, or let ranks "
                         "share GPUs over gloo (autopar.launch(fn, n, backend='gloo', device='cuda'))")
    return torch.device("cuda", local_rank % count)


def message_device(backend: str, device: torch.device) -> torch.device:
    """Where point-to-point messages of a rank on ``device`` live: gloo sends and receives host memory only."""
    return torch.device("cpu") if "nccl" not in backend else device


def job_device() -> torch.device:
    """This process's device: ``rank_device`` of the running job (or, before one exists, of the job this
    process would start), its local rank and ``AUTOPAR_DEVICE``."""
    initialized = dist.is_available() and dist.is_initialized()
    device = requested_device()
    backend = dist.get_backend() if initialized else default_backend(device)
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank() if initialized else 0))
    return rank_device(backend, local, device)


def use_device(device: torch.device) -> None:
    """Makes ``device`` this process's current CUDA device (NCCL, barriers and object collectives use it)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def start_job(backend: str, device: torch.device, **init: Any) -> None:
    """Starts this process's default process group on ``backend`` (``init``: store, rank, world_size), with
    ``device`` current first, so that NCCL's communicators are created on the rank's own GPU."""
    use_device(device)
    dist.init_process_group(backend, timeout=TIMEOUT, **init)


def ensure_initialized() -> None:
    """Joins the job: no-op when a process group exists, ``env://`` under torchrun, else a clear error."""
    if dist.is_available() and dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _warn_restarts_on_a_shared_store()
        start_job(default_backend(requested_device()), job_device())
        return
    raise RuntimeError(
        "no process group: running a parallel model needs a launched job; start the script with "
        "torchrun --nproc-per-node=N or call it through autopar.launch(fn, nprocs=N). "
        "Compile-time inspection (pm.plan, pm.graph(rank)) needs neither."
    )


def _warn_restarts_on_a_shared_store() -> None:
    """torchrun with restarts and its agent's store shared with the ranks (torch's default since 2.5): the ranks
    of a restart may read the previous attempt's addresses from that store (pytorch/pytorch#135712)."""
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0):
        warnings.warn("torchrun --max-restarts with the rendezvous store shared with the ranks: a restarted job "
                      "may connect to the previous attempt's addresses and fail to start; run torchrun with "
                      "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (docs/user_guide.md, \"Elastic "
                      "training\")", stacklevel=3)


def job_store() -> Any:
    """The key-value store the job's ranks met through (the default process group's, under none of its
    prefixes), under a prefix of torchrun's restart count: an attempt never reads the one before."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return attempt_store(store)


def attempt_store(root: Any) -> Any:
    """``root`` under this attempt's prefix (``job_store``)."""
    return dist.PrefixStore(f"autopar{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", root)


def join(mesh: Mesh) -> Groups:
    ensure_initialized()
    mesh.check_world_size(dist.get_world_size())
    rank = dist.get_rank()
    by_axis: dict[str, dist.ProcessGroup | None] = dict.fromkeys(AXES + DP_SUBAXES + EP_SUBAXES + CP_SUBAXES
                                                                 + (DP_CP, DP_SHARD_CP))
    experts = tuple(a for a in EP_SUBAXES if a != "ep_shard" or mesh.hybrid) if mesh.ep > 1 else ()
    for axis in (mesh.names + (DP_SUBAXES if mesh.hybrid else ()) + experts
                 + ((DP_CP,) if mesh.cp > 1 else ()) + ((DP_SHARD_CP,) if mesh.cp > 1 and mesh.hybrid else ())
                 + (CP_SUBAXES if mesh.cp_split else ())):
        if mesh[axis] == 1 and axis != "ep_replicate":  # (expert gradients are averaged over it even alone)
            continue
        for ranks in mesh.groups(axis):
            group = dist.new_group(ranks) if len(ranks) < mesh.size else dist.group.WORLD
            if rank in ranks:
                by_axis[axis] = group
    device = job_device()
    use_device(device)
    return Groups(mesh=mesh, rank=rank, by_axis=by_axis, device=device,
                  wire=message_device(dist.get_backend(), device))
