"""The ``autopar`` command line: ``autopar demo`` (the main job)."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from autopar.mesh import Mesh


def parse_mesh(text: str) -> Mesh:
    """``"dp=2,tp=2"`` -> ``Mesh(dp=2, tp=2)``."""
    try:
        sizes = {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise ValueError(f"cannot read mesh {text!r}; write it like dp=2,pp=2,tp=2") from None
    return Mesh(**sizes)


def _demo_model(layers: int, width: int, vocab: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=128, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).train()


def _loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits  # (B, S, V)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))


def _optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


def _batches(steps: int, batch: int, seq: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    # a learnable toy language: each sequence counts up from a random start
    starts = torch.randint(0, vocab, (steps, batch, 1), generator=g)
    return list((starts + torch.arange(seq)) % vocab)


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = width * done // total
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def _demo_rank(mesh: Mesh, args: argparse.Namespace, reference: list[float]) -> dict:
    import torch.distributed as dist

    from autopar.parallel import parallelize

    torch.set_num_threads(1)
    model = _demo_model(args.layers, args.width, args.vocab)
    pm = parallelize(model, mesh, loss_fn=_loss, optimizer=_optimizer, microbatches=args.microbatches)
    batches = _batches(args.steps, args.batch, args.seq, args.vocab)
    rank0 = dist.get_rank() == 0
    start = time.perf_counter()
    worst = 0.0
    for i, ids in enumerate(batches):
        loss = pm.step(ids, target=ids)
        worst = max(worst, abs(loss - reference[i]))
        if rank0:
            print(f"  {_bar(i + 1, len(batches))}  loss {loss:.6f}   single-device {reference[i]:.6f}", flush=True)
    elapsed = time.perf_counter() - start
    return {"time": elapsed, "worst": worst, "plan": pm.plan.summary() if rank0 else ""}


def demo(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="autopar demo", description="train a small GPT on local CPU ranks")
    p.add_argument("--mesh", default="dp=2", help="mesh axes, e.g. dp=2 (default)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--microbatches", type=int, default=2)
    args = p.parse_args(argv)
    mesh = parse_mesh(args.mesh)
    from runtime.launch import launch

    print(f"autopar demo: GPT-2 ({args.layers} layers, width {args.width}, vocab {args.vocab}), {mesh} on "
          f"{mesh.size} local CPU ranks, global batch {args.batch} x {args.seq}, {args.steps} steps")
    batches = _batches(args.steps, args.batch, args.seq, args.vocab)
    reference = []
    model = _demo_model(args.layers, args.width, args.vocab)
    opt = _optimizer(list(model.parameters()))
    t0 = time.perf_counter()
    for ids in batches:
        loss = _loss(model(ids), ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        reference.append(float(loss.detach()))
    single = time.perf_counter() - t0
    results = launch(_demo_rank, mesh.size, mesh, args, reference)
    r0 = results[0]
    print(f"\ndone: {args.steps} steps in {r0['time']:.2f} s on {mesh.size} ranks "
          f"(single device {single:.2f} s); largest loss difference {max(r['worst'] for r in results):.2e}")
    print(r0["plan"])
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    commands = {"demo": demo}
    if not argv or argv[0] not in commands:
        print(f"usage: autopar {{{','.join(commands)}}} [options] [--debug]", file=sys.stderr)
        return 2
    try:
        return commands[argv[0]](argv[1:])
    except Exception as e:  # noqa: BLE001 - one readable line unless --debug
        if debug:
            raise
        print(f"autopar {argv[0]}: error: {e}\n  (run with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
