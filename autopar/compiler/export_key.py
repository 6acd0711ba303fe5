"""The key of an export (``export_key``): what the export reads and nothing it does not.

- the model's modules in order: class (so its code), every attribute (Hugging Face's config, flags,
  ``training``), the names, shapes, strides, dtypes, devices and ``requires_grad`` of parameters and buffers,
  which of them are tied (one tensor under two names), and the value of any plain tensor attribute (it would
  become a constant of the graph). Parameter and buffer values are not read: the export sees them as fake
  tensors, so no value can shape the graph;
- what the code of the model's classes and of the loss reads (``_reads``): class attributes, the closures and
  defaults of methods, module-level values its functions name and the functions they call, followed in turn;
  the code of torch, Python and installed packages is not followed: a class of theirs is keyed by its functions
  and the functions and classes they name at module level (a patched method or ``apply_rotary_pos_emb``), not
  by the module-level values of transformers;
- the inputs and target: tensors by shape, strides, dtype, device and ``requires_grad`` (fake as well), every
  other leaf by value (a float by its bits: ``-0.0`` is not ``0.0``); the loss function (the object itself,
  what its closure holds, and the object a bound method is bound to);
- whether a loss is captured, the output dtype, grad mode, default dtype and device, and autocast's state.

Anything it cannot fingerprint exactly (a module with hooks, an attribute of an unknown type, a module outside
the model that the code calls, a global module hook or an active torch function mode) makes the key ``None``:
that export is not remembered (a module-level logger the code reads is keyed by its name).
"""
from __future__ import annotations

import contextvars
import enum
import functools
import hashlib
import logging
import sys
import types
from pathlib import Path
from typing import Any, Hashable

import torch
from torch.utils import _pytree as pytree

from autopar.core.graph import tied_aliases

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_state_dict_hooks", "_load_state_dict_pre_hooks", "_forward_hooks_with_kwargs",
          "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called", "_state_dict_pre_hooks",
          "_load_state_dict_post_hooks")
_SKIP = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", *_HOOKS}
_DEPTH = 6


_MODULE_NAMES: contextvars.ContextVar[dict[int, str]] = contextvars.ContextVar("module names", default={})


class _Unknown(Exception):
    """A value the key cannot hold exactly."""


def export_key(model: torch.nn.Module, inputs: Any, loss_fn: Any, *, with_loss: bool,
               output_dtype: torch.dtype | None) -> Hashable | None:
    """The key of an export of ``model`` on ``inputs`` (args, kwargs, target), or None where it is not exact."""
    if _global_hooks() or _modes():
        return None
    names: dict[int, str] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), name)
    token = _MODULE_NAMES.set(names)  # (a module an attribute refers to: by its name in the model)
    try:
        modules = (_modules(model), tuple(tied_aliases(model).items()))  # (tied: one placeholder, both uses)
        held = [v for m in model.modules() for v in vars(m).values() if callable(v)]  # (``self.act = f``)
        code = _reads([*dict.fromkeys(type(m) for m in model.modules()), *held, loss_fn])
        return (modules, code, _value(inputs, fake=True), _aliases(inputs), _loss(loss_fn),
                with_loss, output_dtype, torch.is_grad_enabled(), torch.get_default_dtype(),
                torch.get_default_device(), _autocast())
    except _Unknown:
        return None
    finally:
        _MODULE_NAMES.reset(token)


def _autocast() -> tuple:
    """Autocast's state: a model may read it (``torch.is_autocast_enabled()``) while exported."""
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))


def _global_hooks() -> bool:
    """Whether a hook every module runs is registered (``register_module_forward_hook``): the export records
    what it does."""
    from torch.nn.modules import module
    return any(getattr(module, f"_global{h}", None) for h in _HOOKS if "state_dict" not in h)


def _modes() -> bool:
    """Whether a torch function or dispatch mode is active (the default device's aside: a value of the key):
    the export records what it does."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    return any(not isinstance(m, DeviceContext) for m in _get_current_function_mode_stack()) or \
        bool(_get_current_dispatch_mode_stack())


def _modules(model: torch.nn.Module) -> tuple:
    return tuple((name, type(m), _attributes(m), _tensors(m)) for name, m in model.named_modules())


def _loss(f: Any) -> Any:
    """The loss function; a method of a module (``criterion.forward``) also by that module's state."""
    if isinstance(f, types.MethodType) and isinstance(f.__self__, torch.nn.Module):
        return ("method", _function(f.__func__), _modules(f.__self__))
    return _function(f)


