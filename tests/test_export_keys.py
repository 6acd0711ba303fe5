"""Two models whose exports differ never share one: each case captures one model, then another that the export of
the first would answer wrongly, and checks the second's graph against the model itself (float64, eager) and a
fresh export (autopar/compiler/export_key.py, autopar/compiler/export_files.py ``digest``)."""
from __future__ import annotations

import contextlib
import functools
import sys
import types
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

import models
from autopar.compiler.capture import capture
from autopar.compiler.capture_cache import EXPORTS
from autopar.core.graph import Captured, SlotKind
from harness.shared_dir import shared_dir

SCALE = 2.0  # read by ``_scaled`` (module level), changed by a test
settings = types.ModuleType("settings")  # a module of settings the forward reads an attribute of
settings.SHIFT = 0.5


def _run(c: Captured, model: torch.nn.Module, inputs: tuple, target: Any = None) -> list[torch.Tensor]:
    """The captured graph run on the model's own tensors: its outputs after the buffers' new values."""
    state = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False)), **c.constants}
    flat = pytree.tree_leaves((inputs, {}, target) if target is not None else (inputs, {}))
    fed = [flat[s.index] if s.kind is SlotKind.INPUT else state[s.name] for s in c.slots]
    return list(c.gm(*fed))[len(c.mutated_buffers):]


def _check_second(first: Callable[[], torch.nn.Module], second: Callable[[], torch.nn.Module],
                  x: torch.Tensor) -> None:
    """``second()``'s capture after ``first()``'s computes what the model does and is the fresh export's graph."""
    EXPORTS.kept.clear()
    capture(first(), (x,))
    model = second()
    got = capture(model, (x,))
    torch.testing.assert_close(_run(got, model, (x,))[0], model(x), rtol=0, atol=0)
    EXPORTS.kept.clear()
    assert got.gm.code == capture(second(), (x,)).gm.code


def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * SCALE + settings.SHIFT


class Scaled(torch.nn.Module):
    factor = 1.0  # a class attribute, read as ``self.factor``

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3, dtype=torch.float64)
        torch.nn.init.eye_(self.lin.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _scaled(self.lin(x)) * self.factor


X = torch.arange(6, dtype=torch.float64).reshape(2, 3) - 2.5


def _setting(name: str, owner: Any, value: Any) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        setattr(owner, name, value)
        return Scaled()
    return make


def test_module_level_values_and_class_attributes_the_code_reads_are_in_the_key() -> None:
    """A global read by a function the forward calls, an attribute of a module it names, a class attribute."""
    module = sys.modules[__name__]
    try:
        for name, owner, one, other in [("SCALE", module, 2.0, 3.0), ("SHIFT", settings, 0.5, 1.5),
                                        ("factor", Scaled, 1.0, -1.0)]:
            _check_second(_setting(name, owner, one), _setting(name, owner, other), X)
            setattr(owner, name, one)
    finally:
        module.SCALE, settings.SHIFT, Scaled.factor = 2.0, 0.5, 1.0


class Activated(torch.nn.Module):
    def __init__(self, act: Callable) -> None:
        super().__init__()
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x)


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


class Chooses(torch.nn.Module):
    choice = staticmethod(_double)  # a class attribute naming one of two functions the model reads anyway

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = _double, _triple

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.choice(x)


def _choosing(f: Callable) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        Chooses.choice = staticmethod(f)
        return Chooses()
    return make


def test_a_class_attribute_naming_a_function_is_keyed_by_that_function() -> None:
    try:
        _check_second(_choosing(_double), _choosing(_triple), X)
    finally:
        Chooses.choice = staticmethod(_double)


def test_a_partial_a_module_holds_is_keyed_by_its_arguments() -> None:
    _check_second(lambda: Activated(functools.partial(F.leaky_relu, negative_slope=0.1)),
                  lambda: Activated(functools.partial(F.leaky_relu, negative_slope=0.2)), X)


def _shifted(x: torch.Tensor) -> torch.Tensor:
    return x + settings.SHIFT


def test_a_function_a_module_holds_is_followed_to_what_it_reads() -> None:
    def make(shift: float) -> Callable[[], torch.nn.Module]:
        def build() -> torch.nn.Module:
            settings.SHIFT = shift
            return Activated(_shifted)
        return build
    try:
        _check_second(make(0.5), make(1.5), X)
    finally:
        settings.SHIFT = 0.5


