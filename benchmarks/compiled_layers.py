"""What compile=True costs as the model grows: a LLaMA of 2, 8 and 32 layers on 4 local ranks (dp2 x tp2).

For each depth every rank parallelizes the model (``compile=True``) and runs its first step: the wall time of
that first step (export, passes, inductor's compilation, the step) and inductor's compile seconds in the
rank's process (``pm.plan.compiled``, the most over the ranks), beside the first step of ``compile=False``.
The regions of identical layers share one compiled function, so inductor's time should stay about flat in the
layers; what grows with them is the export and the passes, as eagerly. A second run (``--second``) repeats
the depths in fresh processes, where inductor's FX graph cache on disk serves every region.

Run: PYTHONPATH=. python benchmarks/compiled_layers.py [--layers 2,8,32] [--second]
"""
from __future__ import annotations

import argparse
import time

import torch

import autopar
from tp_vs_dtensor import make_llama, optimizer


def lm_loss(out, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def _rank(args: argparse.Namespace, compiled: bool) -> dict:
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    pm = autopar.parallelize(make_llama(args), autopar.Mesh(dp=2, tp=2), loss_fn=lm_loss, optimizer=optimizer,
                             compile=compiled)
    pm.step(ids, target=ids)
    first = time.perf_counter() - start
    plan = pm.plan.compiled
    return {"first": first, "inductor": plan.seconds if plan else 0.0, "compiles": plan.compiles if plan else 0,
            "regions": plan.regions if plan else 0, "distinct": plan.distinct if plan else 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="2,8,32")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--second", action="store_true", help="each depth again in fresh processes (warm disk cache)")
    args = p.parse_args()
    print(f"LLaMA of width {args.width}, batch {args.batch}x{args.seq}, Mesh(dp=2, tp=2) on 4 local ranks")
    for layers in [int(x) for x in args.layers.split(",")]:
        a = argparse.Namespace(**{**vars(args), "layers": layers})
        eager = autopar.launch(_rank, 4, a, False)
        runs = [autopar.launch(_rank, 4, a, True)] + ([autopar.launch(_rank, 4, a, True)] if args.second else [])
        for i, compiled in enumerate(runs):
            worst = max(compiled, key=lambda r: r["first"])
            print(f"{layers:>3} layers{' (again)' if i else ''}: first step compiled {worst['first']:.1f} s "
                  f"(inductor {max(r['inductor'] for r in compiled):.1f} s, {worst['compiles']} compilations for "
                  f"{worst['regions']} regions, {worst['distinct']} distinct), eager "
                  f"{max(r['first'] for r in eager):.1f} s")


if __name__ == "__main__":
    main()
