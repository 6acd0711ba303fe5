"""autopar ``precision="bf16"`` with zero=3 against FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` (``fully_shard`` per transformer block, then the root): same model, same gloo ranks,
same global batch, steps interleaved in one run.

Both keep fp32 parameter shards, gradients and AdamW state, gather bf16 parameters, compute in bf16,
reduce-scatter gradients in fp32 and take the loss in fp32 (logits widened first). Prints the median step
time of each and the ratio autopar / FSDP2, and the peak bytes per rank of each and their ratio (targets
<= 1.0 on both); how they are measured is in ``fsdp2_compare.py``. The losses of both are printed.
Run: python benchmarks/bf16_vs_fsdp2.py [--steps 20] [--layers 4] [--width 256] [--ranks 2]
"""
from __future__ import annotations

import argparse

import torch

import autopar
from fsdp2_compare import AutoparStep, batch, compare, fsdp2_steps, loss_fn, main, make_model, optimizer


def _rank(args: argparse.Namespace) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    ids = batch(args)
    pm = autopar.parallelize(make_model(args), autopar.Mesh(dp=args.ranks), loss_fn=loss_fn, optimizer=optimizer,
                             zero=3, zero_prefetch=args.prefetch, precision="bf16")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out = compare({"autopar": AutoparStep(pm, ids), **fsdp2_steps(args, ids, policy)}, args)
    return {**out, "account": pm.memory()}


if __name__ == "__main__":
    main(_rank, __doc__, "bf16: autopar zero=3 (prefetch {prefetch}) vs FSDP2 MixedPrecisionPolicy(bf16, reduce fp32) "
         "per block")
