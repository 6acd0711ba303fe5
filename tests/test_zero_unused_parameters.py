"""ZeRO leaves parameters that get no gradient as one device does: the optimizer skips them.

A parameter unused in forward (a leftover head, an extra parameter of a layer: DDP's ``find_unused_parameters``
case) or read only detached has ``grad=None`` on one device, so AdamW's weight decay and momentum never touch it. ZeRO steps flat
shards in which its elements sit beside used parameters' elements, with zeros for a gradient; stages 1-3 decayed
it (and SGD's weight decay moved it) silently before ``runtime/zero_untouched.py``.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import models
from autopar import Mesh
from autopar.core.zero_layout import FlatGroup
from autopar.runtime.zero import check_optimizer
from autopar.runtime.zero_untouched import HeldElements, local_spans
from autopar.testing import assert_equivalent

X = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
Y = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))


class ExtraParameter(nn.Module):
    """Two layers, the first with a parameter forward never reads (one flat group with used ones at every
    stage), the second with one it reads only detached (no gradient either), and a whole unused Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])
        self.layers[0].register_parameter("extra", nn.Parameter(torch.randn(5)))
        self.layers[1].register_parameter("gain", nn.Parameter(torch.rand(6) + 0.5))
        self.unused = nn.Linear(6, 4)
        self.out = nn.Linear(6, 3)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.layers[0](x))
        x = torch.tanh(self.layers[1](x)) * self.layers[1].gain.detach()
        return self.out(x)


def sgd_decay(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_unused_parameters_keep_their_values_under_adamw(launcher, zero: int) -> None:
    assert_equivalent(ExtraParameter, Mesh(dp=2), (X,), Y, models.mse, models.adamw, steps=3, rtol=1e-9,
                      atol=1e-10, launcher=launcher, zero=zero)


def test_unused_parameters_with_tp_clipping_and_sgd_weight_decay(launcher) -> None:
    assert_equivalent(ExtraParameter, Mesh(dp=2, tp=2), (X,), Y, models.mse, sgd_decay, steps=3, rtol=1e-9,
                      atol=1e-10, launcher=launcher, zero=2, max_grad_norm=0.05)


def test_held_elements_and_their_new_state_are_restored_after_a_step() -> None:
    """Group ``a`` (4 elements), ``b`` (3), padded to 8 over 2 ranks: rank 0 holds a, rank 1 b and the padding."""
    spec = FlatGroup("g", ("a", "b"), ((4,), (3,)), torch.float64, 2)
    assert local_spans(spec, 1, [1]) == [(0, 3)]
    assert local_spans(spec, 0, [1]) == [] and local_spans(spec, 1, [0]) == [] and local_spans(spec, 0, [0]) == [(0, 4)]
    shard = nn.Parameter(torch.arange(4, dtype=torch.float64))
    shard.grad = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    opt = torch.optim.AdamW([shard], lr=0.1, weight_decay=0.5)
    held = HeldElements()
    held.hold(opt, [shard], shard, local_spans(spec, 1, [1]))
    opt.step()
    held.restore(opt)
    assert shard[:3].tolist() == [0.0, 1.0, 2.0] and shard[3] != 3.0
    assert opt.state[shard]["exp_avg"][:3].tolist() == [0.0] * 3


def test_an_optimizer_factory_ignoring_its_argument_is_named() -> None:
    """``lambda params: AdamW(model.parameters())`` would step the model's tensors, which ZeRO does not feed."""
    model = ExtraParameter()
    with pytest.raises(ValueError, match="built AdamW on 10 parameter\\(s\\) it was not given: it must use its "
                                         "argument"):
        check_optimizer(lambda params: torch.optim.AdamW(model.parameters()), [nn.Parameter(torch.zeros(1))], 2)
