"""autopar dp=2 against torch's DistributedDataParallel: same models, ranks and batches, interleaved.

Each shape builds both from one seed, then alternates their steps (autopar first
on even steps, DDP first on odd ones, a barrier before each) and takes each
one's median step time; a shape's ratio is autopar / DDP (target <= 1.0). Both
run with their default options (autopar's ``bucket_mb``, DDP's
``bucket_cap_mb``). The MLPs (SGD) are communication-bound: their backward is
short next to the all-reduce of their gradients, so a step is only as fast as
the overlap of the two. GPT-2 (AdamW) is compute-bound: the optimizer and the
attention dominate.

Run: PYTHONPATH=. python benchmarks/dp_vs_ddp.py [--steps 20] [--rounds 3] [--shapes mlp6x1024,gpt2-4x256]
(PYTHONPATH=. makes a second checkout measure its own code, not the installed one.)
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import autopar


@dataclass(frozen=True)
class Shape:
    """One model to compare: its name, how to build it, its global batch (input, target), loss and optimizer."""

    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    optimizer: Callable[[list], torch.optim.Optimizer]
    about: str


def mlp_shape(depth: int, width: int, batch: int = 64) -> Shape:
    """``depth`` Linear(width, width) + ReLU layers, MSE, SGD: a communication-bound step."""

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])

    def data() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)

    params = depth * (width * width + width)
    return Shape(f"mlp{depth}x{width}", build, data, torch.nn.functional.mse_loss,
                 lambda ps: torch.optim.SGD(ps, lr=1e-3), f"MLP {depth}x{width}, {params / 1e6:.1f}M params, "
                 f"SGD, batch {batch}")


def gpt2_shape(layers: int, width: int, vocab: int = 4096, batch: int = 8, seq: int = 128) -> Shape:
    """GPT-2 (transformers) with AdamW: a compute-bound step."""

    def build() -> torch.nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=256, use_cache=False,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg).train()

    def data() -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
        return ids, ids

    def loss(out: Any, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    return Shape(f"gpt2-{layers}x{width}", build, data, loss, lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                 f"GPT-2 {layers}x{width}, vocab {vocab}, AdamW, batch {batch}x{seq}")


SHAPES: dict[str, Callable[[], Shape]] = {
    "mlp6x1024": lambda: mlp_shape(6, 1024),
    "mlp12x512": lambda: mlp_shape(12, 512),
    "mlp3x2048": lambda: mlp_shape(3, 2048),
    "mlp24x256": lambda: mlp_shape(24, 256),
    "gpt2-4x256": lambda: gpt2_shape(4, 256),
}


def _steps(shape: Shape, bucket_mb: float | None) -> dict[str, Callable[[], None]]:
    """One step of each contender on the global batch (DDP on this rank's half; both return the global loss)."""
    x, y = shape.batch()
    options = {} if bucket_mb is None else {"bucket_mb": bucket_mb}
    pm = autopar.parallelize(shape.build(), autopar.Mesh(dp=2), loss_fn=shape.loss, optimizer=shape.optimizer,
                             **options)
    ddp = DistributedDataParallel(shape.build())
    ddp_opt = shape.optimizer(list(ddp.parameters()))
    lx, ly = x.chunk(2)[dist.get_rank()], y.chunk(2)[dist.get_rank()]

    def ddp_step() -> None:
        loss = shape.loss(ddp(lx), ly)
        loss.backward()
        ddp_opt.step()
        ddp_opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss.detach())  # autopar's step returns the global loss too

    return {"autopar": lambda: pm.step(x, target=y), "ddp": ddp_step}


def time_interleaved(steps: dict[str, Callable[[], None]], n: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of ``n`` interleaved steps of each contender after ``warmup`` untimed ones."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    order = list(steps.items())
    for i in range(warmup + n):
        for name, fn in order if i % 2 == 0 else reversed(order):
            dist.barrier()
            t = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append(time.perf_counter() - t)
    return times


def _rank(names: list[str], args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Per shape, every timed step of each contender, all rounds (rounds cycle through the shapes)."""
    torch.set_num_threads(args.threads)
    contenders = {name: _steps(SHAPES[name](), args.bucket_mb) for name in names}
    out: dict[str, dict[str, list[float]]] = {name: {"autopar": [], "ddp": []} for name in names}
    for _ in range(args.rounds):
        for name in names:
            for k, v in time_interleaved(contenders[name], args.steps, args.warmup).items():
                out[name][k] += v
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--steps", type=int, default=20, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--bucket-mb", type=float, default=None, help="autopar's bucket_mb (default: its default)")
    args = p.parse_args()
    names = args.shapes.split(",")
    per_rank = autopar.launch(_rank, 2, names, args)
    print(f"2 gloo ranks, {args.threads} thread(s) each, {args.rounds} rounds x {args.steps} interleaved steps, "
          "median step time (ms) over every step of both ranks")
    print("| shape | model | autopar | DDP | autopar / DDP |\n|---|---|---:|---:|---:|")
    for name in names:
        a = statistics.median(t for r in per_rank for t in r[name]["autopar"])
        d = statistics.median(t for r in per_rank for t in r[name]["ddp"])
        print(f"| {name} | {SHAPES[name]().about} | {a * 1e3:.1f} | {d * 1e3:.1f} | {a / d:.2f} |")


if __name__ == "__main__":
    main()
