"""A cluster description with a missing or impossible figure fails where it is made, naming the field and value."""
from __future__ import annotations

import math

import pytest

from autopar.planner.cluster import Cluster, Link

A100 = Cluster.preset("dgx-a100")


@pytest.mark.parametrize("changes, message", [
    ({"memory": 0}, "memory=0 must be a number > 0 (bytes of memory a device offers to training)"),
    ({"memory": -80e9}, "memory=-80000000000.0 must be a number > 0"),
    ({"memory": None}, "memory=None must be a number > 0"),
    ({"peak_flops": 0}, "peak_flops=0 must be a number > 0 (dense FLOP/s of a device's mixed-precision"),
    ({"peak_flops_fp32": -1}, "peak_flops_fp32=-1 must be a number > 0"),
    ({"devices_per_node": 0}, "devices_per_node=0 must be an integer >= 1 (devices in one node)"),
    ({"devices_per_node": 2.5}, "devices_per_node=2.5 must be an integer >= 1"),
    ({"memory_bandwidth": math.nan}, "memory_bandwidth=nan must be a number > 0"),
    ({"efficiency": 1.5}, "efficiency=1.5 must be a number > 0 and <= 1"),
    ({"contention": -0.1}, "contention=-0.1 must be a number >= 0 and <= 1"),
    ({"cores": -2}, "cores=-2 must be an integer >= 0"),
    ({"inter": "25e9"}, "inter='25e9' must be a Link(bandwidth=..., latency=...)"),
])
def test_an_impossible_cluster_figure_is_an_error_at_construction(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match="cluster 'DGX-A100 .*" + message.replace("(", r"\(").replace(")", r"\)")
                       .replace("+", r"\+").replace(".", r"\.")):
        A100.replace(**changes)


@pytest.mark.parametrize("changes, message", [
    ({"bandwidth": 0}, "link: bandwidth=0 must be a number > 0 (bytes per second one device sends"),
    ({"bandwidth": -25e9}, "link: bandwidth=-25000000000.0 must be a number > 0"),
    ({"bandwidth": math.inf}, "link: bandwidth=inf must be a number > 0"),
    ({"latency": -1e-6}, "link: latency=-1e-06 must be a number >= 0 (seconds of one message step)"),
    ({"gather": 0}, "link: gather=0 must be a number > 0"),
])
def test_an_impossible_link_figure_is_an_error_at_construction(changes: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        Link(**{"bandwidth": 25e9, "latency": 1e-5, **changes})
    assert message in str(info.value)


def test_a_missing_figure_is_named() -> None:
    with pytest.raises(TypeError, match="peak_flops"):
        Cluster(name="x", devices_per_node=8, memory=80e9, peak_flops_fp32=1e12, intra=A100.intra, inter=A100.inter)
    described = {"name": "x", "devices_per_node": 8, "peak_flops": 1e12, "peak_flops_fp32": 1e11,
                 "intra": {"bandwidth": 1e11, "latency": 0}, "inter": {"bandwidth": 1e10}}
    with pytest.raises(ValueError, match=r"my.json: missing memory \(bytes of memory a device offers to training\)"):
        Cluster.from_dict(described, source="my.json")
    with pytest.raises(ValueError, match=r"my.json, inter: missing latency \(seconds of one message step\)"):
        Cluster.from_dict({**described, "memory": 8e10}, source="my.json")
    with pytest.raises(ValueError, match="my.json: unknown field hbm_gb; the fields are name, devices_per_node"):
        Cluster.from_dict({**described, "memory": 8e10, "hbm_gb": 80}, source="my.json")


def test_a_described_cluster_equals_the_preset_it_describes() -> None:
    import dataclasses

    assert Cluster.from_dict(dataclasses.asdict(A100)) == A100
    assert A100.updated({"memory": 40e9, "inter.bandwidth": 12.5e9}) == A100.replace(
        memory=40e9, inter=Link(12.5e9, A100.inter.latency))


def test_a_ring_spanning_nodes_pays_the_network_latency_only_between_nodes() -> None:
    """NCCL's ring model (src/graph/tuning.cc): of a ring's n - 1 steps, one per node boundary crosses the network;
    the others run on NVLink. The bandwidth is the network's, the ring's slowest link."""
    intra, inter = A100.intra.latency, A100.inter.latency
    assert A100.link(8, 8) == A100.intra and A100.link(16) == A100.inter
    assert A100.link(16 * 8, 16) == A100.inter  # stride 8: one rank per node, every step crosses the network
    two_nodes = A100.link(16, 16)
    assert two_nodes.bandwidth == A100.inter.bandwidth
    assert two_nodes.latency * 15 == pytest.approx(14 * intra + 1 * inter)
    assert A100.link(32, 16).latency * 15 == pytest.approx(12 * intra + 3 * inter)  # stride 2: 4 ranks in each of 4
    assert A100.link(1536, 1536).latency * 1535 == pytest.approx(1344 * intra + 191 * inter)  # 192 nodes


def test_zeros_collectives_over_nodes_are_priced_on_that_ring() -> None:
    """ZeRO-3 over 16 ranks in two nodes: each gather's 15 steps take NVLink's latency 14 times; with one rank in
    each node (pp=8 between them) all 15 take the network's."""
    import dataclasses

    from autopar.planner import gpt
    from autopar.planner.cost_model import PRECISIONS, Config, CostModel
    from autopar.planner.model_profile import profile_model
    from autopar.planner.step_sim import Kind

    profile = profile_model(gpt(8, 256, 8, vocab=1024), tp_sizes=(1,))
    flat = A100.replace(intra=dataclasses.replace(A100.intra, latency=A100.inter.latency))  # every step the same
    saved = 14 * (A100.inter.latency - A100.intra.latency)
    for config, per_call in ((Config(dp=16, zero=3, microbatch_size=1), saved),
                             (Config(dp=16, pp=8, zero=3, microbatch_size=1), 0.0)):
        seconds = [[(e.seconds, e.stream) for e in CostModel(profile, cluster, PRECISIONS["mixed"], seq_len=256)
                    .step_program(config) if e.kind in (Kind.GATHER, Kind.REDUCE_SCATTER)] for cluster in (A100, flat)]
        assert seconds[0] and len(seconds[0]) == len(seconds[1])
        for (got, stream), (steps_alike, _) in zip(*seconds):
            assert stream == "inter" and got == pytest.approx(steps_alike - per_call, rel=1e-9)
    hybrid = Config(dp=16, zero=3, dp_shard=4, microbatch_size=1)  # replicas 4 ranks apart: 2 in each of 2 nodes
    across = [[e.seconds for e in CostModel(profile, cluster, PRECISIONS["mixed"], seq_len=256).step_program(hybrid)
               if e.kind is Kind.REPLICATE] for cluster in (A100, flat)]
    assert across[0] and all(got == pytest.approx(alike - 2 * 2 * (A100.inter.latency - A100.intra.latency), rel=1e-9)
                             for got, alike in zip(*across))  # an all-reduce: 2 x 3 steps, 2 x 2 of them in a node
