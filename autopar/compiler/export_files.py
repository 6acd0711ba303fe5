"""Exports as bytes: written once, read by every process that captures the same model.

``torch.export`` is most of a compile's time, and the ranks of a job export the same model on the same inputs at
the same time. ``exported(key, make)`` writes an export (``make()``) to bytes and reads it back; with
``AUTOPAR_SOLVED_DIR`` naming a shared directory (``core/shared_dir.py``), the first process to take the lock of
the key's digest exports and writes the bytes, and the others read them. Every process, the one that exported
included, and every run without the directory, compiles the export as read back from its bytes, so that all
ranks rewrite one and the same graph, and a graph that does not survive the bytes is seen in every run, not in
the shared ones only.

The bytes hold each node's op, name, target, arguments and ``meta``; a fake tensor is written as its shape,
strides, storage offset, dtype, device and ``requires_grad``, and read back as a fake tensor of one new
``FakeTensorMode`` per export; an operator by its name. An export that cannot be written so (a symbolic size, an
attribute or a graph below, an object pickle cannot hold) is used as exported, and not shared.

The key's digest (``digest``) reads what ``export_key.export_key`` holds: values by type and value, classes by
module, name, the size and time of change of the module's file and their bases (and, for a class defined inside
a function, the code of its methods), functions by module, name and code (what a function's closure holds and
the values its code reads are values of the key: ``export_key._reads``); and the size and time of change of
every file of autopar, so that a directory kept from one version to the next is not read across them. A key
holding anything else is not shared.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import io
import pickle
import sys
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Hashable

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.node import map_aggregate

from autopar.compiler.capture_cache import Export
from autopar.core.shared_dir import shared
from autopar.passes.lazy_module import graph_module


def exported(key: Hashable | None, make: Callable[[], Export]) -> Export:
    """``make()``'s export as read back from its bytes, made by this process or read from another's."""
    made: list[Export] = []

    def write() -> bytes | None:
        made.append(make())
        return encode(made[0])

    name = digest(key)
    data = shared(name, write) if name is not None else write()
    if data is not None:
        return decode(data)
    return made[0] if made else make()  # (an export that does not go to bytes is shared as None)


class _Unwritable(Exception):
    """Something of an export the bytes cannot hold."""


class _Ref:
    """A node named in another node's arguments."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class _Writer(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, FakeTensor):
            return ("fake", tuple(obj.shape), obj.stride(), obj.storage_offset(), obj.dtype, str(obj.device),
                    obj.requires_grad)
        if isinstance(obj, torch.fx.Node):
            return ("node", obj.name)
        if isinstance(obj, torch._ops.OpOverload):
            return ("op", obj._schema.name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return ("packet", obj._qualified_op_name)
        if isinstance(obj, torch._ops.HigherOrderOperator):
            return ("higher order", obj.name())
        if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool, torch.fx.GraphModule)):
            raise _Unwritable(type(obj).__name__)
        return None