def _aliases(inputs: Any) -> tuple:
    """For each tensor among the inputs, the first that is the same tensor and the first that shares its storage:
    a target passed as the input itself is one placeholder of the export, which the model then reads."""
    leaves = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)]
    storages = [x.untyped_storage().data_ptr() if type(x) in (torch.Tensor, torch.nn.Parameter)  # (not a fake
                and x.device.type != "meta" else -i - 1 for i, x in enumerate(leaves)]  # or meta one: no storage)
    return tuple((next(j for j, y in enumerate(leaves) if y is x), storages.index(storages[i]))
                 for i, x in enumerate(leaves))


def _attributes(m: torch.nn.Module) -> tuple:
    if any(getattr(m, h, None) for h in _HOOKS):
        raise _Unknown("hooks")
    return tuple((k, _value(v)) for k, v in sorted(vars(m).items()) if k not in _SKIP)


def _tensors(m: torch.nn.Module) -> tuple:
    def spec(t: torch.Tensor | None) -> Any:
        return None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)
    return (tuple((k, spec(t)) for k, t in m._parameters.items()),
            tuple((k, spec(t), k in m._non_persistent_buffers_set) for k, t in m._buffers.items()))


def _value(v: Any, depth: int = 0, fake: bool = False) -> Any:
    """``v`` as a hashable value that is equal exactly when ``v`` is (tensors by value unless ``fake``)."""
    if depth > _DEPTH:
        raise _Unknown("too deep")
    if isinstance(v, float):  # (by its bits: 0.0 == -0.0, which the graph tells apart; nan != nan)
        return (type(v), v.hex())
    if v is None or isinstance(v, (bool, int, str, bytes, torch.dtype, torch.device, torch.Size)):
        return (type(v), v)
    if isinstance(v, torch.Tensor):
        # (the device with its index: the graph holds it, ``arange(..., device=cuda:1)``; the strides: a model may
        # branch on ``x.is_contiguous()``, and fake tensors keep them)
        spec = ("tensor", tuple(v.shape), v.stride(), v.dtype, v.device, v.requires_grad)
        if fake or v.device.type == "meta":
            return spec
        if type(v) not in (torch.Tensor, torch.nn.Parameter):  # (a subclass: a fake tensor an export left behind)
            raise _Unknown(type(v).__name__)
        data = v.detach().cpu().reshape(-1)  # (a constant of the graph; flat: a 0-d tensor has no view in bytes)
        return (*spec, hashlib.blake2b(data.view(torch.uint8).numpy() if data.numel() else b"").hexdigest())
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_value(x, depth + 1, fake) for x in v))
    if isinstance(v, dict):
        return (type(v), tuple((_value(k, depth + 1), _value(x, depth + 1, fake)) for k, x in v.items()))
    if isinstance(v, (set, frozenset)):
        return (type(v), frozenset(_value(x, depth + 1) for x in v))
    if isinstance(v, type) or callable(v) and hasattr(v, "__code__"):
        return _function(v, depth + 1)
    if isinstance(v, types.BuiltinFunctionType) and (v.__self__ is None or isinstance(v.__self__, types.ModuleType)):
        return ("builtin", v)  # a function of a C module (F.gelu): stateless
    if isinstance(v, torch.nn.Module):
        if id(v) not in _MODULE_NAMES.get() and not _holds_tensors(v):  # a function wrapped as a module
            return ("outside", tuple((name, _class_of(type(m)), _attributes(m)) for name, m in v.named_modules()))
        return ("module", _module_name(v))
    if isinstance(v, enum.Enum):
        return (type(v), v.value)
    if isinstance(v, functools.partial):
        return (type(v), _value(v.func, depth + 1), _value(v.args, depth + 1), _value(v.keywords, depth + 1))
    if isinstance(v, types.MethodType):
        return _function(v, depth + 1)
    if hasattr(v, "__dict__") and not hasattr(type(v), "__slots__") and \
            (_python_class(type(v)) or type(v) is types.SimpleNamespace):  # a plain object
        # (a model's config); a class of C code may keep its state outside ``__dict__``
        return (type(v), tuple((k, _value(x, depth + 1)) for k, x in sorted(vars(v).items())))
    raise _Unknown(type(v).__name__)


