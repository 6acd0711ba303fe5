"""Compile-time scaling: ``parallelize`` (capture and every pass, nothing run) for an 8 x 8 x 8 mesh.

GPT configurations of 12, 24, 48 and 96 layers are built on the meta device (no
memory for weights); for each, the bare ``torch.export`` time and the full
``parallelize`` time are printed side by side, with time per layer, so growth in
the number of layers can be read off (repeated layers are solved once).
Run: python benchmarks/compile_scaling.py [--layers 12 24 48 96] [--width 1024]
"""
from __future__ import annotations

import argparse
import logging
import time

import torch

import autopar
from autopar.capture import capture


def gpt(layers: int, width: int, vocab: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=16, vocab_size=vocab, n_positions=1024, use_cache=False)
    with torch.device("meta"):
        return GPT2LMHeadModel(cfg)


def loss_fn(out, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, nargs="+", default=[12, 24, 48, 96])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage (3: every rank's gathers)")
    args = p.parse_args()
    mesh = autopar.Mesh(dp=8, pp=8, tp=8)
    m = 8
    print(f"mesh {mesh}, zero={args.zero}, {m} microbatches, GPT width {args.width}, vocab {args.vocab}, "
          f"seq {args.seq}, meta device")
    warm = torch.zeros(1, 8, dtype=torch.long, device="meta")  # first-use costs out of the measurements
    autopar.parallelize(gpt(2, 64, 128), mesh, example_inputs=(warm.expand(64, 8),), example_target=warm.expand(64, 8),
                        loss_fn=loss_fn, microbatches=m)
    print(f"{'layers':>6} {'export s':>9} {'parallelize s':>14} {'ratio':>6} {'ms/layer':>9}")
    for layers in args.layers:
        ids = torch.zeros(mesh.dp * m, args.seq, dtype=torch.long, device="meta")
        local = ids[:1]
        t = time.perf_counter()
        capture(gpt(layers, args.width, args.vocab), (local,), {}, with_loss=True, loss_fn=loss_fn, target=local)
        export_s = time.perf_counter() - t
        t = time.perf_counter()
        autopar.parallelize(gpt(layers, args.width, args.vocab), mesh, example_inputs=(ids,), example_target=ids,
                            loss_fn=loss_fn, microbatches=m, zero=args.zero)
        total = time.perf_counter() - t
        print(f"{layers:>6} {export_s:>9.2f} {total:>14.2f} {total / export_s:>6.2f} {1e3 * total / layers:>9.1f}")


if __name__ == "__main__":
    main()
