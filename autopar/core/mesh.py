"""The device mesh: named axes, rank <-> coordinates, and the ranks of each axis group.

Axes are ordered outer -> inner in the order the user names them, so for
``Mesh(dp=2, pp=2, tp=2)`` the rank of coordinates ``(d, p, t)`` is
``(d * 2 + p) * 2 + t``: the innermost axis varies fastest.

Hybrid sharding splits dp into two sub-axes, outer -> inner as well:
``Mesh(dp=(R, S), ...)`` is a dp axis of ``R * S`` ranks whose index is
``d = r * S + s`` (``r`` on ``dp_replicate``, ``s`` on ``dp_shard``), so the
rank formula over the axes is unchanged. ZeRO shards over ``dp_shard`` (the
``S`` dp ranks of one replica; with dp outermost, ``S * pp * tp`` consecutive
ranks, e.g. a node) and the ``R`` replicas hold the same shards.

Expert parallelism folds onto dp's ranks and adds none: ``Mesh(dp=4, ep=2)`` has 4 ranks, and dp index
``d = g * ep + i`` is expert-parallel index ``i`` (sub-axis ``ep``: ``ep`` consecutive dp ranks that split
the routed experts between them and exchange tokens) of group ``g`` (sub-axis ``ep_replicate``: the
``dp / ep`` ranks holding the same experts, over which those experts' gradients are reduced). Under hybrid
sharding ``ep`` divides the shard size, so each ep group lies inside one replica, and ZeRO shards the routed
experts' state over sub-axis ``ep_shard``: the ``dp_shard / ep`` ranks of one replica holding the same experts
(``mesh.expert_zero_axis``; without hybrid sharding it is ``ep_replicate``). The rank of the same ``dp_shard``
index in every replica holds the same experts and the same slice of them, so ``dp_replicate`` averages those
slices as it does the dense ones.

Context parallelism is an axis of its own, multiplying the world size: ``Mesh(dp=2, cp=2)`` has 4 ranks, each
cp rank holding a slice of every sequence (docs/decisions.md). Parameters are replicated over cp; their
gradients are averaged over the ``dp_cp`` group (the ``dp * cp`` ranks that differ only on dp and cp), as
torchtitan's ``dp_shard_cp`` mesh does. ZeRO shards over that group too (``zero_axis``), or under hybrid sharding over each
replica's ``dp_shard_cp`` ranks (its dp_shard ranks times cp).

Unified sequence parallelism splits cp into two sub-axes, outer -> inner as dp's: ``Mesh(cp=(R, A))`` is a cp axis
of ``R * A`` ranks whose index is ``c = r * A + a`` (``r`` on ``cp_ring``, ``a`` on ``cp_a2a``). The ``A``
consecutive cp ranks of one ``cp_a2a`` group exchange heads for sequence; the ``R`` groups pass K/V blocks around
``cp_ring`` (``parallelize(cp_attention="usp")``, autopar/core/usp.py).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

AXES = ("dp", "cp", "pp", "tp")
DP_SUBAXES = ("dp_replicate", "dp_shard")  # hybrid sharding: dp=(replicate, shard)
EP_SUBAXES = ("ep", "ep_replicate", "ep_shard")  # expert parallelism folded onto dp: dp = ep_replicate x ep;
# ep_shard: the ep_replicate ranks inside one hybrid-sharding replica
DP_CP = "dp_cp"  # the ranks that differ only on dp and cp: where gradients are averaged under context parallelism
DP_SHARD_CP = "dp_shard_cp"  # hybrid sharding with cp: the ranks of one replica that differ only on dp and cp
CP_SUBAXES = ("cp_ring", "cp_a2a")  # unified sequence parallelism: cp=(ring, a2a)


@dataclass(frozen=True)
class Coords:
    """A rank's index on every axis of ``AXES`` (0 on an axis the mesh does not name)."""

    dp: int = 0
    cp: int = 0
    pp: int = 0
    tp: int = 0

    def on(self, axis: str) -> int:
        """The index on ``axis`` when the axis is a variable (``coords.pp`` when it is not)."""
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; the axes are {', '.join(AXES)}")
        return getattr(self, axis)

    def replace(self, **moved: int) -> Coords:
        """These coordinates moved along the axes named: ``coords.replace(pp=0)``."""
        return dataclasses.replace(self, **moved)


