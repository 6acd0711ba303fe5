"""Regions of a rank's graph run by inductor (``parallelize(..., compile=True)``).

``passes/inductor_regions.py`` outlines the ATen ops of each rank's graph that inductor may fuse into
``Inductor`` submodules, with tensor parallelism's collectives, which compile as torch's functional collectives
(``core/functional_collectives.py``: issued when their input is ready, waited for where their result is first
used, in their order, ``OVERLAP``); what stays outside (ZeRO's gathers, sequence parallelism's gathers, ring
and expert exchanges, split-backward matmuls, random ops, writes) runs as before, in the order the graph gives
it, so the runtime's schedule, prefetches, buckets and sends keep their order.

An ``Inductor`` region compiles at its first call, with the tensors it is called with, through
``torch._inductor.compile_fx`` (AOTAutograd: a compiled forward and, where an input needs a gradient, a
compiled backward). Compiled functions are kept in one process-wide ``CompiledRegions`` by the region's
structure (ops and their arguments, node names left out), its inputs' shapes, strides, dtypes, devices and
``requires_grad``, and the process groups its collectives run on (their names, sizes and the rank's index):
identical layers, and every rank of a process, compile once. Inductor's own caches (its FX graph cache and
AOTAutograd's, on disk) serve other processes: a region compiles under a tracing context with a shape
environment, which those caches need, and the machine's processes compiling an equal region take a lock in
turn, so that one compiles and the others load its code.

Invariant: a region computes what its graph computes, up to the floating-point reassociation of inductor's
fused kernels (docs/decisions.md, "Compiled rank graphs"); saved-tensor hooks (sequence parallelism's
re-gathers, ZeRO-3's saved parameters) see the tensors the compiled forward saves for backward.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from autopar.core.collectives import bound, current
from autopar.core.errors import UnsupportedError
from autopar.core.functional_collectives import BY_INDEX, Group, Tally, axes, decompositions, groups
from autopar.core.graph import copy_module, origin
from autopar.core.shared_dir import locked


def structure(gm: fx.GraphModule) -> str:
    """``gm``'s ops and arguments with nodes by position: equal for the same computation under other names."""
    index: dict[fx.Node, int] = {}
    rows = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{index[n]}")
        rows.append(f"{node.op} {node.target if node.op != 'placeholder' else ''} {args}")
    return "\n".join(rows)


def _signature(args: tuple) -> tuple:
    return tuple((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad, a.storage_offset())
                 if isinstance(a, torch.Tensor) else ("value", repr(a)) for a in args)


@dataclass
class CompiledRegions:
    """Compiled functions by (structure, input signature, grad mode), and what compiling them cost."""

    functions: dict[tuple, Callable] = field(default_factory=dict)
    seconds: float = 0.0  # spent in compile_fx by this process
    compiles: int = 0
    calls_compiled: int = 0  # region calls served by an already compiled function
    lock: threading.Lock = field(default_factory=threading.Lock)

    def function(self, region: Inductor, args: tuple) -> Callable:
        held = groups(current(), region.axes) if region.axes else ()
        key = (region.key, _signature(args), torch.is_grad_enabled(), held)
        fn = self.functions.get(key)
        if fn is not None:
            self.calls_compiled += 1
            return fn
        with self.lock:
            if key not in self.functions:
                start = time.perf_counter()
                with locked(_lock_file(region, key)):  # (the machine's other ranks: one compiles, the rest load)
                    self.functions[key] = _compile(region, args, dict(zip(region.axes, held)))
                self.seconds += time.perf_counter() - start
                self.compiles += 1
        return self.functions[key]


def _lock_file(region: Inductor, key: tuple) -> str:
    """The lock that processes of this machine compiling an equal region take in turn, so that the first
    compiles and the others find its code in inductor's caches instead of compiling it beside it. Equal: the
    same structure, signature (but the inputs' storage offsets: each rank's batch is a slice at its own), grad
    mode and groups, the rank's index in them left out where the region's code does not depend on it (ranks of
    an axis compile the same code)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    structure_, signature, grad, held = key
    signature = tuple(s[:5] if s[0] != "value" else s for s in signature)  # (the storage offsets left out)
    if not any(n.target in BY_INDEX for n in region.region.graph.nodes):
        held = tuple(replace(g, index=-1) for g in held)
    digest = hashlib.sha256(repr((structure_, signature, grad, held)).encode()).hexdigest()[:32]
    folder = os.path.join(cache_dir(), "autopar-locks")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, digest)


# a region with collectives: each is issued as soon as its input is ready and waited for at the first use of
# its result, the collectives in their order (inductor's comms passes order by the graph's position otherwise)
OVERLAP = {"reorder_for_compute_comm_overlap": True,
           "reorder_for_compute_comm_overlap_passes": ["sink_waits", "raise_comms"]}
COMPILED = CompiledRegions()  # this process's compiled regions (one cache, as ``capture_cache.EXPORTS``)


class Inductor(torch.nn.Module):
    """One region of a rank's graph, run by inductor: ``region`` is its ATen graph (printed, inspectable),
    compiled at the first call with each new input signature (see the module doc)."""

    def __init__(self, region: fx.GraphModule) -> None:
        super().__init__()
        self.region = region
        self._key: str | None = None
        self.axes = axes(region)  # the mesh axes its collectives run on (core/functional_collectives.py)
        self.tally = Tally.of(region)

    @property
    def sources(self) -> list[str]:
        """The modules of the user's model its ops come from, in order."""
        return list(dict.fromkeys(origin(n) for n in self.region.graph.nodes if origin(n)))

    @property
    def key(self) -> str:
        if self._key is None:  # (after the device arguments were pointed at the rank's device)
            self._key = structure(self.region)
        return self._key

    def forward(self, *args: Any) -> Any:
        out = COMPILED.function(self, args)(*args)
        if self.axes:
            binding = bound()
            self.tally.record(binding, "forward")
            if torch.is_grad_enabled():
                self.tally.record_backward_with(out, binding)
        return out

    def extra_repr(self) -> str:
        ops = sum(1 for n in self.region.graph.nodes if n.op == "call_function")
        return f"{ops} ops"


