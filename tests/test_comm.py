"""The one collective cost model (``autopar.core.comm``) that the solver and the planner share."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar.core.collectives  # noqa: F401  (registers torch.ops.autopar)
from autopar.core.comm import OPS, LinkCost, collective_time, conversion, conversion_time
from autopar.planner.cluster import Cluster
from autopar.planner.comm_time import ring_all_reduce, ring_gather

PLACEMENTS = [Partial(), Replicate(), Shard(0), Shard(1)]


def test_every_conversion_is_made_of_named_ops() -> None:
    for src in PLACEMENTS:
        for dst in PLACEMENTS:
            ops = conversion(src, dst)
            assert ops is not None, (src, dst)
            for op in ops:
                assert op in OPS and hasattr(torch.ops.autopar, op)


def test_each_conversion_ends_in_its_target_placement() -> None:
    for src in PLACEMENTS:
        for dst in PLACEMENTS:
            placement = src
            for name in conversion(src, dst):
                placement = OPS[name].placement_after(placement, OPS[name].dim_args(src, dst))
            assert placement == dst, (src, dst, conversion(src, dst))


def test_a_cluster_axis_prices_collectives_as_the_planner_does() -> None:
    cluster = Cluster.preset("dgx-a100")
    cost = cluster.axis_cost(span=8)
    assert cost == LinkCost(bandwidth=cluster.intra.bandwidth, latency=cluster.intra.latency)
    assert cluster.axis_cost(span=16).bandwidth == cluster.inter.bandwidth
    nbytes, n = 2**24, 8
    assert collective_time("all_reduce", nbytes, n, cost) == ring_all_reduce(nbytes, n, cluster.intra)
    assert collective_time("all_gather", nbytes, n, cost) == ring_gather(nbytes, n, cluster.intra)


def test_the_solvers_default_charges_a_reduce_scatter_as_an_all_reduce() -> None:
    from autopar.passes.sharding import DEFAULT_COST

    nbytes, n = 2**20, 4
    ring = nbytes * (n - 1) / n / DEFAULT_COST.bandwidth
    assert conversion_time(Partial(), Replicate(), nbytes, n, DEFAULT_COST) == pytest.approx(10e-6 + 2 * ring)
    assert conversion_time(Partial(), Shard(0), nbytes, n, DEFAULT_COST) == pytest.approx(2 * 10e-6 + 3 * ring)
    assert conversion_time(Shard(0), Shard(1), nbytes, n, DEFAULT_COST) == pytest.approx(2 * (10e-6 + ring / n))


def test_a_link_cost_names_its_bad_numbers() -> None:
    with pytest.raises(ValueError, match="bandwidth > 0"):
        LinkCost(bandwidth=0.0)
