"""A parameter that only some inputs read trains under ZeRO-3 as on one device.

Each input signature compiles a program of its own; a parameter read for wide inputs only gets no gradient in
the narrow inputs' steps (the optimizer skips it on one device) and one in the wide ones'. ZeRO-3 reduces whole
layers in the graph, so the step asks the running program which parameters it sends no gradient to
(``zero_compile.unused_parameters``): the first program's answer held the parameter in the wide inputs' steps too.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import models
from autopar import Mesh, parallelize

WIDTHS = (6, 6, 7, 6)
Y = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))


class WideOnly(nn.Module):
    """Reads ``layers.0.gain`` only for inputs of more than 6 columns."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])
        self.layers[0].register_parameter("gain", nn.Parameter(torch.rand(6) + 0.5))
        self.out = nn.Linear(6, 3)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[0](x[:, :6]))
        if x.shape[1] > 6:
            h = h * self.layers[0].gain
        return self.out(torch.tanh(self.layers[1](h)))


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, w, dtype=torch.float64, generator=g) for w in WIDTHS]


def _optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)  # (no step count: Adam's is per shard)


def _train(zero: int) -> dict[str, torch.Tensor]:
    pm = parallelize(WideOnly(), Mesh(dp=2), loss_fn=models.mse, optimizer=_optimizer, zero=zero)
    for x in _inputs():
        pm.step(x, target=Y)
    return pm.state_dict()


def test_a_parameter_read_by_some_inputs_only_trains_as_on_one_device(launcher) -> None:
    model = WideOnly()
    opt = _optimizer(list(model.parameters()))
    for x in _inputs():
        models.mse(model(x), Y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for state in launcher(_train, 2, 3):
        for name, want in model.state_dict().items():
            torch.testing.assert_close(state[name], want, rtol=1e-12, atol=1e-12, msg=name)


def _warned(zero: int) -> list[str]:
    import warnings

    pm = parallelize(WideOnly(), Mesh(dp=2), loss_fn=models.mse, optimizer=models.adamw, zero=zero)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in _inputs():
            pm.step(x, target=Y)
    return [str(w.message) for w in caught if "got a gradient in some steps and none in others" in str(w.message)]


@pytest.mark.parametrize("zero", [1, 3])
def test_adams_step_count_for_such_a_parameter_is_named(launcher, zero: int) -> None:
    """Adam's bias correction follows the flat shard's step count, which counts every step: the parameter read
    in some steps only is named once, on every rank."""
    for found in launcher(_warned, 2, zero):
        assert len(found) == 1 and "layers.0.gain" in found[0], found
