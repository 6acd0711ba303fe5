from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autopar import Mesh
from autopar.core.mesh import AXES, Coords


def test_rank_layout_matches_the_contract() -> None:
    mesh = Mesh(dp=2, pp=2, tp=2)
    for rank in range(8):
        c = mesh.coords(rank)
        assert rank == (c.dp * 2 + c.pp) * 2 + c.tp
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_axis_order_is_the_keyword_order() -> None:
    mesh = Mesh(tp=2, dp=3)
    assert mesh.names == ("tp", "dp")
    assert mesh.coords(1) == Coords(dp=1, pp=0, tp=0)
    assert mesh.groups("dp") == [[0, 1, 2], [3, 4, 5]]
    assert mesh.pp == 1


def test_coordinates_name_every_axis() -> None:
    """A rank's coordinates are a record with one field per mesh axis; a variable axis is read with ``on``."""
    assert tuple(f.name for f in dataclasses.fields(Coords)) == AXES
    c = Mesh(dp=2, pp=3, tp=2).coords(11)
    assert (c.on("dp"), c.pp, c.tp) == (1, 2, 1) and c.replace(pp=0) == Coords(dp=1, pp=0, tp=1)
    with pytest.raises(ValueError, match="unknown mesh axis 'ep'"):
        c.on("ep")


@given(st.dictionaries(st.sampled_from(["dp", "pp", "tp"]), st.integers(1, 4), min_size=1))
def test_coords_roundtrip_and_groups_partition(sizes: dict[str, int]) -> None:
    mesh = Mesh(**sizes)
    for rank in range(mesh.size):
        assert mesh.rank_at(mesh.coords(rank)) == rank
    for axis in mesh.names:
        groups = mesh.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(mesh.size))
        for g in groups:
            assert all(mesh.group_of(r, axis) == g for r in g)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"dp": 0}, "dp=0 must be an integer >= 1"), ({"xp": 2}, "unknown mesh axis 'xp'"),
     ({"ep": 2}, "at least one axis"), ({}, "at least one axis")],
)
def test_bad_mesh(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Mesh(**kwargs)


def test_world_size_check_names_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"world size 2 does not equal the mesh size 4 \(dp=2 x tp=2\)"):
        Mesh(dp=2, tp=2).check_world_size(2)
