"""What the pipeline benchmarks share: the skip-free chains, their torch.distributed.pipelining twin, timeline sums.

A chain is ``depth`` blocks in float32, one (rows, width) tensor crossing
every cut; the ranks run one intra-op thread each. Two kinds (``CHAINS``):

- ``mlp``: token ids into a small embedding, then blocks shaped like a
  transformer block's MLP with its residual add,
  x + Linear(4d, d)(GELU(Linear(d, 4d)(x))), without biases (as in LLaMA,
  Mistral or PaLM). The weight gradients are half the matmul work of a
  backward, the rest is elementwise, as in a transformer. The embedding makes
  the first stage compute its input's gradient, as every stage of a
  transformer does (the first one for the embedding's), so that the stages
  stay equal; its table is small (``VOCAB`` rows), so that it adds little.
- ``tanh``: float inputs into Linear(d, d) + Tanh blocks with bias, the first
  chain: one small matmul per block, so that messages and per-action
  overheads weigh more; its first stage computes no input gradient.

A timeline is one rank's ``(action, start, end)`` records of a step
(``ParallelModel.timeline``). Imported by ``benchmarks/pipeline.py`` and
``benchmarks/zero_bubble.py``; the ranks import it too (the benchmarks' folder
is on their path).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autopar.core.schedule import COMPUTE_KINDS, Action
from autopar.runtime.trace import pipeline_part

Timeline = list[tuple[str, float, float]]  # (action, start, end), perf_counter seconds
Linear = Callable[..., torch.Tensor]  # F.linear(x, weight, bias=None), or a function computing the same


class MlpBlock(nn.Module):
    """x + Linear(4d, d)(GELU(Linear(d, 4d)(x))), no biases: a transformer block's MLP and its residual add.

    ``linear`` computes the matmuls (the zero-bubble benchmark's CPU timing
    passes autopar's split form); the model's own forward uses ``F.linear``.
    """

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor, linear: Linear = F.linear) -> torch.Tensor:
        h = F.gelu(linear(x, self.up.weight))  # (rows, 4 * width)
        return x + linear(h, self.down.weight)  # (rows, width)


class TanhBlock(nn.Module):
    """Linear(d, d) + Tanh, with bias."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, linear: Linear = F.linear) -> torch.Tensor:
        return linear(x, self.linear.weight, self.linear.bias).tanh()  # (rows, width)


@dataclass(frozen=True)
class ChainKind:
    """A kind of chain: its block, whether it starts from token ids (an embedding), its default sizes."""

    block: type[nn.Module]
    tokens: bool
    blocks: int
    width: int
    rows: int


VOCAB = 512  # rows of the mlp chain's embedding
# an mlp action (F, B or W of one stage and microbatch at pp=2) is about 20-25 ms of one core, a tanh one 3-5 ms
CHAINS = {"mlp": ChainKind(MlpBlock, tokens=True, blocks=8, width=512, rows=128),
          "tanh": ChainKind(TanhBlock, tokens=False, blocks=32, width=512, rows=32)}


class Chain(nn.Module):
    """``depth`` blocks of the chain ``kind`` (a key of ``CHAINS``), after an embedding if it takes token ids:
    no skips across blocks, one (rows, width) tensor crosses each cut."""

    def __init__(self, kind: str, width: int, depth: int, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, width) if CHAINS[kind].tokens else nn.Identity()
        self.blocks = nn.ModuleList(CHAINS[kind].block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)  # (rows, width)
        for block in self.blocks:
            x = block(x)  # (rows, width)
        return x


def chain(args: argparse.Namespace) -> Chain:
    """The chain the options describe."""
    return Chain(args.chain, args.width, args.blocks)


def describe(args: argparse.Namespace) -> str:
    """The chain in a few words, e.g. "32 x (Linear(512, 512) + Tanh)"."""
    d = args.width
    if args.chain == "mlp":
        return (f"Embedding({VOCAB}, {d}), {args.blocks} x (x + Linear({d}, {4 * d}) + GELU + Linear({4 * d}, {d})), "
                f"no biases")
    return f"{args.blocks} x (Linear({d}, {d}) + Tanh)"


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)


def cut_blocks(depth: int, n_stages: int) -> list[int]:
    """The first block of stages 1..n-1: equal numbers of blocks per stage."""
    if depth < n_stages:
        raise ValueError(f"{depth} blocks cannot fill {n_stages} stages; pass --blocks {n_stages} or more")
    return [k * depth // n_stages for k in range(1, n_stages)]


def add_chain_arguments(p: argparse.ArgumentParser, default: str) -> None:
    """The chain's kind and size and the warm-up, options of every chain benchmark; ``default``: the kind.

    Sizes left out take the kind's defaults (``CHAINS``): call `chain_sizes` on the parsed arguments.
    """
    p.add_argument("--chain", choices=list(CHAINS), default=default,
                   help=f"blocks of the chain: mlp (transformer MLP + residual) or tanh (Linear + Tanh); "
                        f"default {default}")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    for name, what in (("blocks", "blocks in the chain"), ("width", "d"), ("rows", "rows per microbatch")):
        defaults = ", ".join(f"{kind} {getattr(c, name)}" for kind, c in CHAINS.items())
        p.add_argument(f"--{name}", type=int, help=f"{what} (default: {defaults})")


def chain_sizes(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the sizes it leaves out set to its chain's defaults."""
    for name in ("blocks", "width", "rows"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(CHAINS[args.chain], name))
    return args


def header(benchmark: str, args: argparse.Namespace) -> str:
    """The first lines of a chain benchmark's output: the date, the machine, its load, the chain."""
    return (f"autopar {benchmark} benchmark, {datetime.date.today()}, {platform.system()} {platform.machine()}, "
            f"{os.cpu_count()} CPU cores, gloo, torch {torch.__version__}, 1 intra-op thread per rank; "
            f"load average before {os.getloadavg()[0]:.2f}\n"
            f"chain: {describe(args)}, float32, {args.rows} rows per microbatch, SGD; {args.warmup} warm-up steps")


def chain_batch(args: argparse.Namespace, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``m`` microbatches of ``args.rows`` rows: inputs (token ids or floats) and targets."""
    g = torch.Generator().manual_seed(m)
    if CHAINS[args.chain].tokens:
        x = torch.randint(VOCAB, (args.rows * m,), generator=g)  # (m * rows,)
    else:
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
    model = chain(args)
    modules = [nn.Sequential(*([model.embed] if s == 0 else []), *model.blocks[bounds[s]:bounds[s + 1]])
               for s in stage_ids]
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
