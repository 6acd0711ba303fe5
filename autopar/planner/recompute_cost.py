"""What activation recomputation keeps and repeats: the planner's side of ``passes/recompute.py``.

Per microbatch, a segment keeps between its forward and its backward
(``kept``):

- ``"none"``, and the head and tail under any mode (they are not layers, so
  they are never recomputed): everything autograd saves, ``activations``;
- a layer under ``"full"``: its inputs from the layer before it
  (``entering - entering_head``) and the forward outputs of its tp collectives
  (``communicated``), which autopar keeps so that backward repeats no
  communication;
- a layer under ``"selective"``: that, plus the outputs of its matmuls and
  attention (``kept_selective``).

A value the head makes and every layer reads (RoPE's cos and sin) is one
tensor, kept once per stage: the largest ``entering_head`` of the stage's
recomputed layers. Layers may run different modes (``Config.full_layers``:
the first layers of each stage ``"full"``, the others ``"selective"``):
``kept`` and ``rebuilt`` take one mode per unit. While backward re-runs a layer, that layer's other activations exist
once more (``rebuilt``). Backward repeats each recomputed layer's forward
compute: all of it under ``"full"``, the memory-bound operators (traffic and
per-operator overhead, no matmul FLOPs) under ``"selective"`` (``redo``).

``recompute_collectives`` describes Megatron-LM's full recomputation instead,
which keeps only each layer's input and runs its all-reduces again.

Invariant: ``kept`` under ``"none"`` is the activations term the cost model
always had; every term is built from the same profile quantities
(``Part.saved``, ``entering``, ``kept_selective``, ``communicated``), in the
same bytes.
"""
from __future__ import annotations

from typing import Any, Sequence

from autopar.planner.expr import largest

Modes = str | Sequence[str]  # one recompute mode for every unit, or one per unit


def _per_unit(mode: Modes, units: list[Any]) -> list[str]:
    return [mode] * len(units) if isinstance(mode, str) else list(mode)



def kept_unit(mode: str, u: Any, *, recompute_collectives: bool = False) -> Any:
    """Bytes segment ``u`` keeps per microbatch under ``mode``, without the values shared by all layers."""
    if mode == "none" or u.kind != "layer":
        return u.activations
    own = u.entering - u.entering_head
    if recompute_collectives:
        return own
    return own + u.communicated + (u.kept_selective if mode == "selective" else 0)


def kept(mode: Modes, units: list[Any], *, recompute_collectives: bool = False) -> Any:
    """Bytes a stage of ``units`` keeps per microbatch under ``mode`` (one mode for all, or one per unit),
    the values the head made for every layer once."""
    modes = _per_unit(mode, units)
    total = sum(kept_unit(m, u, recompute_collectives=recompute_collectives) for m, u in zip(modes, units))
    heads = [u.entering_head for m, u in zip(modes, units) if u.kind == "layer" and m != "none"]
    return total + largest(heads) if heads else total


def rebuilt(mode: Modes, units: list[Any], *, recompute_collectives: bool = False) -> Any:
    """Bytes one layer's recomputation adds while its backward runs: the most of any recomputed layer of
    ``units`` (``mode``: one for all, or one per unit)."""
    return largest([u.activations - kept_unit(m, u, recompute_collectives=recompute_collectives)
                 for m, u in zip(_per_unit(mode, units), units) if u.kind == "layer" and m != "none"])


def redo(mode: str, u: Any, matmul_s: Any, other_s: Any) -> Any:
    """Seconds of forward compute backward repeats for segment ``u``: ``matmul_s`` (FLOPs-bound) and ``other_s``
    (memory-bound operators and per-operator overhead) of its forward."""
    if mode == "none" or u.kind != "layer":
        return 0
    return other_s if mode == "selective" else matmul_s + other_s
