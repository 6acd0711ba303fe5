"""The machines a plan is for: devices per node, links, peak FLOP/s and memory per device.

A ``Cluster`` is a small frozen value. The presets describe one kind of node
repeated (``dgx-a100``, ``dgx-h100``) and this machine's CPU ranks (``cpu``,
numbers measured once on a 2-core machine); ``Cluster.measure_local(ranks)``
measures the local machine anew on ``ranks`` processes.

Ranks are laid out as the mesh lays them out (``rank = ((dp_i * PP) + pp_i) *
TP + tp_i``) and filled node by node, so a group of ranks along an axis stays
inside one node when ``stride * size <= devices_per_node``; otherwise its
collectives run at the inter-node bandwidth of one device's network link.

The GPU numbers are data-sheet numbers (dense bf16 tensor-core peak, NVLink
bandwidth per direction, one InfiniBand link per GPU). ``efficiency`` and
``narrow`` say how close the model's matrix multiplications get to peak; for
the DGX presets they are fitted to published Megatron-LM results
(docs/planner.md).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

from autopar.core.comm import LinkCost
from autopar.planner.figures import CLUSTER_FIGURES, LINK_FIGURES, check_figures

GB = 1e9

# Compute beside a collective: Ragupathi et al. 2025, "Characterizing Compute-Communication Overlap in
# GPU-Accelerated Distributed Deep Learning: Performance and Power Implications" (arXiv:2507.03114) measure
# an average slowdown of computation of 18.9% (at most 40.0%) while collectives overlap it, over GPT and
# LLaMA layers on 4 A100s, H100s, MI250s and MI210s: overlapped, compute runs at 1 / 1.189 of its speed, so a
# collective takes 1 - 1 / 1.189 = 0.159 of the device's throughput while it runs.
CONTENTION = round(1 - 1 / 1.189, 3)


@dataclass(frozen=True)
class Link:
    """One device's connection to its peers: bytes per second in one direction, and the latency of one message.

    ``gather`` and ``scatter``: how many times the ring's time an all-gather
    and a reduce-scatter take (1 for NCCL's rings; gloo's reduce-scatter
    measures about 3 on CPU ranks). ``p2p_latency``: for ranks that share
    cores, the latency of a point-to-point message whose receiver has a core
    free (a pipeline hop) and of a step of a one-element collective (the
    loss): gloo's take a tenth of a tensor collective's step; a hop sent
    while every core is taken waits as long as a collective's step. None:
    ``latency``.
    """

    bandwidth: float
    latency: float
    gather: float = 1.0
    scatter: float = 1.0
    p2p_latency: float | None = None

    def __post_init__(self) -> None:
        check_figures("link", self, LINK_FIGURES)

    def cost(self) -> LinkCost:
        """The cost model's value for this link (``autopar.core.comm``): a collective's latency per ring step."""
        return LinkCost(bandwidth=self.bandwidth, latency=self.latency, gather=self.gather, scatter=self.scatter)

    def p2p(self) -> Link:
        """This link for a point-to-point message whose receiver has a core free."""
        return self if self.p2p_latency is None else dataclasses.replace(self, latency=self.p2p_latency)


@dataclass(frozen=True)
class Cluster:
    """Identical nodes of ``devices_per_node`` devices each.

    ``memory``: bytes a device offers to training (what is left after the
    runtime's own context); ``peak_flops``: dense FLOP/s of the mixed-precision
    (bf16) matmul units, ``peak_flops_fp32`` of fp32; ``efficiency``: the
    fraction of peak that large matmuls reach; ``narrow``: a matmul whose
    weight's narrower dim is ``w`` reaches ``efficiency * w / (w + narrow)``
    (0: every matmul reaches ``efficiency``); ``contention``: the share of
    a device's compute throughput a collective takes while it runs beside
    compute (its kernels take streaming multiprocessors and memory
    bandwidth): compute then runs at ``1 - contention`` of its speed (1:
    overlapping buys nothing, as for ranks sharing CPU cores).
    Nothing overlaps for free: the step is simulated (``step_sim.py``), and a
    collective hides only where the step program issues it ahead of compute;
    ``op_overhead``: seconds each operator costs beyond its FLOPs (kernel
    launch, dispatch);
    ``fused_attention``: attention kernels keep O(sequence) per head for
    backward (flash-style) rather than the attention matrix;
    ``memory_bandwidth``: bytes per second the optimizer step streams through
    a device's memory; ``cores``: for
    CPU ranks, the cores a node's ranks share (``peak_flops`` and
    ``op_overhead`` are then one rank's when it runs alone; a step takes at
    least the node's total work over its cores), 0 when every device
    computes on its own.
    """

    name: str
    devices_per_node: int
    memory: float
    peak_flops: float
    peak_flops_fp32: float
    intra: Link
    inter: Link
    efficiency: float = 0.5
    narrow: float = 0.0
    contention: float = CONTENTION
    op_overhead: float = 2e-6
    fused_attention: bool = True
    memory_bandwidth: float = 2e12
    cores: int = 0
    compiled_efficiency: float = 0.0  # ``efficiency`` of steps compiled by inductor, where fitted (0: not fitted)

    def __post_init__(self) -> None:
        for name in ("intra", "inter"):
            if not isinstance(getattr(self, name), Link):
                raise ValueError(f"cluster {self.name!r}: {name}={getattr(self, name)!r} must be a Link(bandwidth=..., "
                                 f"latency=...) (the link {'inside a node' if name == 'intra' else 'between nodes'})")
        check_figures(f"cluster {self.name!r}", self, CLUSTER_FIGURES)

    def peak(self, precision: str) -> float:
        """Peak FLOP/s for a precision's name: the bf16 units for "mixed", "bf16" (and "half"), else fp32."""
        return self.peak_flops if precision in ("mixed", "bf16", "half") else self.peak_flops_fp32

    def link(self, span: int, size: int | None = None) -> Link:
        """The link of a group whose ranks spread over ``span`` consecutive ranks (stride x size). Given the
        group's ``size``, a group spanning nodes with several ranks in each has a ring whose steps inside a node
        take the intra link's latency, only the steps between nodes the inter link's (NCCL's ring model:
        ``src/graph/tuning.cc``, ``(nsteps - nInterSteps) * intraLat + nInterSteps * interLat``); its bandwidth
        is the inter link's, the ring's slowest."""
        if span <= self.devices_per_node:
            return self.intra
        if size is None or size < 2:
            return self.inter
        per_node = max(1, self.devices_per_node // max(1, span // size))  # the group's ranks in one node
        return self.inter if per_node == 1 else _ring_link(self.intra, self.inter, size, -(-size // per_node))

    def axis_cost(self, span: int) -> LinkCost:
        """The collective cost of a mesh axis whose groups spread over ``span`` consecutive ranks (stride x size)."""
        return self.link(span).cost()

    def compiled(self) -> Cluster:
        """This cluster running inductor-compiled steps (``parallelize(compile=True)``): ``compiled_efficiency``
        where it was fitted, else ``efficiency`` times ``COMPILE_GAIN`` (torchtitan's compiled over eager on H100),
        at most 1."""
        efficiency = self.compiled_efficiency or min(1.0, self.efficiency * COMPILE_GAIN)
        return dataclasses.replace(self, efficiency=efficiency, compiled_efficiency=efficiency)

    def replace(self, **changes: Any) -> Cluster:
        _refuse_overlap(f"cluster {self.name!r}", changes)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "cluster description") -> Cluster:
        """A cluster from a description (a JSON file's object): ``Cluster``'s fields, with ``intra`` and
        ``inter`` objects of ``Link``'s fields; a missing or unknown field is an error naming it."""
        _known_fields(source, d, cls, required=True)
        links = {}
        for name in ("intra", "inter"):
            if not isinstance(d[name], dict):
                raise ValueError(f"{source}: {name}={d[name]!r} must be an object such as "
                                 '{"bandwidth": 25e9, "latency": 1e-5}')
            _known_fields(f"{source}, {name}", d[name], Link, required=True)
            links[name] = _link(source, name, d[name])
        return cls(**{**d, **links})

    def updated(self, settings: dict[str, Any], source: str = "settings") -> Cluster:
        """This cluster with fields changed, a link's through a dot: ``{"memory": 40e9, "inter.bandwidth": 12.5e9}``."""
        top: dict[str, Any] = {}
        links: dict[str, dict[str, Any]] = {}
        for key, value in settings.items():
            head, dot, sub = key.partition(".")
            if dot and head not in ("intra", "inter"):
                raise ValueError(f"{source}: {key!r} names no field; a link's fields are intra.FIELD and inter.FIELD")
            (links.setdefault(head, {}) if dot else top)[sub or head] = value
        _known_fields(source, top, type(self))
        for name, changes in links.items():
            _known_fields(f"{source}, {name}", changes, Link)
        built = {k: _link(source, k, {**dataclasses.asdict(getattr(self, k)), **v}) for k, v in links.items()}
        try:
            return dataclasses.replace(self, **top, **built)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def preset(cls, name: str) -> Cluster:
        """``"dgx-a100"``, ``"dgx-h100"``, ``"grand-teton-h100"`` or ``"cpu"``."""
        key = name.lower().replace("_", "-")
        if key not in PRESETS:
            raise ValueError(f"unknown cluster {name!r}; the presets are {', '.join(PRESETS)} "
                             "(or build one with Cluster(...) or Cluster.measure_local(ranks))")
        return PRESETS[key]

    @classmethod
    def measure_local(cls, ranks: int = 2, *, seconds: float = 0.3,
                      launcher: Callable[..., list] | None = None) -> Cluster:
        """This machine as ``ranks`` local processes: one node whose ranks share its cores.

        Measures, on one rank running alone with the threads a rank of such a
        job gets, a float32 matmul's FLOP/s, the time of a small operator and
        the bytes per second of an AdamW step on 8M elements (28 bytes each,
        224 MB: beyond the caches; about ``3 * seconds``); on all ranks, the latency of a message step and
        the bandwidth of gloo between bursts of compute, as training meets
        them (``_measure_link``), and the share of compute speed a collective
        running beside it takes (``contention``, ``_measure_contention``; the
        median over ranks).
        ``launcher(fn, nprocs, *args)`` defaults to ``autopar.launch``.
        """
        if launcher is None:
            from autopar.runtime.launch import launch as launcher
        results = launcher(_measure_rank, ranks, seconds)
        flops, overhead, stream = results[0]["flops"], results[0]["op_overhead"], results[0]["memory_bandwidth"]
        latency = max(r["latency"] for r in results) if ranks > 1 else 50e-6
        bandwidth = min(r["bandwidth"] for r in results) if ranks > 1 else 1 * GB
        gather = max(r["gather"] for r in results) if ranks > 1 else 1.0
        scatter = max(r["scatter"] for r in results) if ranks > 1 else 1.0
        p2p = results[0]["p2p_latency"] if ranks > 1 else latency
        contention = statistics.median(r["contention"] for r in results) if ranks > 1 else 0.0
        memory = _physical_memory() / max(ranks, 1)
        link = Link(bandwidth, latency, gather=gather, scatter=scatter, p2p_latency=p2p)
        return cls(name=f"local cpu ({ranks} ranks, measured)", devices_per_node=ranks, memory=memory,
                   peak_flops=flops, peak_flops_fp32=flops, intra=link, inter=link, efficiency=1.0,
                   contention=contention, op_overhead=overhead, fused_attention=True, memory_bandwidth=stream,
                   cores=os.cpu_count() or 1)


def _refuse_overlap(source: str, d: dict[str, Any]) -> None:
    """The removed ``overlap`` figure (a free share of hidden communication) is an error saying what replaced it."""
    if "overlap" in d:
        raise ValueError(f"{source}: overlap={d['overlap']!r} is no longer a cluster figure: nothing overlaps for "
                         "free; the planner simulates the step program and charges compute beside a collective "
                         f"with contention (the share of compute a collective takes, default {CONTENTION}); remove "
                         "overlap (no overlap at all is contention=1)")


@functools.lru_cache(maxsize=None)  # one object per ring: the cost model keys its caches by the link's id
def _ring_link(intra: Link, inter: Link, size: int, nodes: int) -> Link:
    """The inter link of a ring of ``size`` ranks over ``nodes`` nodes: ``nodes - 1`` of its ``size - 1`` steps
    cross the network, the others NVLink."""
    latency = ((size - nodes) * intra.latency + (nodes - 1) * inter.latency) / (size - 1)
    return dataclasses.replace(inter, latency=latency)


def _link(source: str, name: str, fields: dict[str, Any]) -> Link:
    """``Link(**fields)``, an error naming the link's field as ``name.FIELD``."""
    try:
        return Link(**fields)
    except ValueError as e:
        raise ValueError(f"{source}: {name}.{str(e).removeprefix('link: ')}") from None


def _known_fields(source: str, d: dict[str, Any], cls: type, required: bool = False) -> None:
    """Raises a ``ValueError`` naming the fields of ``d`` that ``cls`` does not have, or (``required``) the fields
    without a default that ``d`` lacks, with what each means."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if cls is Cluster:
        _refuse_overlap(source, d)
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ValueError(f"{source}: unknown field{'s' * (len(unknown) > 1)} {', '.join(unknown)}; the fields are "
                         f"{', '.join(fields)}")
    figures = {**CLUSTER_FIGURES, **LINK_FIGURES}
    missing = [name for name, f in fields.items() if required and name not in d
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        what = "; ".join(f"{name} ({figures[name].meaning})" if name in figures else name for name in missing)
        raise ValueError(f"{source}: missing {what}")


def _physical_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 * GB


def _timed(fn: Callable[[], Any], seconds: float) -> float:
    """Seconds per call of ``fn``, median of batches filling about ``seconds``."""
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds / 4:
        fn()
        calls += 1
    per_batch = max(1, calls)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(per_batch):
            fn()
        times.append((time.perf_counter() - t) / per_batch)
    return sorted(times)[1]


def _timed_calls(fn: Callable[[], Any], calls: int, repeats: int = 1) -> float:
    """Seconds per call of ``fn``, the median of ``repeats`` batches of ``calls`` (collectives: ranks agree)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls)
    return sorted(times)[len(times) // 2]


def _measure_link(dist: Any) -> dict[str, float]:
    """Seconds per message step, bytes per second and the gather / scatter factors of this job's gloo links.

    As training meets them:

    An all-reduce of an activation's size (32 KiB, ``2(n-1)`` steps), not of
    single elements (gloo takes a shorter path for those), between bursts of
    compute, so that the peers must first be scheduled when ranks share
    cores, gives the latency per step. The bandwidth comes from the extra
    time of a 16 MiB all-reduce (gradients' size: smaller ones stay in the
    caches and measure up to 3x faster); a 16 MiB all-gather and
    reduce-scatter, against the ring's time, give the factors; a ping-pong
    between ranks 0 and 1 while the others wait gives ``p2p_latency``.
    """
    import torch

    n_ranks = dist.get_world_size()
    small, big = torch.zeros(8192), torch.zeros(2**22)
    c = torch.randn(128, 128)

    def compute() -> None:
        for _ in range(4):
            c @ c

    def loaded(fn: Callable[[], Any], calls: int, repeats: int = 1) -> float:  # every rank runs as many calls
        dist.barrier()
        return _timed_calls(lambda: (compute(), fn()), calls, repeats)

    dist.barrier()
    t_compute = _timed_calls(compute, 20, repeats=3)
    steps = 2 * (n_ranks - 1)
    t_small = loaded(lambda: dist.all_reduce(small), 15, repeats=3) - t_compute  # medians: the machine is noisy
    t_big = loaded(lambda: dist.all_reduce(big), 4) - t_compute
    extra_bytes = (steps / n_ranks) * (big.numel() - small.numel()) * 4
    latency, bandwidth = max(t_small / steps, 1e-6), extra_bytes / max(t_big - t_small, 1e-9)
    from autopar.runtime.zero_group import all_gather_async, reduce_scatter_async

    shard = torch.zeros(big.numel() // n_ranks)
    t_gather = loaded(lambda: all_gather_async(big).wait(), 4) - t_compute
    t_scatter = loaded(lambda: reduce_scatter_async(shard, big, dist.get_rank()).wait(), 4) - t_compute
    ring = (n_ranks - 1) * (latency + big.numel() * 4 / n_ranks / bandwidth)
    hop = _ping_pong(dist, small) - small.numel() * 4 / bandwidth
    return {"latency": latency, "bandwidth": bandwidth, "gather": max(t_gather / ring, 0.5),
            "scatter": max(t_scatter / ring, 0.5), "p2p_latency": min(max(hop, 1e-6), latency),
            "contention": _measure_contention(dist, compute, t_compute, t_big, big)}


def _measure_contention(dist: Any, compute: Callable[[], Any], t_compute: float, t_message: float,
                        message: Any, calls: int = 40, repeats: int = 3) -> float:
    """The share of compute speed a collective takes while it runs beside compute, as a ZeRO step meets it.

    Every rank times ``calls`` bursts of ``compute`` alone and then while asynchronous all-reduces of
    ``message`` (``t_message`` seconds each on an idle rank) queued ahead keep the link busy for the whole
    burst, as the runtime's prefetched gathers do: compute beside the link runs at ``t_alone / t_beside`` of
    its speed, and ``1 - t_alone / t_beside`` is taken (median of ``repeats``, between 0 and 1).
    """
    queued = max(2, math.ceil(1.5 * calls * t_compute / max(t_message, 1e-6)))
    shares = []
    for _ in range(repeats):
        dist.barrier()
        alone = _timed_calls(compute, calls)
        dist.barrier()
        handles = [dist.all_reduce(message, async_op=True) for _ in range(queued)]
        beside = _timed_calls(compute, calls)
        for h in handles:
            h.wait()
        shares.append(min(max(1.0 - alone / beside, 0.0), 1.0))
    return sorted(shares)[len(shares) // 2]


def _ping_pong(dist: Any, message: Any, calls: int = 50) -> float:
    """Seconds of one message between ranks 0 and 1 while the other ranks wait (the node has cores free)."""
    rank = dist.get_rank()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(calls if rank < 2 else 0):
        if rank == 0:
            dist.send(message, 1)
            dist.recv(message, 1)
        else:
            dist.recv(message, 0)
            dist.send(message, 0)
    elapsed = (time.perf_counter() - t) / (2 * calls)
    dist.barrier()
    return elapsed


def _measure_rank(seconds: float) -> dict[str, float]:
    """What ``Cluster.measure_local`` measures on one rank (runs inside a launched job)."""
    import torch
    import torch.distributed as dist

    together = dist.is_initialized() and dist.get_world_size() > 1
    n = 256
    a, b = torch.randn(n, n), torch.randn(n, n)
    x = torch.randn(8, requires_grad=True)

    def small_ops() -> None:  # forward + backward of a tiny op: what every graph node costs at least
        (x * 2).sum().backward()

    flops = overhead = stream = 0.0
    if not together or dist.get_rank() == 0:  # one rank alone, with the threads a rank of this job gets
        flops = 2 * n**3 / _timed(lambda: a @ b, seconds)
        overhead = _timed(small_ops, seconds) / 4  # mul, sum and their backwards
        w = torch.nn.Parameter(torch.zeros(2**23))
        w.grad = torch.ones_like(w)
        adam = torch.optim.AdamW([w])  # per element: weight read and written, gradient read, 2 states r/w
        stream = 28 * w.numel() / _timed(adam.step, seconds)
    if together:
        dist.barrier()
    out = {"flops": flops, "op_overhead": overhead, "memory_bandwidth": stream, "latency": 0.0, "bandwidth": 1.0,
           "p2p_latency": 0.0}
    if together:
        out.update(_measure_link(dist))
    return out


# Data-sheet numbers. A100 SXM 80GB: 312 TFLOP/s dense bf16, 19.5 fp32; NVLink 3 600 GB/s both
# directions; one 200 Gb/s HDR InfiniBand link per GPU. H100 SXM: 989 TFLOP/s dense bf16, 67 fp32;
# NVLink 4 900 GB/s; one 400 Gb/s NDR link per GPU. HBM: A100 80GB 2,039 GB/s, H100 SXM 3.35 TB/s. The
# usable memory leaves about 6 GB of each 80 GiB (86 GB) card to the CUDA context, NCCL and allocator
# fragmentation. Efficiency and narrow: fitted on seven of the ten GPT runs of Narayanan et al. 2021
# ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"), Table 1; the other
# three are held out to check the fit (benchmarks/calibrate_a100.py, docs/planner.md).
# The H100 preset reuses the A100 fit (no comparable public table was used to fit it).
A100_EFFICIENCY = 0.77
A100_NARROW = 500.0

# Grand Teton (the H100 hosts of torchtitan's published Llama 3 runs, benchmarks/llama3_h100_202412_torchtitan.md):
# 8 H100 per host on NVLink 4 (450 GB/s per direction), 96 GB HBM2e at 2.4 TB/s, one 400 Gb/s RDMA link per GPU,
# a 500 W power limit. Peak: the SXM data sheet's 989 TFLOP/s dense bf16 (torchtitan's MFU uses it; at 500 W the
# real peak lies between the NVL's 835 and it, which the fitted efficiency absorbs). Efficiency: fitted to
# torchtitan's eager Llama 3.1 8B FSDP run on 8 GPUs alone (autopar/planner/published.py, FITTED); narrow: the
# A100 fit's.
H100_500W_EFFICIENCY = 0.436
# The same hosts running torch.compile'd steps, which fuse the memory-bound operators the model charges one by
# one: the efficiency fitted to torchtitan's compiled 8B FSDP run on 8 GPUs alone (6,667 tokens/s per GPU against
# 5,762 eager, Table 1). Runs marked compiled are planned with it (published.py); autopar itself runs eager.
H100_500W_COMPILED_EFFICIENCY = 0.518
# What compiling gains where no compiled run was fitted: the two H100 fits' ratio, 1.19 on the matmuls (for
# torchtitan's 1.16x tokens/s, 6,667 against 5,762 per GPU: the rest of the step is charged as eager). The cpu preset's efficiency is already 1.0 (its per-operator overhead is its
# own figure), so it plans compiled steps as eager ones; measured there, compiled steps took 0.93-0.99x.
COMPILE_GAIN = H100_500W_COMPILED_EFFICIENCY / H100_500W_EFFICIENCY

# gloo between 4 ranks on 2 cores, as measured: ~1 ms per collective step, 60 us a message whose receiver
# has a core free; its reduce-scatter an all-reduce (twice a ring reduce-scatter's steps)
_CPU_LINK = Link(2.5 * GB, 1e-3, gather=1.3, scatter=2.5, p2p_latency=6e-5)


def _h100(name: str, memory: float, efficiency: float, memory_bandwidth: float,
          compiled_efficiency: float = 0.0) -> Cluster:
    """A node of 8 H100s on NVLink 4 (450 GB/s) with 400 Gb/s InfiniBand per GPU."""
    return Cluster(name=name, devices_per_node=8, memory=memory, peak_flops=989e12, peak_flops_fp32=67e12,
                   intra=Link(450 * GB, 4e-6), inter=Link(50 * GB, 8e-6), efficiency=efficiency, narrow=A100_NARROW,
                   memory_bandwidth=memory_bandwidth, compiled_efficiency=compiled_efficiency)


PRESETS: dict[str, Cluster] = {
    "dgx-a100": Cluster(
        name="DGX-A100 (8 x A100 80GB per node)", devices_per_node=8, memory=80 * GB,
        peak_flops=312e12, peak_flops_fp32=19.5e12, intra=Link(300 * GB, 5e-6), inter=Link(25 * GB, 10e-6),
        efficiency=A100_EFFICIENCY, narrow=A100_NARROW, memory_bandwidth=2039 * GB),
    "dgx-h100": _h100("DGX-H100 (8 x H100 80GB per node)", memory=80 * GB, efficiency=A100_EFFICIENCY,
                      memory_bandwidth=3350 * GB),
    "grand-teton-h100": _h100("Grand Teton (8 x H100 96GB HBM2e at 500 W per node)", memory=90 * GB,
                              efficiency=H100_500W_EFFICIENCY, memory_bandwidth=2400 * GB,
                              compiled_efficiency=H100_500W_COMPILED_EFFICIENCY),
    # this machine's CPU ranks (2 cores, gloo over loopback), as Cluster.measure_local(4) measured them
    "cpu": Cluster(
        name="local CPU (4 ranks on 2 cores, gloo)", devices_per_node=4, memory=5 * GB,
        peak_flops=100e9, peak_flops_fp32=100e9, intra=_CPU_LINK, inter=_CPU_LINK, efficiency=1.0, contention=1.0,
        op_overhead=4.5e-6, fused_attention=True, memory_bandwidth=5.5 * GB, cores=2),
}


def gb(nbytes: float) -> str:
    """Bytes as decimal gigabytes, the unit of the ZeRO paper and of device data sheets."""
    if nbytes >= 0.1 * GB or nbytes == 0:
        return f"{nbytes / GB:.1f} GB"
    if nbytes >= 1e6:
        return f"{nbytes / 1e6:.1f} MB"
    return f"{nbytes / 1e3:.1f} kB" if nbytes >= 1e3 else f"{nbytes:.0f} B"
