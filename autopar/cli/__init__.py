"""The ``autopar`` command line: ``demo`` (the main job), ``inspect`` (plans and rewritten graphs) and
``plan`` (ranked parallelism choices for a model on a cluster)."""
from __future__ import annotations

import argparse
import ast
import difflib
import functools
import importlib
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from autopar.cli.arguments import parse_mesh
from autopar.core.mesh import Mesh


def load_factory(spec: str) -> Callable[[], Any]:
    """``"package.module:function"`` or ``"package.module:function(128, 25600, heads=160)"`` -> a callable that
    builds the model. Arguments are Python literals, read with ``ast.literal_eval`` (numbers, strings, tuples,
    lists, dicts, True/False/None); nothing in the text is run."""
    module, _, call = spec.partition(":")
    name = call.partition("(")[0].strip()
    if not module or not name:
        raise ValueError(f"{spec!r} is not MODULE:FACTORY or MODULE:FACTORY(ARGS) (e.g. autopar.planner:gpt3_175b or "
                         "'autopar.planner:gpt(128, 25600, 160)')")
    args, kwargs = literal_call(call, spec) if "(" in call else ((), {})
    try:
        fn = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        raise ValueError(f"cannot import {module!r} ({e}); run from the folder that holds it or install it") from None
    except AttributeError:
        raise ValueError(f"module {module!r} has no {name!r}") from None
    if not callable(fn):
        raise ValueError(f"{module}:{name} is a {type(fn).__name__}, not a function that builds a model")
    return functools.partial(fn, *args, **kwargs)


def literal_call(call: str, spec: str) -> tuple[tuple, dict[str, Any]]:
    """The positional and keyword arguments of ``"name(1, 2, k=3)"``, each a Python literal."""
    try:
        tree = ast.parse(call.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError(f"cannot read the call in {spec!r}; write it like 'module:factory(1, 2, name=3)'") from None
    if not isinstance(tree, ast.Call) or not isinstance(tree.func, ast.Name):
        raise ValueError(f"{spec!r}: after the colon write one call, FACTORY(ARGS), e.g. gpt(128, 25600, 160)")

    def literal(node: ast.expr, where: str) -> Any:
        try:
            return ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError):
            raise ValueError(f"{spec!r}: {where} {ast.unparse(node)!r} is not a literal (numbers, strings, tuples, "
                             "lists, dicts, True, False, None); nothing else is evaluated") from None

    if any(isinstance(a, ast.Starred) for a in tree.args) or any(k.arg is None for k in tree.keywords):
        raise ValueError(f"{spec!r}: write the arguments out; * and ** are not read")
    return (tuple(literal(a, f"argument {i + 1}") for i, a in enumerate(tree.args)),
            {k.arg: literal(k.value, f"argument {k.arg}=") for k in tree.keywords})


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
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage over dp")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--draw", metavar="PNG", help="draw which rank holds which shard of which layer")
    args = p.parse_args(argv)
    mesh = parse_mesh(args.mesh)
    model, inputs, target, loss_fn = example_for(load_factory(args.factory)(), args.batch, args.seq)
    pm = parallelize(model, mesh, example_inputs=inputs, example_target=target, loss_fn=loss_fn,
                     microbatches=args.microbatches, schedule=args.schedule, zero=args.zero)
    print(pm.plan)
    if args.draw:
        from autopar.cli.drawing import draw_plan

        print(f"plan picture: {draw_plan(pm.compile(inputs, {}, target, with_loss=target is not None), mesh, args.draw)}")
    if args.rank is not None:
        code = pm.graph(args.rank).code
        if args.diff:
            before = pm.compile(inputs, {}, target, with_loss=target is not None).captured.gm.code
            sys.stdout.writelines(difflib.unified_diff(before.splitlines(True), code.splitlines(True),
                                                       "captured", f"rank {args.rank}"))
        else:
            print(f"\nrank {args.rank} runs:")
            calls = expert_calls(pm.graph(args.rank), mesh, args.rank)
            for line in code.splitlines():
                note = next((n for name, n in calls.items() if f"self.{name}(" in line), "")
                print((">> " if "torch.ops.autopar" in line or note else "   ") + line + (f"  # {note}" if note else ""))
    return 0


def expert_calls(gm: torch.fx.GraphModule, mesh: Mesh, rank: int) -> dict[str, str]:
    """The graph's expert-parallel submodules (one per mixture-of-experts layer), each with what rank ``rank``
    runs in it: the experts it holds and the all-to-alls over ep that dispatch and combine the tokens."""
    from autopar.core.expert_ops import ExpertParallel

    out = {}
    for name, module in gm.named_children():
        if isinstance(module, ExpertParallel):
            held = module.held_by(mesh.coord(rank, "ep"))
            out[name] = (f"{module.name}: this rank's experts {held.start}-{held.stop - 1} of {module.count}; "
                         f"row counts all_to_all, dispatch and combine all_to_all_v over ep (both again in backward)")
    return out


def demo(argv: list[str]) -> int:
    from autopar.cli.demo import run

    return run(argv)


