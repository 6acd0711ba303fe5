"""The device mesh: named axes, rank <-> coordinates, and the ranks of each axis group.

Axes are ordered outer -> inner in the order the user names them, so for
``Mesh(dp=2, pp=2, tp=2)`` the rank of coordinates ``(d, p, t)`` is
``(d * 2 + p) * 2 + t``: the innermost axis varies fastest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

AXES = ("dp", "pp", "tp")


@dataclass(frozen=True, init=False)
class Mesh:
    """A logical grid of ranks with named axes ``dp``, ``pp`` and ``tp``.

    ``Mesh(dp=2, tp=4)`` has 8 ranks; an axis left out has size 1.
    """

    axes: tuple[tuple[str, int], ...]

    def __init__(self, **sizes: int) -> None:
        if not sizes:
            raise ValueError("Mesh needs at least one axis, e.g. Mesh(dp=2)")
        for name, size in sizes.items():
            if name not in AXES:
                raise ValueError(
                    f"unknown mesh axis {name!r}; the axes are {', '.join(AXES)} (e.g. Mesh(dp=2, tp=2))"
                )
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"mesh axis {name}={size!r} must be an integer >= 1")
        object.__setattr__(self, "axes", tuple(sizes.items()))

    @classmethod
    def from_device_mesh(cls, device_mesh: Any) -> "Mesh":
        """A Mesh with the names and sizes of a ``torch.distributed.device_mesh.DeviceMesh``."""
        names = device_mesh.mesh_dim_names
        if names is None:
            raise ValueError(
                "the DeviceMesh has no dim names; build it with mesh_dim_names=('dp', 'tp') or similar"
            )
        return cls(**dict(zip(names, device_mesh.mesh.shape)))

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
        """The size of ``axis`` (1 for an axis the mesh does not name)."""
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; the axes are {', '.join(AXES)}")
        return dict(self.axes).get(axis, 1)

    @property
    def dp(self) -> int:
        return self["dp"]

    @property
    def pp(self) -> int:
        return self["pp"]

    @property
    def tp(self) -> int:
        return self["tp"]

    def coords(self, rank: int) -> dict[str, int]:
        """``{axis: index}`` of ``rank``, every axis of ``AXES`` included (0 where absent)."""
        self._check_rank(rank)
        out = dict.fromkeys(AXES, 0)
        for name, size in reversed(self.axes):
            out[name] = rank % size
            rank //= size
        return out

    def rank_of(self, **coords: int) -> int:
        """The rank at ``coords`` (absent axes are 0)."""
        rank = 0
        for name, size in self.axes:
            i = coords.get(name, 0)
            if not 0 <= i < size:
                raise ValueError(f"coordinate {name}={i} is outside the mesh axis of size {size}")
            rank = rank * size + i
        return rank

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of ranks that differ only along ``axis``, each ordered by index on it."""
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
        return [self.rank_of(**{**c, axis: i}) for i in range(self[axis])]

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.size:
            dims = " x ".join(f"{n}={s}" for n, s in self.axes)
            raise ValueError(
                f"world size {world_size} does not equal the mesh size {self.size} ({dims}); "
                f"launch {self.size} processes or change the mesh so its sizes multiply to {world_size}"
            )

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside the mesh of {self.size} ranks (0..{self.size - 1})")

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in self.axes) + ")"
