"""autopar zero=3 against torch's FSDP2 (``fully_shard`` per transformer block, then the root): same model,
same gloo ranks, same global batch, steps interleaved in one run. With ``--replicas R``, hybrid sharding on
both: autopar's ``Mesh(dp=(R, ranks / R))`` against FSDP2 on a 2-D (replicate, shard) mesh (HSDP).

Prints the median step time of each and the ratio autopar / FSDP2, and the peak bytes per rank of each and
their ratio (targets <= 1.0 on both); how they are measured is in ``fsdp2_compare.py``. The losses of both
are printed side by side.
Run: python benchmarks/zero3_vs_fsdp2.py [--steps 20] [--layers 4] [--width 256] [--ranks 2] [--replicas 1]
     [--recompute full]
"""
from __future__ import annotations

import argparse

import autopar
from fsdp2_compare import AutoparStep, batch, compare, dp_mesh, fsdp2_steps, loss_fn, main, make_model, optimizer


def _rank(args: argparse.Namespace) -> dict:
    ids = batch(args)
    pm = autopar.parallelize(make_model(args), dp_mesh(args), loss_fn=loss_fn, optimizer=optimizer,
                             zero=3, zero_prefetch=args.prefetch, recompute=args.recompute)
    out = compare({"autopar": AutoparStep(pm, ids), **fsdp2_steps(args, ids)}, args)
    return {**out, "account": pm.memory()}


if __name__ == "__main__":
    main(_rank, __doc__, "autopar zero=3 (prefetch {prefetch}, recompute {recompute}) vs FSDP2 per block")