def _class_of(cls: type) -> Any:
    """A module's class: by itself, with what its code reads (``_reads``); a class defined inside a function
    (made anew at each call: Hugging Face's kernel hub makes one per wrapped function and model) by its module,
    name and methods' code, with what their closures and defaults hold."""
    if "<locals>" not in cls.__qualname__:
        return (cls, _reads([cls]))
    methods = [(k, f) for k, f in sorted(vars(cls).items()) if isinstance(f, types.FunctionType)]
    return (cls.__module__, cls.__qualname__, tuple(map(_class_of, cls.__bases__)),
            tuple((k, f.__code__, _value([_imported(c) for c in _cells(f)]), _value(f.__defaults__))
                  for k, f in methods),
            _reads([c for _, f in methods for c in _cells(f) if callable(c)]))


def _imported(v: Any) -> Any:
    """A library's module (``torch`` in a closure) by its name; anything else as it is."""
    return ("import", v.__name__) if isinstance(v, types.ModuleType) and _library(v) else v


def _holds_tensors(module: torch.nn.Module) -> bool:
    """Whether a module or any of its submodules holds a tensor (a parameter, a buffer, an attribute). One that
    holds none (Hugging Face's kernel hub wraps a function so: ``_kernel_funcs``) is read by its class and
    attributes wherever it is held."""
    return any(m._parameters or m._buffers or any(isinstance(x, torch.Tensor) for x in vars(m).values())
               for m in module.modules())


def _module_name(m: torch.nn.Module) -> str:
    """A module an attribute refers to, by its name in the model (fingerprinted in its own place there); not by
    its address, which another module may take once this one is gone. A module outside the model that holds
    tensors raises: they would be constants of the graph."""
    name = _MODULE_NAMES.get().get(id(m))
    if name is None:
        raise _Unknown(f"a {type(m).__name__} outside the model")
    return name


def _python_class(cls: type) -> bool:
    """Whether every class of ``cls`` but ``object`` is written in Python (keeps its state in ``__dict__``)."""
    return all(c.__flags__ & _HEAP_TYPE for c in cls.__mro__[:-1])


_HEAP_TYPE = 1 << 9  # (Py_TPFLAGS_HEAPTYPE: a class made by a class statement)


def _function(f: Any, depth: int = 0) -> Any:
    """A function or class: the object itself (its code), and what its closure and defaults hold; a bound method
    also by the object it is bound to."""
    if f is None or isinstance(f, type):
        return f
    if isinstance(f, types.MethodType):  # (a module of the model it is bound to: by its name)
        return ("method", _function(f.__func__, depth), _value(f.__self__, depth))
    if not hasattr(f, "__code__"):
        raise _Unknown(type(f).__name__)
    cells = tuple(_value(c, depth + 1) for c in _cells(f))
    return (f, cells, _value(f.__defaults__, depth + 1), _value(f.__kwdefaults__, depth + 1))


def _reads(roots: list) -> tuple:
    """What the code of the model's classes and of the loss reads besides its arguments and the modules' own
    attributes: each class's attributes (its methods with their closures and defaults, class-level values), and
    the module-level names its functions read, by value (a function one calls: followed in turn; an attribute of
    a module, ``cfg.SCALE``: where the code names it). A class of a library (``_library``) is read by its
    functions only (``_library_class``)."""
    seen: set[int] = set()
    out: list = []
    todo = [r for r in roots if r is not None]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if _library(x):
            if isinstance(x, type):
                out.append((x, _library_class(x)))
                todo += x.__mro__[1:]
        elif isinstance(x, types.MethodType):
            todo += [x.__func__, type(x.__self__)]
        elif isinstance(x, functools.partial):
            todo.append(x.func)
        elif isinstance(x, type):
            out.append((x, _class_values(x, todo)))
            todo += x.__mro__[1:]
        elif isinstance(x, types.FunctionType):
            out.append(_function_reads(x, todo))
    return tuple(out)


