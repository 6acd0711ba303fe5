"""The ``autopar`` command line: ``demo`` (the main job) and ``inspect`` (plans and rewritten graphs)."""
from __future__ import annotations

import argparse
import difflib
import importlib
import sys
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


def load_factory(spec: str) -> Any:
    """``"package.module:function"`` -> the function."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{spec!r} is not MODULE:FACTORY (e.g. mypackage.models:build)")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        raise ValueError(f"cannot import {module!r} ({e}); run from the folder that holds it or install it") from None
    except AttributeError:
        raise ValueError(f"module {module!r} has no {name!r}") from None


def example_for(built: Any, batch: int, seq: int) -> tuple[torch.nn.Module, tuple, Any, Any]:
    """(model, inputs, target, loss_fn) from what a factory returned: a model, or a tuple starting with one."""
    if isinstance(built, tuple):
        model, inputs, *rest = built
        return model, tuple(inputs), (rest[0] if rest else None), (rest[1] if len(rest) > 1 else None)
    model = built
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is None:
        raise ValueError("the factory returned only a model, and autopar cannot tell its inputs; "
                         "return (model, example_inputs) or (model, example_inputs, target, loss_fn)")
    ids = torch.randint(0, embeddings.num_embeddings, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, (ids,), None, None


def inspect(argv: list[str]) -> int:
    from autopar.parallel import parallelize

    p = argparse.ArgumentParser(prog="autopar inspect", description="print the plan and a rank's rewritten graph")
    p.add_argument("factory", help="MODULE:FACTORY returning a model or (model, inputs[, target, loss_fn])")
    p.add_argument("--mesh", default="dp=2,pp=2,tp=2")
    p.add_argument("--rank", type=int, help="print this rank's rewritten graph, collectives marked '>>'")
    p.add_argument("--diff", action="store_true", help="with --rank: diff against the captured graph")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=16)
    args = p.parse_args(argv)
    mesh = parse_mesh(args.mesh)
    model, inputs, target, loss_fn = example_for(load_factory(args.factory)(), args.batch, args.seq)
    pm = parallelize(model, mesh, example_inputs=inputs, example_target=target, loss_fn=loss_fn,
                     microbatches=args.microbatches, schedule=args.schedule)
    print(pm.plan)
    if args.rank is not None:
        code = pm.graph(args.rank).code
        if args.diff:
            before = pm.compile(inputs, {}, target, with_loss=target is not None).captured.gm.code
            sys.stdout.writelines(difflib.unified_diff(before.splitlines(True), code.splitlines(True),
                                                       "captured", f"rank {args.rank}"))
        else:
            print(f"\nrank {args.rank} runs:")
            for line in code.splitlines():
                print((">> " if "torch.ops.autopar" in line else "   ") + line)
    return 0


def demo(argv: list[str]) -> int:
    from autopar.demo import run

    return run(argv)


COMMANDS = {"demo": demo, "inspect": inspect}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: autopar {{{','.join(COMMANDS)}}} [options] [--debug]", file=sys.stderr)
        return 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except Exception as e:  # noqa: BLE001 - one readable line unless --debug
        if debug:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"autopar {argv[0]}: error: {first}\n  (run with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