class _Reader(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.mode = FakeTensorMode(shape_env=ShapeEnv())

    def persistent_load(self, pid: Any) -> Any:
        kind, *rest = pid
        if kind == "fake":
            shape, stride, offset, dtype, device, requires_grad = rest
            with self.mode:
                t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
                if offset:
                    t = t.as_strided(shape, stride, offset)
            return t.requires_grad_(requires_grad)
        if kind == "node":
            return _Ref(rest[0])
        if kind == "higher order":
            return getattr(torch.ops.higher_order, rest[0])
        namespace, name = rest[0].split("::")
        packet = getattr(getattr(torch.ops, namespace), name)
        return packet if kind == "packet" else getattr(packet, rest[1] or "default")


def encode(export: Export) -> bytes | None:
    """The export's graph, signature, constants and output spec as bytes; None where they cannot be."""
    gm = export.graph_module
    if any(True for _ in gm.children()) or any(n.op == "get_attr" for n in gm.graph.nodes):
        return None
    nodes = [(n.op, n.name, n.target, n.args, n.kwargs, n.meta) for n in gm.graph.nodes]
    buf = io.BytesIO()
    try:
        _Writer(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(
            (nodes, export.input_specs, export.output_specs, export.constants, export.out_spec))
    except (_Unwritable, pickle.PicklingError, TypeError, AttributeError, RuntimeError):
        return None
    return buf.getvalue()


def decode(data: bytes) -> Export:
    """The export ``encode`` wrote."""
    with warnings.catch_warnings():  # (torch's pytree warns when a leaf's spec is read back by its old name)
        warnings.simplefilter("ignore", FutureWarning)
        nodes, input_specs, output_specs, constants, out_spec = _Reader(data).load()
    graph, env = torch.fx.Graph(), {}

    def node(x: Any) -> Any:
        return env[x.name] if isinstance(x, _Ref) else x

    for op, name, target, args, kwargs, meta in nodes:
        n = graph.create_node(op, target, map_aggregate(args, node), map_aggregate(kwargs, node), name=name)
        n.meta = meta
        env[name] = n
    return Export(graph_module({}, graph), input_specs, output_specs, constants, out_spec)


def digest(key: Hashable | None) -> str | None:
    """A file name for ``key`` that every process of this machine running the same code computes alike; None
    where the key holds something only this process can name."""
    if key is None:
        return None
    h = hashlib.blake2b(torch.__version__.encode(), digest_size=20)
    try:
        _feed(h, _autopar_files())
        _feed(h, key)
    except _Unwritable:
        return None
    return "export-" + h.hexdigest()


def _feed(h: Any, v: Any) -> None:
    if isinstance(v, (tuple, list)):
        h.update(b"(%d" % len(v))
        for x in v:
            _feed(h, x)
        h.update(b")")
    elif isinstance(v, (set, frozenset)):
        parts = []
        for x in v:
            sub = hashlib.blake2b(digest_size=20)
            _feed(sub, x)
            parts.append(sub.digest())
        _feed(h, sorted(parts))
    elif v is None or v is Ellipsis or isinstance(v, (bool, int, float, complex, str, bytes, torch.dtype,
                                                      torch.device, torch.Size)):
        h.update(f"{type(v).__name__}:{v!r};".encode())
    elif isinstance(v, slice):  # (constants of code: ``x[..., 1:]``)
        _feed(h, ["slice", v.start, v.stop, v.step])
    elif isinstance(v, type):
        h.update(f"class {v.__module__}.{v.__qualname__};".encode())
        _feed(h, _file_stamp(sys.modules.get(v.__module__)))
        _feed(h, list(v.__bases__))  # (``type("Act", (nn.Tanh,), {})``: the same name for another class)
        if "<locals>" in v.__qualname__:  # (a class made inside a function: its methods' code as well)
            _feed(h, [(k, x) for k, x in sorted(vars(v).items()) if isinstance(x, types.FunctionType)])
    elif isinstance(v, types.FunctionType):
        h.update(f"function {v.__module__}.{v.__qualname__};".encode())
        _feed_code(h, v.__code__)
    elif isinstance(v, types.BuiltinFunctionType):
        h.update(f"builtin {getattr(v.__self__, '__name__', '')}.{v.__qualname__};".encode())
    else:  # (a submodule by its id, an object only this process holds)
        raise _Unwritable(type(v).__name__)


@functools.lru_cache(maxsize=None)
def _autopar_files() -> tuple:
    """The size and time of change of every file of autopar, ``passes`` and ``runtime`` included (in a source
    checkout they lie beside the package, not in it): an export written by other code is not read."""
    package = Path(__file__).parent
    roots = [package, *(Path(p) for name in ("autopar.passes", "autopar.runtime")
                        for p in importlib.util.find_spec(name).submodule_search_locations
                        if package not in Path(p).parents)]
    return tuple((str(p.relative_to(root.parent)), *_stamp(p)) for root in roots for p in sorted(root.rglob("*.py")))


@functools.lru_cache(maxsize=None)
def _file_stamp(module: types.ModuleType | None) -> tuple:
    """The size and time of change of a module's file (a class's code: a library upgraded, a file edited)."""
    path = getattr(module, "__file__", None)
    return _stamp(Path(path)) if path else ()


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def _feed_code(h: Any, code: types.CodeType) -> None:
    h.update(_code_digest(code))


@functools.lru_cache(maxsize=None)
def _code_digest(code: types.CodeType) -> bytes:
    """A code object's bytes, names and constants, hashed once (a key names hundreds of library functions)."""
    h = hashlib.blake2b(code.co_code, digest_size=20)
    _feed(h, [code.co_filename, code.co_firstlineno, code.co_names, code.co_varnames, code.co_freevars])
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _feed_code(h, c)
        else:
            _feed(h, c)
    return h.digest()