def _compile(region: Inductor, args: tuple, on: dict[str, Group]) -> Callable:
    """``on``: the process group of each axis its collectives run on."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    gm = copy_module(region.region)  # (compile_fx may rewrite the graph it is given)
    # the backward compiles with the forward, under the caller's lock (``_lock_file``), not at the first backward
    aot = {"force_non_lazy_backward_lowering": True} if hasattr(torch._functorch.config,
                                                                "force_non_lazy_backward_lowering") else {}
    if on:  # the collectives' decompositions hold the groups: AOTAutograd's cache, which keys the graph before
        # they apply, could serve another binding's, so it is off here; inductor's own cache keys the graph
        # after them (group names, sizes, this rank's chunk written in it) and stays on
        aot["enable_autograd_cache"] = False
    try:
        with _outside_hooks_and_modes(), _cacheable(args) as inputs, torch._functorch.config.patch(aot):
            if not on:
                return compile_fx(gm, inputs)
            return compile_fx(gm, inputs, inner_compile=_inner_compile, config_patches=OVERLAP,
                              decompositions={**select_decomp_table(), **decompositions(on)})
    except Exception as e:  # name the region and where its ops come from; compile=False is the fix
        raise UnsupportedError(_failure(region, e)) from e


def _inner_compile(gm: fx.GraphModule, example_inputs: list, *, get_decomp_fn: Callable | None = None,
                   **kwargs: Any) -> Any:
    """Inductor's compilation of a graph AOTAutograd traced, without the decompositions of the collectives,
    which have applied by then: inductor's cache cannot key a table of functions, and would compile uncached."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs, **kwargs)


@contextlib.contextmanager
def _cacheable(args: tuple) -> Iterator[list]:
    """The inputs to compile with, under the tracing context inductor's caches need: its FX graph cache and
    AOTAutograd's cache key a compiled graph by its inputs' shapes through the tracing context's shape
    environment, and compile without caching where there is none. The inputs are fake tensors of that context
    with static shapes (each region compiles for the shapes it is called with, as ``_signature`` keys it)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if not all(isinstance(a, torch.Tensor) for a in args):  # (a number would become a symbol of that environment)
        yield list(args)
        return
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    inputs = [fake_mode.from_tensor(a, static_shapes=True) for a in args]
    with tracing(TracingContext(fake_mode)):
        yield inputs


def _failure(region: Inductor, error: Exception) -> str:
    """The error of a region that did not compile: the node it names (else the region's first), where that
    node comes from in the user's code, inductor's words, and the fix."""
    text = str(error).strip().splitlines()
    cause = text[0] if text else type(error).__name__
    nodes = [n for n in region.region.graph.nodes if n.op == "call_function"]
    node = next((n for n in nodes if str(n.target) in str(error)), nodes[0])
    trace = [line.strip() for line in (node.meta.get("stack_trace") or "").strip().splitlines()]
    line = next((t for t in reversed(trace) if t.startswith("File ")), "no source line recorded")
    return (f"inductor could not compile the region holding {node.name} ({node.target}) "
            f"{origin(node) or 'outside the modules of the model'}, {line}: {type(error).__name__}: {cause}; "
            f"pass compile=False to run the rank graphs eagerly")


@contextlib.contextmanager
def _outside_hooks_and_modes() -> Iterator[None]:
    """Compiles as at top level: without the saved-tensor hooks (a recomputed region's, ZeRO-3's, sequence
    parallelism's) and dispatch modes (selective recomputation's) of the call that reached the region."""
    from torch.utils._python_dispatch import _disable_current_modes

    hooks = []
    while torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:  # noqa: SLF001
        hooks.append(torch._C._autograd._top_saved_tensors_default_hooks(False))  # noqa: SLF001
        torch._C._autograd._pop_saved_tensors_default_hooks()  # noqa: SLF001
    try:
        with _disable_current_modes():
            yield
    finally:
        for pack, unpack in reversed(hooks):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)  # noqa: SLF001