def _library_class(cls: type) -> tuple:
    """A library's class by its functions and the functions and classes their code names at module level, all by
    themselves: a method or a module-level function patched at run time (``LlamaMLP.forward = ...``,
    ``modeling_llama.apply_rotary_pos_emb = ...``) is another key. Not followed further."""
    functions = [(k, v) for k, v in sorted(vars(cls).items()) if isinstance(v, types.FunctionType)]
    return tuple((k, tuple((g, tuple((n, g.__globals__[n]) for n in _names(g.__code__)
                                     if isinstance(g.__globals__.get(n), (types.FunctionType, type))))
                           for g in _wrapped(f)))
                 for k, f in functions)


def _wrapped(f: types.FunctionType, depth: int = 0) -> list[types.FunctionType]:
    """``f`` and the functions its closure holds, in turn: a decorated method's own code is in its wrapper's
    closure."""
    inner = [g for g in _cells(f) if isinstance(g, types.FunctionType) and g is not f] if depth < _DEPTH else []
    return [f, *(g for x in inner for g in _wrapped(x, depth + 1))]


def _cells(f: types.FunctionType) -> list:
    """What ``f``'s closure holds (None for an empty cell)."""
    cells = []
    for c in f.__closure__ or ():
        try:
            cells.append(c.cell_contents)
        except ValueError:  # (an empty cell)
            cells.append(None)
    return cells


def _library(x: Any) -> bool:
    """Whether ``x`` is code of torch, autopar, Python or an installed package (Hugging Face's), not followed: its
    module-level state is taken as fixed (a registry such as ``ALL_ATTENTION_FUNCTIONS`` changed at run time is
    not seen), its code as that of the installed version."""
    return _library_module(x.__name__ if isinstance(x, types.ModuleType) else getattr(x, "__module__", None) or "")


@functools.lru_cache(maxsize=None)
def _library_module(name: str) -> bool:
    top = name.partition(".")[0]
    path = getattr(sys.modules.get(name), "__file__", None) or ""
    return top in ("torch", "autopar") or top in sys.stdlib_module_names or \
        any(part in ("site-packages", "dist-packages") for part in Path(path).parts)


def _class_values(cls: type, todo: list) -> tuple:
    """A class's attributes (its functions and classes by themselves, queued to be read in turn; the rest by
    value), but the ones Python gives every class (``__module__``, ``__dict__``)."""
    values = []
    for k, v in sorted(vars(cls).items()):
        v = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
        inner = [v.fget, v.fset, v.fdel] if isinstance(v, property) else [v]
        todo += [f for f in inner if callable(f)]
        if not (k.startswith("__") and k.endswith("__")) or isinstance(v, types.FunctionType):
            values.append((k, tuple(map(_named, inner))))
    return tuple(values)


def _function_reads(f: types.FunctionType, todo: list) -> tuple:
    """A function by its code, closure, defaults and the module-level values its code names."""
    cells = _cells(f)
    names = _names(f.__code__)
    found = [(n, f.__globals__[n]) for n in names if n in f.__globals__]
    for _, m in list(found):  # the attributes of modules this code names (``cfg.SCALE``)
        if isinstance(m, types.ModuleType) and not _library(m):
            found += [(f"{m.__name__}.{n}", vars(m)[n]) for n in names if n in vars(m)]  # (no ``__getattr__``)
    found = [(n, v) for n, v in found if not isinstance(v, types.ModuleType)]
    todo += [v for v in [*cells, *(f.__defaults__ or ()), *(v for _, v in found)] if callable(v)]
    return (f, tuple(map(_named, cells)), _held(f.__defaults__), _held(f.__kwdefaults__),
            tuple((n, _named(v)) for n, v in found))


def _named(v: Any) -> Any:
    """A value a function reads: a function or class by itself (read in its own place), the rest by value."""
    return v if isinstance(v, (types.FunctionType, type)) else _held(v)


@functools.lru_cache(maxsize=4096)
def _names(code: types.CodeType) -> tuple[str, ...]:
    """The names a code object (and the code inside it) reads: globals and attributes alike."""
    inner = [n for c in code.co_consts if isinstance(c, types.CodeType) for n in _names(c)]
    return tuple(dict.fromkeys([*code.co_names, *inner]))


def _held(v: Any) -> Any:
    """``v`` by value; a logger by its name (what it logs is not in the graph)."""
    return ("logger", v.name) if isinstance(v, logging.Logger) else _value(v)