class Offset(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("by", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.by


OFFSET = Offset()  # a module outside the model, which the model calls: its buffer is a constant of the graph


class CallsOffset(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return OFFSET(x)


def test_a_module_outside_the_model_is_read_by_its_values() -> None:
    def make(by: float) -> Callable[[], torch.nn.Module]:
        def build() -> torch.nn.Module:
            OFFSET.by.fill_(by)
            return CallsOffset()
        return build
    _check_second(make(0.5), make(1.5), X)


class Listed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.helpers = [torch.nn.Linear(3, 3, dtype=torch.float64)]  # a plain list: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.helpers[0](x)


def test_a_module_held_outside_the_model_is_not_keyed_by_its_address() -> None:
    """Its weights are constants of the graph; the same object, new weights, must not get the first graph."""
    model = Listed()
    EXPORTS.kept.clear()
    capture(model, (X,))
    with torch.no_grad():
        model.helpers[0].weight.mul_(2)
    got = capture(model, (X,))
    torch.testing.assert_close(_run(got, model, (X,))[0], model(X), rtol=0, atol=0)


def _wrapped(fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.nn.Module:
    """A function as a module of no tensors, held outside the model (Hugging Face's kernel hub does so)."""
    class Func(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return fn(x)
    return Func()


class HoldsFunc(torch.nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.funcs = {"act": _wrapped(fn)}  # a plain dict: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.funcs["act"](x) * 2


def test_a_function_wrapped_as_a_module_outside_the_model_is_read_by_its_code() -> None:
    """A new wrapper of the same function each time: the export is reused; of another function: it is not."""
    EXPORTS.kept.clear()
    capture(HoldsFunc(torch.tanh), (X,))
    hits = EXPORTS.hits
    capture(HoldsFunc(torch.tanh), (X,))
    assert EXPORTS.hits == hits + 1
    _check_second(lambda: HoldsFunc(torch.tanh), lambda: HoldsFunc(torch.sigmoid), X)


def _not_installed(name: str) -> Any:
    raise ImportError(f"{name} needs a package that is not installed")


lazy = types.ModuleType("lazy")  # a module whose missing attributes import on first use (PEP 562)
lazy.__getattr__ = _not_installed


class ReadsLazy(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + settings.SHIFT if lazy is not None else x


def test_a_module_that_imports_on_first_use_is_read_without_importing() -> None:
    _check_second(ReadsLazy, ReadsLazy, X)


def test_a_0d_tensor_a_module_holds_is_keyed_by_its_value() -> None:
    def scaled(by: float) -> Callable[[], torch.nn.Module]:
        return lambda: Activated(functools.partial(torch.mul, other=torch.tensor(by, dtype=torch.float64)))
    _check_second(scaled(2.0), scaled(3.0), X)


class Tied(torch.nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4, dtype=torch.float64)
        self.head = torch.nn.Linear(4, 10, bias=False, dtype=torch.float64)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def test_tied_parameters_are_in_the_key() -> None:
    """The export of a tied model reads one placeholder for both uses: a model of the same shapes, untied, must
    not get it."""
    _check_second(lambda: Tied(True), lambda: Tied(False), torch.arange(6).reshape(2, 3))


def test_negative_zero_is_not_zero() -> None:
    _check_second(lambda: Activated(functools.partial(torch.mul, other=0.0)),
                  lambda: Activated(functools.partial(torch.mul, other=-0.0)), X)


class Strided(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.is_contiguous() else x * 3


class StridedConstant(torch.nn.Module):
    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table  # a plain tensor: a constant of the graph

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.table.sum() if self.table.is_contiguous() else x - self.table.sum()


def test_the_strides_of_the_inputs_and_of_constants_are_in_the_key() -> None:
    EXPORTS.kept.clear()
    capture(Strided(), (X.t().contiguous(),))
    got = capture(Strided(), (X.t(),))
    torch.testing.assert_close(_run(got, Strided(), (X.t(),))[0], Strided()(X.t()), rtol=0, atol=0)
    table = torch.eye(3, dtype=torch.float64) + 1
    _check_second(lambda: StridedConstant(table), lambda: StridedConstant(table.t()), X)


def _made(scale: float) -> torch.nn.Module:
    class Made(torch.nn.Module):  # one qualified name and code for every scale: the closure tells them apart
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * scale
    return Made()


def _activation(base: type) -> torch.nn.Module:
    return Activated(type("Activation", (base,), {})())  # one module and name for every base


def test_classes_made_alike_share_no_export_through_files(tmp_path: Path) -> None:
    """Read back from bytes (``AUTOPAR_SOLVED_DIR``), an export is named by the digest: the code of a class made
    inside a function is the same for both, its closure is not; a class made by ``type`` has the same name
    and module for both, its bases differ."""
    with shared_dir(str(tmp_path)):
        _check_second(lambda: _made(2.0), lambda: _made(3.0), X)
        _check_second(lambda: _activation(torch.nn.Sigmoid), lambda: _activation(torch.nn.Tanh), X)


class Weighted:
    def __init__(self, weight: float) -> None:
        self.weight = weight

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean() * self.weight


@pytest.mark.parametrize("criterion", [Weighted(1.0), torch.nn.HuberLoss(delta=1.0)], ids=["object", "module"])
def test_a_bound_method_loss_is_keyed_by_its_object(criterion: Any) -> None:
    target = torch.zeros(2, 3, dtype=torch.float64)
    loss_fn = criterion.loss if isinstance(criterion, Weighted) else criterion.forward
    EXPORTS.kept.clear()
    capture(Scaled(), (X,), with_loss=True, loss_fn=loss_fn, target=target)
    setattr(criterion, "weight" if isinstance(criterion, Weighted) else "delta", 0.25)
    model = Scaled()
    got = capture(model, (X,), with_loss=True, loss_fn=loss_fn, target=target)
    torch.testing.assert_close(_run(got, model, (X,), target)[0], loss_fn(model(X), target), rtol=0, atol=0)


def _doubled(module: torch.nn.Module, args: tuple, out: Any) -> Any:
    return out * 2 if isinstance(module, torch.nn.Linear) else None


class Doubling(TorchFunctionMode):
    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is F.linear else out


def _captured_within(context: Callable[[], Any], x: torch.Tensor,
                     make: Callable[[], torch.nn.Module] = Scaled) -> None:
    """A capture made inside ``context`` (something every module or every call runs) does not answer a capture
    made outside it. (``x``: a shape of each test's own, as the tests' processes share their exports' files.)"""
    EXPORTS.kept.clear()
    with context():
        capture(make(), (x,))
    model = make()
    got = capture(model, (x,))
    torch.testing.assert_close(_run(got, model, (x,))[0], model(x), rtol=0, atol=0)


@contextlib.contextmanager
def _global_hook() -> Iterator[None]:
    handle = torch.nn.modules.module.register_module_forward_hook(_doubled)
    try:
        yield
    finally:
        handle.remove()


def test_a_global_module_hook_is_not_an_export_of_the_model_alone() -> None:
    _captured_within(_global_hook, X[:1])


def test_a_torch_function_mode_is_not_an_export_of_the_model_alone() -> None:
    _captured_within(Doubling, X.repeat(2, 1))


class AutocastAware(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if torch.is_autocast_enabled("cpu") else x * 3


def test_autocast_read_by_the_model_is_in_the_key() -> None:
    _captured_within(lambda: torch.autocast("cpu", dtype=torch.bfloat16), X, AutocastAware)


def _doubling_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out.mul_(2) - target) ** 2).mean()  # (changes the model's output in place)


def test_the_forward_graph_of_a_training_export_is_the_models_own() -> None:
    """The training export also gives the forward-only graph (``split_outputs``), but not where the loss changed
    the model's output in place: the export returns the changed value."""
    model, target = Scaled(), torch.zeros(2, 3, dtype=torch.float64)
    EXPORTS.kept.clear()
    capture(model, (X,), with_loss=True, loss_fn=_doubling_loss, target=target)
    got = capture(model, (X,))
    torch.testing.assert_close(_run(got, model, (X,))[0], model(X), rtol=0, atol=0)


def _no_rotation(q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
    return q, k


@pytest.mark.parametrize("patched", ["apply_rotary_pos_emb", "LlamaMLP.forward"])
def test_a_library_function_patched_at_run_time_is_another_key(patched: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Libraries' code is read by what their classes' methods name, not followed: a module-level function patched
    (as kernel libraries patch Hugging Face's) or a method patched is another key."""
    from transformers.models.llama import modeling_llama
    make, ids = models.factory(models.llama, layers=1), torch.arange(16).reshape(2, 8) % 90
    EXPORTS.kept.clear()
    capture(make(), (ids,))
    owner, name, patch = {"apply_rotary_pos_emb": (modeling_llama, "apply_rotary_pos_emb", _no_rotation),
                          "LlamaMLP.forward": (modeling_llama.LlamaMLP, "forward", lambda self, x: x)}[patched]
    monkeypatch.setattr(owner, name, patch)
    model = make()
    got = capture(model, (ids,))
    torch.testing.assert_close(_run(got, model, (ids,))[0], model(ids).logits, rtol=0, atol=0)
