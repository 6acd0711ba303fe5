"""autopar dp=2 against torch's DistributedDataParallel: same model, ranks and batch, interleaved.

Prints the median step time of each and the ratio autopar / DDP (target <= 1.05).
Run: python benchmarks/dp_vs_ddp.py [--steps 30] [--layers 4] [--width 256]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import autopar


def make_model(layers: int, width: int, vocab: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=256, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).train()


def loss_fn(out, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def _rank(args: argparse.Namespace) -> dict:
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    pm = autopar.parallelize(make_model(args.layers, args.width, args.vocab), autopar.Mesh(dp=2),
                             loss_fn=loss_fn, optimizer=optimizer)
    ddp_model = DistributedDataParallel(make_model(args.layers, args.width, args.vocab))
    ddp_opt = optimizer(list(ddp_model.parameters()))
    local = ids.chunk(2)[dist.get_rank()]

    def ddp_step() -> None:
        loss = loss_fn(ddp_model(local), local)
        loss.backward()
        ddp_opt.step()
        ddp_opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss.detach())  # autopar's step returns the global loss too

    def autopar_step() -> None:
        pm.step(ids, target=ids)

    times: dict[str, list[float]] = {"autopar": [], "ddp": []}
    for i in range(args.warmup + args.steps):
        order = [("autopar", autopar_step), ("ddp", ddp_step)]
        for name, fn in order if i % 2 == 0 else reversed(order):
            dist.barrier()
            t = time.perf_counter()
            fn()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args()
    medians = autopar.launch(_rank, 2, args)
    a = statistics.median(m["autopar"] for m in medians)
    d = statistics.median(m["ddp"] for m in medians)
    print(f"GPT-2 {args.layers}x{args.width}, vocab {args.vocab}, batch {args.batch}x{args.seq}, 2 gloo ranks, "
          f"{args.steps} interleaved steps")
    print(f"median step: autopar {a * 1e3:.1f} ms   DDP {d * 1e3:.1f} ms   ratio autopar/DDP {a / d:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
