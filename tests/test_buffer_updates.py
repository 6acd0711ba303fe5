"""Buffers updated in forward (a step counter, BatchNorm's running statistics): capture finds every one, whether
export returns its new value or keeps an in-place operator on it; pipelines and microbatches, which would update
them otherwise than one device does (once per step on the whole batch), are refused by name; recomputation runs
the layers that update them without recomputing them, float64 exact."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import models
from autopar import Mesh, UnsupportedError, parallelize
from autopar.compiler.capture import capture
from autopar.testing import assert_equivalent
from harness.exactness import IDS, TARGET

X = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
Y = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(6))


class Counted(nn.Module):
    """A step counter and a running average of the embeddings, both updated in place in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(96, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 96)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(16))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.count += 1
        x = self.emb(ids)  # (B, S, 16)
        self.ema.mul_(0.9).add_(0.1 * x.detach().mean((0, 1)))
        return self.head(torch.tanh(self.mid(x * (1 + 0.1 * self.count) + self.ema)))


class CountedBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.register_buffer("n", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        return x + self.fc2(F.gelu(self.fc1(x))) * (1 + 0.05 * self.n)


class NormBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(d, d), nn.BatchNorm1d(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.bn(self.fc(x)))


class Stack(nn.Module):
    """Layers (a module list) that update buffers of their own."""

    def __init__(self, block: type[nn.Module], d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.layers = nn.ModuleList([block(d) for _ in range(2)])
        self.out = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)  # (B, d)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def counted() -> nn.Module:
    torch.manual_seed(0)
    return Counted().double()


def stack(block: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return Stack(block).double()


STATISTICS = [f"layers.{i}.bn.{b}" for i in range(2) for b in ("running_mean", "running_var", "num_batches_tracked")]


def test_capture_finds_buffers_updated_in_place() -> None:
    assert capture(counted(), (IDS,)).updated_buffers == ["count", "ema"]
    assert capture(stack(CountedBlock), (X,)).updated_buffers == ["layers.0.n", "layers.1.n"]
    assert capture(stack(NormBlock), (X,)).updated_buffers == STATISTICS
    assert capture(stack(NormBlock).eval(), (X,)).updated_buffers == []
    assert capture(models.cnn(), (torch.randn(4, 3, 8, 8, dtype=torch.float64),)).updated_buffers == \
        ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]


def _compile(model: nn.Module, mesh: Mesh, inputs: torch.Tensor, target: torch.Tensor, loss: object,
             **options: object) -> None:
    pm = parallelize(model, mesh, loss_fn=loss, optimizer=models.adamw, **options)
    pm.compile((inputs,), target=target)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_pipeline_refuses_a_model_that_updates_buffers(microbatches: int) -> None:
    with pytest.raises(UnsupportedError, match=r"Mesh\(pp=2\): the model updates buffers in forward \(count, ema\), "
                       r"which pipelines do not support; use pp=1"):
        _compile(counted(), Mesh(pp=2), IDS, TARGET, models.lm_loss, microbatches=microbatches)
    with pytest.raises(UnsupportedError, match=r"\(layers.0.bn.running_mean, .* and 2 more\), which pipelines"):
        _compile(stack(NormBlock), Mesh(pp=2), X, Y, models.mse, microbatches=microbatches)


@pytest.mark.parametrize("mesh", [Mesh(dp=1), Mesh(dp=2)], ids=str)
def test_microbatches_refuse_a_model_that_updates_buffers(mesh: Mesh) -> None:
    with pytest.raises(UnsupportedError, match=r"microbatches=2: the model updates buffers in forward \(count, "
                       r"ema\), which each microbatch's forward would update again.*pass microbatches=1"):
        _compile(counted(), mesh, IDS, TARGET, models.lm_loss, microbatches=2)
    with pytest.raises(UnsupportedError, match=r"microbatches=2: .*\(layers.0.n, layers.1.n\).*pass microbatches=1"):
        _compile(stack(CountedBlock), mesh, X, Y, models.mse, microbatches=2)


@pytest.mark.parametrize("block, mesh", [(CountedBlock, Mesh(dp=2)), (CountedBlock, Mesh(tp=2)),
                                         (NormBlock, Mesh(tp=2))],  # (dp: BatchNorm on each rank's own rows)
                         ids=lambda x: getattr(x, "__name__", str(x)))
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_keeps_the_layers_that_update_buffers(launcher, block: type[nn.Module], mesh: Mesh,
                                                           mode: str) -> None:
    """Running such a layer again in backward would update its buffers twice (and autograd refuses the tensor
    it saved, since modified): it keeps its activations instead, and training equals one device's."""
    assert_equivalent(lambda: stack(block), mesh, (X,), Y, models.mse, models.adamw, steps=2, rtol=1e-9,
                      atol=1e-10, launcher=launcher, recompute=mode)



def test_the_planner_marks_pipelines_and_microbatches_not_runnable_for_such_a_model() -> None:
    """``parallelize(model, "auto")`` runs the best runnable plan: one with pp > 1 or microbatches for a model that
    updates buffers would be refused, so the planner says why and does not offer it."""
    from autopar.planner import plan

    result = plan(stack(CountedBlock), 4, cluster="cpu", global_batch=8, example_inputs=(X,), precision="fp64",
                  top=None)
    assert result.profile.updated_buffers == ("layers.0.n", "layers.1.n")
    staged = [c for c in result.candidates if c.config.pp > 1 or c.config.microbatches > 1]
    assert staged and all("updates buffers in forward (layers.0.n, layers.1.n)" in c.not_runnable for c in staged)
    assert any(not c.not_runnable for c in result.candidates)


class Clipped(nn.Module):
    """A weight clipped in place in forward (a WGAN critic's constraint)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc, self.head = nn.Embedding(96, 16), nn.Linear(16, 16), nn.Linear(16, 96)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc.weight.clamp_(-0.05, 0.05)
        return self.head(torch.tanh(self.fc(self.emb(ids))))


@pytest.mark.parametrize("mesh", [Mesh(dp=2), Mesh(tp=2)], ids=["dp2", "tp2"])
def test_a_parameter_written_in_forward_is_refused_by_name(mesh: Mesh) -> None:
    """Every rank failed at its first step with torch's "a leaf Variable that requires grad is being used in an
    in-place operation" (one device runs it under no_grad)."""
    pm = parallelize(Clipped().double(), mesh, loss_fn=models.lm_loss, optimizer=models.adamw)
    with pytest.raises(UnsupportedError, match=r"writes its parameter fc.weight in place in forward "
                                               r"\(aten.clamp_.default in the model \(Clipped\)\).*parametrize"):
        pm.compile((IDS,), {}, TARGET)
