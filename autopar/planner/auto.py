"""``parallelize(model, "auto")``: the best configuration autopar runs for the running job.

``auto_choice`` plans for the job's world size on a cluster preset that
resembles this machine (the local GPU model, or CPU ranks sharing its cores),
for the model's own dtype (or ``precision="bf16"``) and optimizer, and keeps only configurations
autopar's runtime runs today.

Invariant: every rank gets the same choice (rank 0's is broadcast when a
process group is up). ``auto_parallelism`` (what ``parallelize`` calls) plans on rank 0 alone: the other
ranks wait for its choice instead of planning the same job again beside it, on the cores it profiles on.
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from autopar.core.recompute_modes import MODES
from autopar.planner.cluster import Cluster
from autopar.planner.cost_model import PRECISIONS, precision_of
from autopar.planner.example_inputs import sequence_of
from autopar.options import Parallelism
from autopar.planner.search import Candidate, PlanResult, evaluate, plan


def auto_choice(model: torch.nn.Module, spec: str, *, example_inputs: tuple | None, example_kwargs: dict | None,
                optimizer: Callable | None, precision: str = "fp32", recompute: object = None,
                batch: str = "global", compile: bool = False) -> Candidate:
    """The best configuration autopar runs for the job's world size (``parallelize(model, "auto")``).

    ``recompute``: the user's choice; a mode is planned as given, a per-layer choice as "none" (it applies as
    given), and ``None`` lets the planner choose among "none", "selective" and "full". ``batch``: as
    ``parallelize``'s; under "local" the example's batch is each data-parallel rank's, and configurations are
    ranked by the time per local batch (``plan(local_batch=)``). ``compile``: planned as compiled steps
    (``plan(compile=True)``), and the chosen ``parallelism`` asks for them.

    Every rank plans the same way; under a running job rank 0's choice is
    broadcast so that all ranks agree even if two plans tie.
    """
    result = _plan(model, spec, example_inputs=example_inputs, example_kwargs=example_kwargs, optimizer=optimizer,
                   precision=precision, recompute=recompute, batch=batch, compile=compile)
    chosen = result.best
    if dist.is_available() and dist.is_initialized():
        box = [chosen.config]
        dist.broadcast_object_list(box, src=0)
        if box[0] != chosen.config:
            chosen = evaluate(result.cost, box[0], result.cluster, result.precision, result.profile) or chosen
            chosen.compiled = compile
    return chosen


def _plan(model: torch.nn.Module, spec: str, *, example_inputs: tuple | None, example_kwargs: dict | None,
          optimizer: Callable | None, precision: str = "fp32", recompute: object = None, batch: str = "global",
          compile: bool = False) -> PlanResult:
    """This process's plan for the job (no broadcast)."""
    if spec != "auto":
        raise ValueError(f"mesh {spec!r} is not a Mesh; pass autopar.Mesh(...) or the string 'auto'")
    if example_inputs is None:
        raise ValueError(f"parallelize(model, 'auto') needs example_inputs=(...) (a {batch} batch) to plan for its "
                         "batch and sequence sizes")
    devices = _world_size()
    first = next((a for a in example_inputs if isinstance(a, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        raise ValueError("parallelize(model, 'auto') needs a tensor input with the batch in dim 0")
    seq = first.shape[1] if sequence_of(example_inputs) else None
    # the profile's capture needs a batch of 2, whatever the global one: every input with the batch dim is cut
    small, small_kwargs = pytree.tree_map(lambda a: _two_rows(a, first.shape[0]), (tuple(example_inputs),
                                                                                   example_kwargs or {}))
    states = _optimizer_states(optimizer)
    cluster = _local_cluster(devices)
    rows = {"local_batch" if batch == "local" else "global_batch": first.shape[0]}
    result = plan(model, devices, cluster=cluster, **rows, seq_len=seq,
                  precision=PRECISIONS[precision] if precision in ("bf16", "mixed")
                  else precision_of(next(model.parameters()).dtype),
                  optimizer=states,
                  example_inputs=small, example_kwargs=small_kwargs, runnable_only=True,
                  recompute=MODES if recompute is None else (recompute if recompute in MODES else "none",),
                  compile=compile)
    return result


def auto_parallelism(model: torch.nn.Module, spec: str, **kw: object) -> Parallelism:
    """``auto_choice(model, spec, **kw).parallelism``, planned by rank 0 alone under a running job of more than
    one rank and broadcast to the others. Where rank 0's planning fails, every rank raises its error (the
    others a ``RuntimeError`` that carries rank 0's message): no rank is left waiting."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return auto_choice(model, spec, **kw).parallelism
    box: list[object] = [None]
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = _plan(model, spec, **kw).best.parallelism
        except Exception as e:  # noqa: BLE001 - sent to the other ranks, raised below on rank 0 itself
            failure, box[0] = e, _Failed(f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if isinstance(box[0], _Failed):
        raise RuntimeError(f"parallelize(model, 'auto'): rank 0's planning failed, so this rank has no "
                           f"configuration to run:\n{box[0].message}")
    return box[0]


class _Failed:
    """What rank 0 broadcasts in place of a choice when its planning raised."""

    def __init__(self, message: str) -> None:
        self.message = message


def _two_rows(x: object, batch: int) -> object:
    """The first two rows of a tensor whose dim 0 is the batch; anything else unchanged."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != batch:
        return x
    return x[:2] if x.shape[0] >= 2 else torch.cat([x, x])[:2]


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    raise ValueError("parallelize(model, 'auto') plans for the job's world size, but no job is running "
                     "(no process group, no WORLD_SIZE); launch the script with torchrun or autopar.launch, "
                     "or call autopar.plan(model, devices=N, ...) and pass its best mesh")


def _optimizer_states(optimizer: Callable | None) -> str:
    if optimizer is None:
        return "sgd"
    from autopar.options import Options
    from autopar.compiler.program import optimizer_state_factor

    return {2: "adam", 1: "sgd-momentum", 0: "sgd"}[optimizer_state_factor(Options(optimizer=optimizer))]


def _local_cluster(devices: int) -> Cluster:
    """The preset nearest this job's machines: CPU ranks sharing this node's cores, or the local GPU model."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", devices))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return Cluster.preset("dgx-a100").replace(name=f"local {props.name}", memory=0.93 * props.total_memory,
                                                  devices_per_node=per_node)
    return Cluster.preset("cpu").replace(devices_per_node=per_node, cores=os.cpu_count() or 1)
