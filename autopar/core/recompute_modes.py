"""Activation recomputation's vocabulary: the modes, which operators' outputs are kept, the region wrapper.

A recomputed region (``passes/recompute.py`` outlines them) runs through
``Recompute``, i.e. ``torch.utils.checkpoint`` without re-entrance: autograd
keeps the region's inputs, and backward runs the region again, from the random
number generator's state at its start, to rebuild what its own backward needs.
Which outputs are kept instead of recomputed is a policy over the ATen operators
the region dispatches (``keeps``; ``keep_contexts`` applies it while the region runs):

- ``"full"`` keeps only the outputs of operators that communicate in forward
  (``COMMUNICATING``: tensor-parallel all-reduce, all-gather, ...), so backward
  repeats no communication and gets the same numbers without it; the one
  exception is sequence parallelism's gather of the shards a matmul reads
  (``all_gather_rs``): backward gathers them again, as Megatron-LM does, so
  only the shards are kept;
- ``"selective"`` (Korthikanti et al. 2022) also keeps matmul and attention
  outputs (``KEPT_SELECTIVE``) and recomputes only the cheap operators between
  them: elementwise, normalization, softmax, dropout.

Context parallelism's ring attention (``core/ring_attention.py``) is an attention
here, though it communicates: "selective" keeps it, "full" runs it again in
backward, K/V exchanges included, as Megatron-LM's full recomputation does.

An operator that draws random numbers is never kept (a fused attention with
dropout is recomputed), so the recomputation draws the same numbers in the same
order. ZeRO-3's parameter all-gather is recomputed: backward gathers the layer
again, as ZeRO-3 does without recomputation; the ZeRO-3 runtime is told of each
region with shards in forward and wraps its recomputation in backward
(``on_sharded_region``), so that it prefetches the layer and the next ones in
backward's order, as for a layer that is not recomputed. The recomputation runs on the
binding the forward ran under (``core/collectives.py``), on whichever thread
backward runs.
"""
from __future__ import annotations

import contextlib
import fnmatch
import functools
from collections.abc import Callable, Mapping
from typing import Any, ContextManager

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from autopar.core.collectives import Binding, bind, bound
from autopar.core.comm import OPS
from autopar.core.ring_attention import ring_attention
from autopar.core.ulysses import ulysses_attention
from autopar.core.usp import usp_attention

MODES = ("none", "selective", "full")
FIX = ("pass recompute='none', 'selective' or 'full', a dict {layer or pattern: mode} "
       "(e.g. {'transformer.h.0': 'full', '*': 'selective'}), or a function layer name -> mode")

Choice = str | tuple[tuple[str, str], ...] | Callable[[str], str]


def check_choice(value: Any) -> Choice:
    """``recompute=`` validated: a mode, a mapping of layer names (or fnmatch patterns) to modes (returned as
    a tuple of pairs), or a function from a layer name to a mode."""
    if isinstance(value, str):
        if value not in MODES:
            raise ValueError(f"recompute={value!r} is not a recompute mode; the modes are "
                             f"{', '.join(map(repr, MODES))}; {FIX}")
        return value
    if isinstance(value, Mapping):
        value = tuple(value.items())
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        for key, mode in value:
            if not isinstance(key, str):
                raise ValueError(f"recompute has the key {key!r}; keys are layer names or patterns such as "
                                 f"'transformer.h.*' (strings); {FIX}")
            if mode not in MODES:
                raise ValueError(f"recompute[{key!r}]={mode!r} is not a recompute mode; the modes are "
                                 f"{', '.join(map(repr, MODES))}")
        return value
    if callable(value):
        return value
    raise ValueError(f"recompute={value!r} ({type(value).__name__}) is not a recompute choice; {FIX}")


def mode_of(choice: Choice, layer: str) -> str:
    """The mode ``choice`` gives ``layer``: the first matching key of a mapping ("none" when none matches)."""
    if isinstance(choice, str):
        return choice
    if isinstance(choice, tuple):
        return next((mode for key, mode in choice if key == layer or fnmatch.fnmatchcase(layer, key)), "none")
    mode = choice(layer)
    if mode not in MODES:
        raise ValueError(f"the recompute function returned {mode!r} for layer {layer!r}; it must return one of "
                         f"{', '.join(map(repr, MODES))}")
    return mode


def unmatched_keys(choice: Choice, layers: list[str]) -> list[str]:
    """Keys of a mapping choice that name no layer of ``layers`` (a typo the user should hear about)."""
    if not isinstance(choice, tuple):
        return []
    return [k for k, _ in choice if not any(k == la or fnmatch.fnmatchcase(la, k) for la in layers)]


# -- what is kept --------------------------------------------------------------------------------------
def _ops(namespace: Any, names: tuple[str, ...]) -> frozenset:
    """The ``.default`` overloads of ``names`` that this build of torch has."""
    return frozenset(getattr(namespace, n).default for n in names if hasattr(namespace, n))


# the autopar::* ops that communicate in forward and whose outputs recomputation keeps (grad_all_reduce, chunk and
# to_partial compute locally; all_gather_rs is gathered again, keeping 1/n of the bytes: see the module doc)
COMMUNICATING = _ops(torch.ops.autopar, tuple(name for name, op in OPS.items() if op.forward
                                              and name != "all_gather_rs"))
MATMULS = _ops(torch.ops.aten, ("mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "convolution",
                                "_grouped_mm", "_scaled_mm"))
