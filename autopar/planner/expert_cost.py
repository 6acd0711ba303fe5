"""Routed experts as the planner sees them, and what expert parallelism changes in a configuration's cost.

``expert_profile(model)`` finds the model's routed-experts modules by what they hold (Hugging Face's stacked
``(E, ...)`` expert weights, ``gate_up_proj`` or ``up_proj`` and ``down_proj``; ``autopar/compiler/experts.py``
recognises the same modules for the runtime), with each layer's expert count ``E``, top-k ``k``, hidden
width ``H`` and expert parameter elements. The graph profile (``model_profile.py``) captures such a model
with its experts as one grouped matmul (the form that exports with symbolic shapes), whose FLOPs are the
routed ones: ``2 k P_e`` per token, ``P_e`` one expert's parameters. What runs differs by form and ep:

- ep = 1, experts written as a loop (``_experts_implementation = "eager"``): autopar captures the loop as
  dense dispatch, every expert on every token: ``2 E P_e`` per token, ``E / k`` times the routed FLOPs;
- ep = 1, grouped matmul: the routed FLOPs (``2 k P_e``), replicated on every tp rank;
- ep > 1: each rank runs its ``E / ep`` experts on the rows routed to them, ``2 k P_e`` per token on average,
  times ``imbalance`` on the busiest rank (uneven routing: the most loaded rank over the mean).

Under ep each rank stores ``1 / ep`` of the expert parameters (and so of their gradients and optimizer
state, and of the bytes their gradient reduction moves), whole on every tp rank: the expert-parallel op is
one node to the tp solver with every input replicated (``passes/sharding.py``), so a rank holds its ``E / ep``
experts unsharded, not the tp shard the graph profile has at ep = 1, and runs them on all its rows (the FLOPs
above, repeated on the tp ranks, as the profile counts the grouped matmul at any tp). Each layer adds four
all-to-alls per microbatch
(``autopar/core/expert_ops.py``): the tokens dispatched to their experts and combined back, forward, and the
same two in backward, each sending ``T k H`` activation elements per rank (``T`` tokens of the microbatch,
the rank's own rows included), plus the exchange of ``ep x E / ep`` row counts (8-byte integers).

Invariant: with ``ep == 1`` and the grouped form, ``routed`` returns the segment's values unchanged.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from autopar.planner.cluster import Link
from autopar.planner.comm_time import collective
from autopar.planner.config import Config
from autopar.planner.segment_values import SegmentValues

COUNT_BYTES = 8  # an exchanged row count: int64


@dataclass(frozen=True)
class ExpertLayerProfile:
    """One routed-experts module: its path, ``E`` experts, top-``k``, hidden width, form and parameters."""

    name: str
    experts: int
    top_k: int
    hidden: int
    params: int  # elements of all ``E`` experts
    form: str  # "eager": a loop over the experts (dense dispatch at ep=1); "grouped": one grouped matmul
    tensors: tuple[tuple[str, int], ...]  # each parameter's path and elements, all ``E`` experts

    @property
    def per_expert(self) -> int:
        return self.params // self.experts

    def held(self, param: str, ep: int) -> int:
        """Elements of ``param`` (one of this module's) a rank holds at ``ep > 1``: its ``E / ep`` experts'
        rows of the stacked tensor, whole whatever the tp size (the module doc)."""
        return dict(self.tensors)[param] // ep

    def flops_per_token(self, ep: int, imbalance: float) -> float:
        """Forward FLOPs of this layer's experts per token on the busiest rank (see the module doc)."""
        routed = 2 * self.top_k * self.per_expert
        if ep > 1:
            return routed * imbalance
        return 2 * self.experts * self.per_expert if self.form == "eager" else routed

    def extra_flops_per_token(self, ep: int, imbalance: float) -> float:
        """What runs beyond the graph profile's routed FLOPs (``2 k P_e``), per token."""
        return self.flops_per_token(ep, imbalance) - 2 * self.top_k * self.per_expert


@dataclass(frozen=True)
class ExpertProfile:
    """The model's routed-experts layers (one entry per module, every layer of the model)."""

    layers: tuple[ExpertLayerProfile, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {layer.name: layer for layer in self.layers})

    def ep_sizes(self, dp: int) -> list[int]:
        """The ep degrees ``Mesh(dp=dp, ep=...)`` can take: divisors of ``dp`` above 1 dividing every ``E``."""
        return [e for e in range(2, dp + 1) if dp % e == 0 and all(layer.experts % e == 0 for layer in self.layers)]

    def layer_of(self, param: str) -> ExpertLayerProfile | None:
        """The experts module a parameter (``"model.layers.1.mlp.experts.down_proj"``) belongs to, if any."""
        return self._by_name.get(param.rpartition(".")[0])  # type: ignore[attr-defined]

    @property
    def forms(self) -> set[str]:
        return {layer.form for layer in self.layers}


def expert_profile(model: torch.nn.Module) -> ExpertProfile | None:
    """The routed-experts modules of ``model`` (None when it has none)."""
    layers = [layer for name, m in model.named_modules() if (layer := _stacked(name, m)) is not None]
    return ExpertProfile(tuple(layers)) if layers else None


def _stacked(name: str, module: torch.nn.Module) -> ExpertLayerProfile | None:
    """Hugging Face's stacked experts: ``down_proj`` (E, ., .) and ``gate_up_proj`` or ``up_proj`` (E, ., .)."""
    down = getattr(module, "down_proj", None)
    up = getattr(module, "gate_up_proj", None)
    up = getattr(module, "up_proj", None) if up is None else up
    if not (isinstance(down, torch.Tensor) and isinstance(up, torch.Tensor) and down.dim() == 3 and up.dim() == 3):
        return None
    config = getattr(module, "config", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if top_k is None:
        return None
    transposed = getattr(module, "is_transposed", False)
    hidden = getattr(module, "hidden_dim", None) or down.shape[2 if transposed else 1]
    form = "eager" if getattr(config, "_experts_implementation", None) == "eager" else "grouped"
    tensors = tuple((f"{name}.{n}", p.numel()) for n, p in module.named_parameters(recurse=False))
    return ExpertLayerProfile(name=name, experts=down.shape[0], top_k=int(top_k), hidden=int(hidden),
                              params=sum(e for _, e in tensors), form=form, tensors=tensors)


class grouped_while_profiling:
    """Context manager: experts written as a loop run as Hugging Face's grouped matmul while the graph profile
    captures the model (the loop's data-dependent shapes do not export symbolically); restored on exit."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
                        and getattr(c, "_experts_implementation", None) == "eager"}

    def __enter__(self) -> None:
        for c in self.configs.values():
            c._experts_implementation = "grouped_mm"

    def __exit__(self, *exc: object) -> None:
        for c in self.configs.values():
            c._experts_implementation = "eager"


def routed(values: SegmentValues, experts: ExpertProfile, ep: int, imbalance: float, tokens: object) -> SegmentValues:
    """``values`` (a segment at one tp size and microbatch of ``tokens`` tokens) as it runs at ``ep``: the
    expert FLOPs of the form and degree; at ``ep > 1`` each expert parameter as a rank holds it
    (``ExpertLayerProfile.held``: ``1 / ep`` of it, whole on every tp rank)."""
    layers = layers_in(values, experts)
    if not layers or (ep == 1 and all(layer.form == "grouped" for layer in layers)):
        return values
    extra = sum(layer.extra_flops_per_token(ep, imbalance) for layer in layers) * tokens
    held = {k: layer.held(k, ep) for k in values.params if ep > 1 and (layer := experts.layer_of(k)) is not None}
    return dataclasses.replace(values, flops=values.flops + extra, params={**values.params, **held})


def all_to_all_bytes(values: SegmentValues, experts: ExpertProfile, tokens: object, act_bytes: int) -> object:
    """Bytes one rank sends (its own rows included) in one all-to-all of a segment's experts for a microbatch
    of ``tokens`` tokens: ``T k H`` elements per layer (a dispatch; a combine moves as many over the group)."""
    return sum(layer.top_k * layer.hidden for layer in layers_in(values, experts)) * tokens * act_bytes


def count_bytes(values: SegmentValues, experts: ExpertProfile, ep: int) -> int:
    """Bytes one rank sends in the row-count exchanges of a segment's experts (``ep x E/ep`` integers each)."""
    return sum(layer.experts for layer in layers_in(values, experts)) * COUNT_BYTES if ep > 1 else 0


def all_to_all_step(units: list[SegmentValues], experts: ExpertProfile, c: Config, seq_len: int,
                    act_bytes: int) -> tuple[int, Any]:
    """(calls, bytes) of the ep all-to-alls a rank holding ``units`` (at ``c``'s microbatch size) sends in one
    step, its own rows included: per microbatch and experts layer, the dispatch and the combine forward and both
    again in backward, ``T k H`` activation elements each, and the row-count exchange."""
    tokens = c.microbatch_size * seq_len
    rows = sum(all_to_all_bytes(u, experts, tokens, act_bytes) for u in units)
    counts = sum(count_bytes(u, experts, c.ep) for u in units)
    layers = sum(len(layers_in(u, experts)) for u in units)
    return 5 * layers * c.microbatches, c.microbatches * (4 * rows + counts)


def all_to_all_seconds(units: list[SegmentValues], experts: ExpertProfile, c: Config, seq_len: int,
                       act_bytes: int, link: Link, imbalance: float) -> Any:
    """Seconds of one microbatch's ep all-to-alls on a rank holding ``units``: per layer four of the busiest
    rank's ``imbalance`` times the balanced bytes, and a latency-bound row-count exchange."""
    tokens = c.microbatch_size * seq_len
    out: Any = 0
    for u in units:
        layers = layers_in(u, experts)
        if layers:
            rows = all_to_all_bytes(u, experts, tokens, act_bytes) / len(layers)
            each = collective("all_to_all", c.ep * rows * imbalance, c.ep, link)
            counts = collective("all_to_all", c.ep * count_bytes(u, experts, c.ep) / len(layers), c.ep, link)
            out += len(layers) * (4 * each + counts)
    return out


def expert_elements(units: list[SegmentValues], experts: ExpertProfile) -> tuple[int, int]:
    """(parameter, trainable parameter) elements of routed experts stored for ``units`` (each layer instance's,
    as ``units`` hold them: after ``routed``, a rank's ``1 / ep`` of them, whole on every tp rank)."""
    owned = [(e, k in u.trainable) for u in units for k, e in u.params.items() if experts.layer_of(k) is not None]
    return sum(e for e, _ in owned), sum(e for e, t in owned if t)


def layers_in(values: SegmentValues, experts: ExpertProfile) -> list[ExpertLayerProfile]:
    """The experts modules whose parameters a segment holds (a shortened layer stands for all of its kind)."""
    seen: dict[str, ExpertLayerProfile] = {}
    for k in values.params:
        if (layer := experts.layer_of(k)) is not None:
            seen[layer.name] = layer
    return list(seen.values())
