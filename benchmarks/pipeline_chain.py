"""What the pipeline benchmarks share: the skip-free chain, its torch.distributed.pipelining twin, timeline sums.

The chain is ``depth`` wide Linear+Tanh blocks in float32; the ranks run one
intra-op thread each, so compute dominates communication. A timeline is one
rank's ``(action, start, end)`` records of a step (``ParallelModel.timeline``).
Imported by ``benchmarks/pipeline.py`` and ``benchmarks/zero_bubble.py``; the
ranks import it too (the benchmarks' folder is on their path).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autopar.core.schedule import COMPUTE_KINDS, Action
from autopar.runtime.trace import pipeline_part

Timeline = list[tuple[str, float, float]]  # (action, start, end), perf_counter seconds


class Chain(nn.Module):
    """``depth`` blocks of Linear(width, width) + Tanh: no skips, one (rows, width) tensor crosses each cut."""

    def __init__(self, width: int, depth: int, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)  # (rows, width)
        return x


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)


def cut_blocks(depth: int, n_stages: int) -> list[int]:
    """The first block of stages 1..n-1: equal numbers of blocks per stage."""
    if depth < n_stages:
        raise ValueError(f"{depth} blocks cannot fill {n_stages} stages; pass --blocks {n_stages} or more")
    return [k * depth // n_stages for k in range(1, n_stages)]


def add_chain_arguments(p: argparse.ArgumentParser) -> None:
    """The chain's size and the warm-up, options of every chain benchmark."""
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    p.add_argument("--blocks", type=int, default=32, help="Linear+Tanh blocks in the chain")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--rows", type=int, default=32, help="rows per microbatch")


def header(benchmark: str, args: argparse.Namespace) -> str:
    """The first lines of a chain benchmark's output: the date, the machine, its load, the chain."""
    return (f"autopar {benchmark} benchmark, {datetime.date.today()}, {platform.system()} {platform.machine()}, "
            f"{os.cpu_count()} CPU cores, gloo, torch {torch.__version__}, 1 intra-op thread per rank; "
            f"load average before {os.getloadavg()[0]:.2f}\n"
            f"chain: {args.blocks} x (Linear({args.width}, {args.width}) + Tanh), float32, {args.rows} rows per "
            f"microbatch, SGD; {args.warmup} warm-up steps")


def chain_batch(args: argparse.Namespace, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``m`` microbatches of ``args.rows`` rows: inputs and targets."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(args.rows * m, args.width, generator=g)  # (m * rows, width)
    return x, torch.randn(args.rows * m, args.width, generator=g).tanh()


def p2p_seconds(args: argparse.Namespace, repeats: int = 30) -> float:
    """One-way time of one activation (rows, width) between ranks 0 and 1: half the median round trip."""
    t = torch.randn(args.rows, args.width)
    rank = dist.get_rank()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / 2


def torch_chain_step(args: argparse.Namespace, schedule_cls: type, m: int, stage_ids: list[int],
                     n_stages: int) -> Callable[[], float]:
    """One training step of torch.distributed.pipelining on this rank's stages of the chain; returns the global loss.

    The chain is cut into ``n_stages`` equal stages and this rank builds a
    ``PipelineStage`` for each of ``stage_ids``; a single-stage schedule
    class gets the stage, a multi-stage one the list.
    """
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    bounds = [0, *cut_blocks(args.blocks, n_stages), args.blocks]
    blocks = Chain(args.width, args.blocks).blocks
    modules = [nn.Sequential(*blocks[bounds[s]:bounds[s + 1]]) for s in stage_ids]
    stages = [PipelineStage(mod, s, n_stages, torch.device("cpu")) for mod, s in zip(modules, stage_ids)]
    schedule = schedule_cls(stages[0] if issubclass(schedule_cls, PipelineScheduleSingle) else stages, m, loss_fn=mse)
    opt = sgd([p for mod in modules for p in mod.parameters()])
    x, y = chain_batch(args, m)
    first, last = 0 in stage_ids, n_stages - 1 in stage_ids
    holder = torch.tensor(dist.get_rank() if last else 0)
    dist.all_reduce(holder)  # the rank holding the last stage, which has the loss

    def step() -> float:
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if last else {}
        schedule.step(*([x] if first else []), return_outputs=False, **kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = torch.stack(losses).detach().double().mean() if losses else torch.zeros((), dtype=torch.float64)
        dist.broadcast(loss, src=int(holder))  # autopar's step returns the global loss on every rank too
        return float(loss)

    return step


def kind_of(action: str) -> str:
    return Action.parse(action).kind


def time_in(timeline: Timeline, kinds: tuple[str, ...]) -> float:
    return sum(end - start for a, start, end in timeline if kind_of(a) in kinds)


def step_fractions(per_rank: list[Timeline], kinds: tuple[tuple[str, ...], ...]) -> tuple[float, ...]:
    """The bubble of one step, then the share of each group of ``kinds``; each a mean over ranks of time / span.

    The bubble is 1 - (time in F, B and W) / span. The span runs from the
    step's first pipeline action on any rank to its last on any rank (the step
    actions after the pipeline, such as the optimizer, are left out), so a rank
    that finishes early counts its wait as bubble, as in theory.
    """
    parts = [pipeline_part(tl) for tl in per_rank]
    span = max(tl[-1][2] for tl in parts) - min(tl[0][1] for tl in parts)
    bubble = statistics.mean(1 - time_in(tl, COMPUTE_KINDS) / span for tl in parts)
    return bubble, *(statistics.mean(time_in(tl, k) / span for tl in parts) for k in kinds)


def durations(timelines: list[Timeline], kind: str) -> float:
    """The median duration of the actions of ``kind`` over all ``timelines``."""
    return statistics.median(end - start for tl in timelines for a, start, end in tl if kind_of(a) == kind)
