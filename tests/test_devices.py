"""Devices: one place decides where a rank computes; graphs captured on one device run on another.

The CUDA paths are checked here by their decisions (GPUs are simulated by patching ``torch.cuda``) and by
moving captured graphs to the meta device, which fails on any argument left on the CPU. Running on GPUs:
``benchmarks/gpu_check.py``.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils import _pytree as pytree

import models
from autopar import Mesh, WorkerPool, launch, parallelize
from autopar.compiler.capture import capture
from autopar.passes.device import retarget_device
from autopar.runtime import groups
from autopar.runtime.groups import default_backend, message_device, rank_device, requested_device

CPU, META = torch.device("cpu"), torch.device("meta")


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    """``gpus(n)`` makes torch see ``n`` CUDA devices (0: none)."""
    def see(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    return see


def test_without_gpus_ranks_compute_on_the_cpu_over_gloo(gpus) -> None:
    gpus(0)
    assert default_backend() == "gloo" and rank_device("gloo", 3) == CPU
    with pytest.raises(ValueError, match="no usable GPU.*device='cpu'"):
        rank_device("gloo", 0, "cuda")
    with pytest.raises(ValueError, match="no usable GPU"):
        rank_device("nccl", 0)


def test_nccl_gives_each_rank_its_own_gpu_and_gloo_may_share_them(gpus) -> None:
    gpus(2)
    assert default_backend() == "nccl" and default_backend("cpu") == "gloo" and default_backend("cuda") == "nccl"
    assert [rank_device("nccl", r) for r in (0, 1)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(ValueError, match="NCCL needs one GPU per rank: local rank 2 .* 2 GPUs.*backend='gloo'"):
        rank_device("nccl", 2)
    assert [rank_device("gloo", r, "cuda").index for r in range(4)] == [0, 1, 0, 1]  # four ranks on two GPUs
    assert rank_device("gloo", 3) == CPU  # gloo computes on the CPU unless asked
    with pytest.raises(ValueError, match="CUDA tensors only.*backend='gloo'"):
        rank_device("nccl", 0, "cpu")
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        rank_device("gloo", 0, "tpu")


def test_gloo_messages_travel_through_host_memory() -> None:
    cuda = torch.device("cuda", 1)
    assert message_device("gloo", cuda) == CPU and message_device("nccl", cuda) == cuda
    assert message_device("gloo", CPU) == CPU


def test_the_job_chooses_its_device_by_environment(monkeypatch: pytest.MonkeyPatch, gpus) -> None:
    gpus(1)
    monkeypatch.setenv(groups.DEVICE_ENV, "cpu")
    assert requested_device() == "cpu" and groups.job_device() == CPU  # a CUDA machine's ranks kept on the CPU
    monkeypatch.setenv(groups.DEVICE_ENV, "gpu")
    with pytest.raises(ValueError, match="AUTOPAR_DEVICE='gpu'"):
        requested_device()


def _where() -> tuple[str, str]:
    return str(groups.job_device()), dist.get_backend()


def test_launch_runs_the_ranks_where_it_is_told() -> None:
    assert launch(_where, 2, device="cpu") == [("cpu", "gloo"), ("cpu", "gloo")]
    with pytest.raises(ValueError, match="CUDA tensors only"):  # refused before any process starts
        WorkerPool(2, backend="nccl", device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no usable GPU"):
            WorkerPool(2, backend="nccl", device="cuda")


def _graph_devices(gm: fx.GraphModule) -> set[torch.device]:
    return {a for m in gm.modules() if isinstance(m, fx.GraphModule) for nd in m.graph.nodes
            for a in pytree.tree_leaves((nd.args, nd.kwargs)) if isinstance(a, torch.device)}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_graph_captured_on_the_cpu_runs_on_another_device(name: str) -> None:
    """The capture writes the CPU into position ids, RoPE tables and metadata checks; moved, the graph runs
    on the meta device (where any argument left on the CPU fails), and not before."""
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    cap = capture(getattr(models, name)(), (ids,), with_loss=True, loss_fn=models.lm_loss, target=ids)
    assert CPU in _graph_devices(cap.gm)
    args = [torch.empty(nd.meta["val"].shape, dtype=nd.meta["val"].dtype, device=META)
            for nd in cap.gm.graph.nodes if nd.op == "placeholder"]
    with pytest.raises(Exception):  # noqa: B017 - whichever op meets the CPU first
        cap.gm(*args)
    assert retarget_device(cap.gm, CPU, META) > 0
    assert _graph_devices(cap.gm) == {META}
    (loss,) = [t for t in pytree.tree_leaves(cap.gm(*args)) if t.dim() == 0]
    assert loss.device == META
    assert retarget_device(cap.gm, CPU, META) == 0  # nothing left to move


def test_recomputed_regions_and_constants_move_with_the_program() -> None:
    ids = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(0))
    pm = parallelize(models.llama(), Mesh(dp=2), example_inputs=(ids,), example_target=ids, loss_fn=models.lm_loss,
                     optimizer=models.sgd, recompute="full")
    program = pm.compile((ids,), target=ids)
    assert program.device == CPU and CPU in _graph_devices(pm.graph(1))
    program.move_to(1, META)
    assert program.device == META and _graph_devices(pm.graph(1)) == {META}
    assert any(isinstance(m, fx.GraphModule) and m is not pm.graph(1) for m in pm.graph(1).modules())  # (nested)
    assert all(t.device == META for t in program.captured.constants.values())