@dataclass(frozen=True, init=False)
class Mesh:
    """A logical grid of ranks with named axes ``dp``, ``cp``, ``pp`` and ``tp``.

    ``Mesh(dp=2, tp=4)`` has 8 ranks; an axis left out has size 1. ``Mesh(dp=(2, 4), tp=2)``: hybrid
    sharding, dp of 8 ranks as 2 replicas of 4 ZeRO shards (sub-axes ``dp_replicate`` and ``dp_shard``).
    ``Mesh(dp=4, ep=2)``: 4 ranks, the routed experts split over groups of 2 consecutive dp ranks.
    ``Mesh(cp=(2, 2))``: cp of 4 ranks as a ring of 2 groups of 2 that exchange heads (sub-axes ``cp_ring`` and
    ``cp_a2a``).
    """

    axes: tuple[tuple[str, int], ...]
    dp_split: tuple[int, int] | None  # hybrid sharding: (replicate, shard) sizes of dp; None: plain dp
    ep: int  # expert parallelism: dp ranks that split the routed experts (1: every rank holds all)
    cp_split: tuple[int, int] | None  # unified sequence parallelism: (ring, a2a) sizes of cp; None: plain cp

    def __init__(self, **sizes: int | tuple[int, int]) -> None:
        ep = sizes.pop("ep", 1)
        if not _is_size(ep):
            raise ValueError(f"mesh axis ep={ep!r} must be an integer >= 1")
        if not sizes:
            raise ValueError("Mesh needs at least one axis, e.g. Mesh(dp=2)")
        split, cp_split = None, None
        for name, size in sizes.items():
            if name not in AXES:
                raise ValueError(
                    f"unknown mesh axis {name!r}; the axes are {', '.join(AXES)} (e.g. Mesh(dp=2, tp=2))"
                )
            if name == "dp" and isinstance(size, tuple):
                if len(size) != 2 or not all(_is_size(s) for s in size):
                    raise ValueError(f"mesh axis dp={size!r}: hybrid sharding takes a pair (replicate, shard) of "
                                     "integers >= 1, e.g. Mesh(dp=(2, 4)) for 2 replicas of 4 ZeRO shards")
                split = (size[0], size[1])
            elif name == "cp" and isinstance(size, tuple):
                if len(size) != 2 or not all(_is_size(s) for s in size):
                    raise ValueError(f"mesh axis cp={size!r}: unified sequence parallelism takes a pair (ring, a2a) "
                                     "of integers >= 1, e.g. Mesh(cp=(2, 4)) for a ring of 2 groups of 4 ranks that "
                                     "exchange heads")
                cp_split = (size[0], size[1])
            elif not _is_size(size):
                hint = (" (only dp takes a pair, for hybrid sharding, and cp, for unified sequence parallelism)"
                        if isinstance(size, tuple) else "")
                raise ValueError(f"mesh axis {name}={size!r} must be an integer >= 1{hint}")
        object.__setattr__(self, "axes", tuple((n, math.prod(s) if isinstance(s, tuple) else s)
                                               for n, s in sizes.items()))
        object.__setattr__(self, "dp_split", split)
        object.__setattr__(self, "ep", ep)
        object.__setattr__(self, "cp_split", cp_split)
        dp = self["dp"]
        if dp % ep:
            fits = [k for k in range(1, dp + 1) if dp % k == 0]
            raise ValueError(f"ep={ep} must divide dp={dp}: expert parallelism folds onto the dp ranks (dp = "
                             f"ep_replicate x ep); use ep in {fits} or a dp that is a multiple of {ep}")
        if split is not None and split[1] % ep:
            fits = [k for k in range(1, split[1] + 1) if split[1] % k == 0]
            raise ValueError(f"ep={ep} must divide the shard size {split[1]} of dp={split}: each ep group exchanges "
                             f"tokens inside one replica; use ep in {fits} or a shard size that is a multiple of "
                             f"{ep} (e.g. dp=({split[0] * split[1] // ep}, {ep}))")

    @classmethod
    def from_device_mesh(cls, device_mesh: Any) -> "Mesh":
        """A Mesh with the names and sizes of a ``torch.distributed.device_mesh.DeviceMesh``."""
        names = device_mesh.mesh_dim_names
        if names is None:
            raise ValueError(
                "the DeviceMesh has no dim names; build it with mesh_dim_names=('dp', 'tp') or similar"
            )
        sizes: dict[str, Any] = dict(zip(names, device_mesh.mesh.shape))
        for axis, (outer, inner), what in (("dp", DP_SUBAXES, "hybrid sharding"),
                                           ("cp", CP_SUBAXES, "unified sequence parallelism")):
            if not {outer, inner} & set(sizes):
                continue
            i = names.index(outer) if outer in names else -1
            if tuple(names[i: i + 2]) != (outer, inner):
                raise ValueError(f"the DeviceMesh has dims {names}: {what} needs {outer!r} immediately followed by "
                                 f"{inner!r} (outer -> inner)")
            sizes = {(axis if n == outer else n): ((s, sizes[inner]) if n == outer else s)
                     for n, s in sizes.items() if n != inner}
        return cls(**sizes)

    def split_dp(self, shard: int) -> "Mesh":
        """This mesh with dp split into replicas of ``shard`` ZeRO shards: ``Mesh(dp=8, tp=2).split_dp(4)`` is
        ``Mesh(dp=(2, 4), tp=2)``."""
        dp = self.dp
        if not _is_size(shard) or dp % shard:
            fits = [k for k in range(1, dp + 1) if dp % k == 0]
            raise ValueError(f"hybrid sharding with shard={shard!r} on dp={dp}: the shard size must divide dp "
                             f"(dp = replicate x shard); use one of {fits}")
        return Mesh(**{n: ((dp // shard, shard) if n == "dp" else self.sizes[n]) for n in self.names}, ep=self.ep)

    @property
    def sizes(self) -> dict[str, int | tuple[int, int]]:
        """The keyword arguments that build this mesh (without ``ep``): ``Mesh(**mesh.sizes, ep=mesh.ep)``."""
        splits = {"dp": self.dp_split, "cp": self.cp_split}
        return {n: splits.get(n) or s for n, s in self.axes}

    # sizes and coordinates -------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __getitem__(self, axis: str) -> int:
        """The size of ``axis`` or dp sub-axis (1 for an axis the mesh does not name)."""
        if axis in DP_SUBAXES:
            return self.dp_replicate if axis == DP_SUBAXES[0] else self.dp_shard
        if axis in EP_SUBAXES:
            return self.ep if axis == "ep" else (self.dp if axis == "ep_replicate" else self.dp_shard) // self.ep
        if axis in CP_SUBAXES:
            return (self.cp_split or (self.cp, 1))[CP_SUBAXES.index(axis)]
        if axis == DP_CP:
            return self.dp * self.cp
        if axis == DP_SHARD_CP:
            return self.dp_shard * self.cp
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; the axes are {', '.join(AXES)}")
        return dict(self.axes).get(axis, 1)

    @property
    def dp(self) -> int:
        return self["dp"]

    @property
    def cp(self) -> int:
        return self["cp"]

    @property
    def pp(self) -> int:
        return self["pp"]

    @property
    def tp(self) -> int:
        return self["tp"]

    @property
    def hybrid(self) -> bool:
        """Whether dp is split into replicas of ZeRO shards (``Mesh(dp=(replicate, shard))``)."""
        return self.dp_split is not None

    @property
    def dp_replicate(self) -> int:
        """Replicas of the ZeRO shards (1 without hybrid sharding)."""
        return self.dp_split[0] if self.dp_split is not None else 1

    @property
    def dp_shard(self) -> int:
        """dp ranks ZeRO shards over: the shard size under hybrid sharding, else all of dp."""
        return self.dp_split[1] if self.dp_split is not None else self.dp

    @property
    def expert_zero_axis(self) -> str:
        """The axis ZeRO shards the routed experts' state over: the ranks holding the same experts, inside one
        replica under hybrid sharding (``ep_shard``), else all of them (``ep_replicate``)."""
        return "ep_shard" if self.hybrid else "ep_replicate"

    @property
    def zero_axis(self) -> str:
        """The axis ZeRO shards over: ``dp`` or, under hybrid sharding, ``dp_shard``; under context parallelism
        that times cp (``dp_cp``, ``dp_shard_cp``: parameters are replicated over cp, so their state is sharded
        over the cp ranks too; docs/decisions.md)."""
        if self.cp > 1:
            return DP_SHARD_CP if self.hybrid else DP_CP
        return DP_SUBAXES[1] if self.hybrid else "dp"

    def coord(self, rank: int, axis: str) -> int:
        """``rank``'s index on ``axis`` or on a dp sub-axis."""
        d = self.coords(rank)
        if axis in DP_SUBAXES:
            r, s = divmod(d.dp, self.dp_shard)
            return r if axis == DP_SUBAXES[0] else s
        if axis in EP_SUBAXES:
            g, i = divmod(d.dp if axis != "ep_shard" else d.dp % self.dp_shard, self.ep)
            return i if axis == "ep" else g
        if axis in CP_SUBAXES:
            return divmod(d.cp, self["cp_a2a"])[CP_SUBAXES.index(axis)]
        if axis == DP_CP:  # (the order of ``group_of``: dp-major)
            return d.dp * self.cp + d.cp
        if axis == DP_SHARD_CP:
            return d.dp % self.dp_shard * self.cp + d.cp
        return d.on(axis)

    def coords(self, rank: int) -> Coords:
        """``rank``'s index on every axis of ``AXES`` (0 where absent)."""
        self._check_rank(rank)
        out = {}
        for name, size in reversed(self.axes):
            out[name] = rank % size
            rank //= size
        return Coords(**out)

    def rank_at(self, coords: Coords) -> int:
        """The rank at ``coords``."""
        rank = 0
        for name, size in self.axes:
            i = coords.on(name)
            if not 0 <= i < size:
                raise ValueError(f"coordinate {name}={i} is outside the mesh axis of size {size}")
            rank = rank * size + i
        return rank

    def rank_of(self, **coords: int) -> int:
        """The rank at ``coords`` (absent axes are 0): ``mesh.rank_of(pp=1, tp=0)``."""
        return self.rank_at(Coords(**coords))

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of ranks that differ only along ``axis`` (or dp sub-axis), each ordered by index on it."""
        if axis in DP_SUBAXES + EP_SUBAXES + CP_SUBAXES + (DP_CP, DP_SHARD_CP):
            return [list(g) for g in dict.fromkeys(tuple(self.group_of(r, axis)) for r in range(self.size))]
        size = self[axis]
        others = [(n, s) for n, s in self.axes if n != axis]
        groups = []
        for flat in range(self.size // size):
            fixed = {}
            for name, s in reversed(others):
                fixed[name] = flat % s
                flat //= s
            groups.append([self.rank_of(**fixed, **{axis: i}) for i in range(size)])
        return groups

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The ranks of ``rank``'s group along ``axis``."""
        c = self.coords(rank)
        if axis in DP_SUBAXES:
            n = self.dp_shard
            r, s = divmod(c.dp, n)
            dps = range(r * n, (r + 1) * n) if axis == DP_SUBAXES[1] else range(s, self.dp, n)
            return [self.rank_at(c.replace(dp=d)) for d in dps]
        if axis == "ep_shard":  # the replica's dp ranks with this ep index
            start = c.dp - c.dp % self.dp_shard
            dps = range(start + c.dp % self.ep, start + self.dp_shard, self.ep)
            return [self.rank_at(c.replace(dp=d)) for d in dps]
        if axis in EP_SUBAXES:
            g, i = divmod(c.dp, self.ep)
            dps = range(g * self.ep, (g + 1) * self.ep) if axis == "ep" else range(i, self.dp, self.ep)
            return [self.rank_at(c.replace(dp=d)) for d in dps]
        if axis in CP_SUBAXES:
            a = self["cp_a2a"]
            r, i = divmod(c.cp, a)
            cps = range(r * a, (r + 1) * a) if axis == "cp_a2a" else range(i, self.cp, a)
            return [self.rank_at(c.replace(cp=k)) for k in cps]
        if axis == DP_CP:
            return [self.rank_at(c.replace(dp=d, cp=i)) for d in range(self.dp) for i in range(self.cp)]
        if axis == DP_SHARD_CP:
            first = c.dp - c.dp % self.dp_shard  # (its replica's first dp index)
            return [self.rank_at(c.replace(dp=first + s, cp=i)) for s in range(self.dp_shard) for i in range(self.cp)]
        return [self.rank_at(c.replace(**{axis: i})) for i in range(self[axis])]

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.size:
            dims = " x ".join(self._sizes())
            raise ValueError(
                f"world size {world_size} does not equal the mesh size {self.size} ({dims}); "
                f"launch {self.size} processes or change the mesh so its sizes multiply to {world_size}"
            )

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside the mesh of {self.size} ranks (0..{self.size - 1})")

    def _sizes(self) -> list[str]:
        sizes = [f"{n}={s}" for n, s in self.sizes.items()]
        return sizes + [f"ep={self.ep}"] if self.ep > 1 else sizes

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(self._sizes()) + ")"


def _is_size(size: object) -> bool:
    return isinstance(size, int) and not isinstance(size, bool) and size >= 1