ATTENTION = _ops(torch.ops.aten, ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                                  "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
                                  "_efficient_attention_forward")) | {
    ring_attention._opoverload, ulysses_attention._opoverload, usp_attention._opoverload}  # (cp's)
KEPT_SELECTIVE = MATMULS | ATTENTION
_CANDIDATES = {"full": COMMUNICATING, "selective": COMMUNICATING | KEPT_SELECTIVE}  # what each mode may keep


def draws_random(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether an operator call draws random numbers (an attention kernel only when its dropout is on)."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    arguments = func._schema.arguments
    for i, arg in enumerate(arguments):
        if arg.name == "dropout_p":
            p = kwargs.get("dropout_p", args[i] if i < len(args) else arg.default_value)
            return bool(p)
    return True


def keeps(mode: str, func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``mode`` keeps the output of this operator call instead of recomputing it."""
    if func in COMMUNICATING:
        return True
    return mode == "selective" and func in KEPT_SELECTIVE and not draws_random(func, args, kwargs)


class _Keep(TorchDispatchMode):
    """Forward of a region: the outputs of the operators ``mode`` keeps, in call order."""

    def __init__(self, mode: str, kept: list) -> None:
        super().__init__()
        self.candidates = _CANDIDATES[mode]
        self.mode, self.kept = mode, kept

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in self.candidates and keeps(self.mode, func, args, kwargs or {}):
            detached = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out)
            self.kept.append((func, detached, [t._version for t in pytree.tree_leaves(detached)
                                               if isinstance(t, torch.Tensor)]))
        return out


class _Reuse(_Keep):
    """Recomputation of a region: a kept operator returns its forward output instead of running again."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in self.candidates and keeps(self.mode, func, args, kwargs or {}):
            if not self.kept or self.kept[0][0] is not func:
                raise RuntimeError(f"recomputing a region called {func} where its forward called "
                                   f"{self.kept[0][0] if self.kept else 'nothing more it keeps'}: the region is not "
                                   "deterministic, so recompute= cannot replay it; use recompute='none' for its layer")
            _, out, versions = self.kept.pop(0)
            if versions != [t._version for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]:
                raise RuntimeError(f"the output of {func} kept for backward was changed in place after the forward")
            return out
        return func(*args, **(kwargs or {}))


def keep_contexts(mode: str) -> tuple[_Keep, _Reuse]:
    """``context_fn`` of ``torch.utils.checkpoint``: the forward keeps what ``mode`` keeps, the recomputation
    reuses it (``create_selective_checkpoint_contexts`` of torch with a policy of ``keeps``, without the
    per-operator bookkeeping of what is not kept)."""
    kept: list = []
    return _Keep(mode, kept), _Reuse(mode, kept)


# -- ZeRO-3's view of the regions ---------------------------------------------------------------------
ShardedRegion = Callable[[tuple[torch.Tensor, ...]], Callable[[], ContextManager] | None]
_SHARDED_REGION: list[ShardedRegion] = []  # at most one: the ZeRO-3 runtime's (``runtime/zero_kernels.py``)


def on_sharded_region(hook: ShardedRegion) -> None:
    """Sets what a region that gathers ZeRO-3 shards calls in forward: ``hook(shards)`` returns None, or a
    function whose context manager backward enters around the region's recomputation."""
    _SHARDED_REGION[:] = [hook]


# -- the region wrapper --------------------------------------------------------------------------------
class _Ref:
    """A tensor handed to the checkpoint by reference: its saved inputs keep the object itself, so attributes
    the graph's ops read (a ZeRO-3 shard's group) survive into the recomputation."""

    __slots__ = ("value",)

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class Recompute(torch.nn.Module):
    """A region of a layer's forward whose activations backward recomputes (see the module doc).

    ``policy``: whether operator-level decisions are needed (``selective``, or a region that communicates);
    without it a ``full`` region is plain activation checkpointing, which dispatches nothing through Python.
    ``by_reference``: positions of inputs passed as themselves (ZeRO-3 shards), not as saved tensors.
    """

    def __init__(self, region: fx.GraphModule, mode: str, layer: str, *, policy: bool,
                 by_reference: tuple[int, ...] = ()) -> None:
        super().__init__()
        if mode not in ("selective", "full"):
            raise ValueError(f"a recomputed region is 'selective' or 'full', not {mode!r}")
        self.region = region
        self.mode = mode
        self.layer = layer
        self.policy = policy or mode == "selective"
        self.by_reference = frozenset(by_reference)

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing is kept for a backward that will not run
            return self.region(*args)
        recomputing = None
        if self.by_reference:
            if _SHARDED_REGION:
                recomputing = _SHARDED_REGION[0](tuple(args[i] for i in sorted(self.by_reference)))
            args = tuple(_Ref(a) if i in self.by_reference else a for i, a in enumerate(args))
        kwargs = {}
        if self.policy:
            kwargs["context_fn"] = functools.partial(keep_contexts, self.mode)
        # the recomputation runs on the forward's binding, inside what ZeRO-3 asked for (not the first run: forward)
        run = functools.partial(self._run, bound(), recomputing, [False])
        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    def _run(self, binding: Binding | None, recomputing: Callable[[], ContextManager] | None, ran: list[bool],
             *args: Any) -> Any:
        again, ran[0] = ran[0], True
        with bind(binding), (recomputing() if again and recomputing is not None else contextlib.nullcontext()):
            return self.region(*(a.value if isinstance(a, _Ref) else a for a in args))

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, layer={self.layer!r}"
