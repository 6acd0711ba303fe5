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