def plan(argv: list[str]) -> int:
    from autopar.planner import plan as make_plan, sequence_of

    p = argparse.ArgumentParser(prog="autopar plan", description="rank dp x pp x tp, ZeRO, schedule and microbatch "
                                "choices for a model on a cluster; the model is built on the meta device")
    p.add_argument("factory", help="MODULE:FACTORY or 'MODULE:FACTORY(ARGS)' (literal arguments) returning a model "
                   "or (model, inputs[, target, loss_fn]), e.g. 'autopar.planner:gpt(128, 25600, 160)'")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--cluster", default="dgx-a100", help="dgx-a100, dgx-h100, grand-teton-h100, cpu, or a JSON file describing one "
                   "(Cluster's fields; intra and inter as {\"bandwidth\": ..., \"latency\": ...})")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="change a figure of the cluster, e.g. --set memory=40e9 --set inter.bandwidth=12.5e9")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=int, help="sequences per step (default: 2 per device)")
    batch.add_argument("--local-batch", type=int, help="sequences per data-parallel rank per step (batch='local'): "
                       "each configuration trains this times its dp, and is ranked by the time per local batch")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (models with a sequence dim)")
    p.add_argument("--precision", default="mixed", choices=["mixed", "bf16", "fp32"])
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd-momentum", "sgd"])
    p.add_argument("--top", type=int, default=10, help="rows of the table (and of the JSON)")
    p.add_argument("--runnable", action="store_true", help="only configurations autopar runs today")
    p.add_argument("--expert-imbalance", type=float, default=1.0, help="models with routed experts: the busiest "
                   "rank's routed rows over the mean under expert parallelism (1: balanced routing)")
    p.add_argument("--compile", action="store_true", help="plan steps compiled by inductor (parallelize(compile=True)): "
                   "the cluster's compiled efficiency")
    p.add_argument("--json", action="store_true", help="print JSON for tools instead of the table")
    args = p.parse_args(argv)
    for option, value, what in (("--devices", args.devices, "devices of the job"),
                                ("--global-batch", args.global_batch, "sequences per step"),
                                ("--local-batch", args.local_batch, "sequences per data-parallel rank"),
                                ("--seq", args.seq, "tokens per sequence"), ("--top", args.top, "rows to print")):
        if value is not None and value < 1:
            raise ValueError(f"{option} {value}: must be an integer >= 1 ({what})")
    cluster = cluster_of(args.cluster, args.set, args.devices)
    with torch.device("meta"):  # planning needs shapes, not weights
        built = load_factory(args.factory)()
    model, inputs = (built[0], tuple(built[1])) if isinstance(built, tuple) else (built, None)
    rows = {"local_batch": args.local_batch} if args.local_batch else \
        {"global_batch": args.global_batch or 2 * args.devices}
    result = make_plan(model, args.devices, cluster=cluster, **rows,
                       seq_len=args.seq if sequence_of(inputs, model) else None, precision=args.precision,
                       optimizer=args.optimizer, example_inputs=inputs, runnable_only=args.runnable,
                       expert_imbalance=args.expert_imbalance, top=max(args.top, 20), compile=args.compile)
    print(result.to_json(top=args.top) if args.json else result.render(top=args.top))
    return 0


def cluster_of(name: str, settings: list[str], devices: int) -> Any:
    """The ``--cluster`` preset or JSON description, with the ``--set FIELD=VALUE`` changes (values are literals).
    A node described larger than the job (``--devices``) is an error: say the node the job runs on."""
    from autopar.planner.cluster import PRESETS, Cluster

    path = Path(name)
    if name.lower().replace("_", "-") in PRESETS:
        cluster, described = Cluster.preset(name), False
    elif path.suffix != ".json":
        raise ValueError(f"--cluster {name}: not a preset ({', '.join(PRESETS)}) nor a .json file describing one "
                         "(Cluster's fields)")
    else:
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise ValueError(f"--cluster {name}: cannot read it ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--cluster {name}: not JSON ({e.msg}, line {e.lineno})") from None
        if not isinstance(data, dict):
            raise ValueError(f"--cluster {name}: the file must hold one object of Cluster's fields")
        cluster, described = Cluster.from_dict(data, source=f"--cluster {name}"), "devices_per_node" in data
    changes = {}
    for item in settings:
        field, eq, text = item.partition("=")
        if not eq or not field.strip():
            raise ValueError(f"--set {item!r}: write FIELD=VALUE, e.g. --set memory=40e9")
        try:
            changes[field.strip()] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"--set {item!r}: {text.strip()!r} is not a number (or another literal)") from None
    cluster = cluster.updated(changes, source="--set") if changes else cluster
    if (described or "devices_per_node" in changes) and cluster.devices_per_node > devices:
        raise ValueError(f"the cluster's node of devices_per_node={cluster.devices_per_node} devices is larger than "
                         f"the job's --devices {devices}; describe the node the job runs on (devices_per_node <= "
                         f"{devices}) or plan more devices")
    return cluster


COMMANDS = {"demo": demo, "inspect": inspect, "plan": plan}


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

