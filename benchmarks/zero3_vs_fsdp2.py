"""autopar zero=3 against torch's FSDP2 (``fully_shard`` per transformer block, then the root): same model,
same gloo ranks, same global batch, steps interleaved in one run.

Prints the median step time of each and the ratio autopar / FSDP2, and the peak bytes per rank of each and
their ratio (targets <= 1.0 on both); how they are measured is in ``fsdp2_compare.py``. The losses of both
are printed side by side.
Run: python benchmarks/zero3_vs_fsdp2.py [--steps 20] [--layers 4] [--width 256] [--ranks 2]
"""
from __future__ import annotations

import argparse

import autopar
from fsdp2_compare import AutoparStep, FSDP2Step, add_arguments, batch, compare, loss_fn, make_model, optimizer, report


def _rank(args: argparse.Namespace) -> dict:
    ids = batch(args)
    pm = autopar.parallelize(make_model(args), autopar.Mesh(dp=args.ranks), loss_fn=loss_fn, optimizer=optimizer,
                             zero=3, zero_prefetch=args.prefetch)
    out = compare({"autopar": AutoparStep(pm, ids), "fsdp2": FSDP2Step(args, ids)}, args)
    return {**out, "account": pm.memory()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args()
    report(autopar.launch(_rank, args.ranks, args),
           f"GPT-2 {args.layers}x{args.width}, vocab {args.vocab}, batch {args.batch}x{args.seq}, {args.ranks} gloo "
           f"ranks, {args.steps} interleaved steps; autopar zero=3 (prefetch {args.prefetch}) vs FSDP2 per block")


if __name__ == "__main__":
    main()
