"""Where expert parallelism puts the routed experts: which rank holds which experts and parameters.

Expert ``e`` of a layer with ``E`` experts lives on ep index ``e // (E / ep)``: ep index ``i`` holds experts
``i * E/ep .. (i + 1) * E/ep - 1``. A parameter of one expert (a ``nn.ModuleList`` of experts) is held whole
by that expert's ep index and by no other; stacked expert weights (``(E, ...)``, Hugging Face's experts) are
held as rows ``i * E/ep ..`` (a ``Shard(0)`` over ``ep``). Either way every rank of one ``ep_replicate``
group holds the same ones, and their gradients are averaged over that group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.core.mesh import Mesh


@dataclass(frozen=True)
class ExpertLayer:
    """One layer's routed experts: its module, how many, top-k, the ep degree and its parameters."""

    name: str
    experts: int
    top_k: int
    ep: int
    params: tuple[str, ...]

    @property
    def local(self) -> int:
        return self.experts // self.ep

    def held_by(self, index: int) -> range:
        """The experts ep index ``index`` holds."""
        return range(index * self.local, (index + 1) * self.local)


@dataclass(frozen=True)
class ExpertParam:
    """A parameter of routed experts: one expert's (``expert``) or all of them stacked on dim 0 (None)."""

    layer: str
    experts: int
    ep: int
    expert: int | None = None

    @property
    def stacked(self) -> bool:
        return self.expert is None

    def holder(self) -> int | None:
        """The ep index that holds it whole (None: stacked, every ep index holds its rows)."""
        return None if self.stacked else self.expert // (self.experts // self.ep)

    def local(self, full: torch.Tensor, index: int) -> torch.Tensor:
        """What ep index ``index`` stores of ``full``: its rows, the whole tensor, or nothing."""
        if self.stacked:
            return full.chunk(self.ep, 0)[index]
        return full if self.holder() == index else full.new_empty(0)

    def local_shape(self, shape: tuple[int, ...], index: int) -> tuple[int, ...]:
        if self.stacked:
            return (shape[0] // self.ep, *shape[1:])
        return shape if self.holder() == index else (0,)

    def render(self) -> str:
        if self.stacked:
            return f"experts of {self.layer}: Shard(0) over ep (E/ep={self.experts // self.ep} rows per ep index)"
        return f"expert {self.expert} of {self.layer}: held by ep index {self.holder()}"


def render_experts(layers: list[ExpertLayer], mesh: Mesh) -> list[str]:
    """The plan's lines: which experts each rank holds, and how tokens travel."""
    ep = mesh.ep
    lines = [f"expert parallelism: ep={ep} folded onto dp={mesh.dp} (groups of {ep} consecutive dp ranks, e.g. "
             f"{mesh.group_of(0, 'ep')}); expert gradients averaged over the {mesh.dp // ep} ranks holding the "
             f"same experts (ep_replicate, e.g. {mesh.group_of(0, 'ep_replicate')})"]
    if mesh.hybrid:
        lines.append(f"    hybrid sharding: ZeRO shards each rank's experts over the {mesh['ep_shard']} ranks of its "
                     f"replica holding them (ep_shard, e.g. {mesh.group_of(0, 'ep_shard')}), averaged over the "
                     f"{mesh.dp_replicate} replicas (dp_replicate)")
    for layer in layers:
        held = "; ".join(f"ranks {[r for r in range(mesh.size) if mesh.coord(r, 'ep') == i]}: experts "
                         f"{layer.held_by(i).start}-{layer.held_by(i).stop - 1}" for i in range(ep))
        lines.append(f"    {layer.name}: {layer.experts} experts, top-{layer.top_k}; {held}")
    lines.append("    per layer and microbatch: expert counts exchanged (all_to_all), tokens dispatched to their "
                 "experts and combined back (all_to_all_v, variable splits), the same two backward")
    return lines
